"""opsmath.optim.AdamW against torch.optim.AdamW + clip_grad_norm_ (the Triton path through the
interpreter on CPU, the reference path on CPU tensors)."""
import copy

import pytest
import torch
import torch.nn as nn

from opsmath.optim import AdamW

from conftest import DEVICE


def _model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.LayerNorm(37), nn.Linear(37, 5))
    return m.to(device, dtype)


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0, lr=2e-3)]


def _batch(i, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(i)
    return (torch.randn(8, 13, generator=g).to(device, dtype), torch.randn(8, 5, generator=g).to(device, dtype))


def _train(model, opt, steps, device, clip=None, dtype=torch.float32, gain=100.0):
    losses = []
    for i in range(steps):
        x, y = _batch(i, device, dtype)
        loss = ((model(x).float() - y.float()) ** 2).mean() * gain  # gain 100: grads large enough to clip
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_matches_torch_adamw_with_clip(path, request):
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    steps = 100 if path == "reference" or DEVICE == "cuda" else 25
    device = DEVICE if path == "triton" else "cpu"
    ref_model, our_model = _model(device=device), _model(device=device)
    ref = torch.optim.AdamW(_groups(ref_model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    ours = AdamW(_groups(our_model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, max_grad_norm=1.0)
    l_ref = _train(ref_model, ref, steps, device, clip=1.0)
    l_ours = _train(our_model, ours, steps, device)
    torch.testing.assert_close(torch.tensor(l_ours), torch.tensor(l_ref), rtol=1e-5, atol=1e-6)
    for a, b in zip(our_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours.last_grad_norm is not None and ours.last_grad_norm.item() > 1.0   # the clip did engage


def test_without_clip_equals_plain_adamw():
    ref_model, our_model = _model(), _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    ours = AdamW(our_model.parameters(), lr=1e-3)
    # unclipped, a gain of 100 makes training chaotic and rounding noise grows to O(lr): keep it tame
    _train(ref_model, ref, 30, "cpu", gain=1.0)
    _train(our_model, ours, 30, "cpu", gain=1.0)
    for a, b in zip(our_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_state_dict_round_trips_with_torch():
    m1, m2 = _model(), _model()
    ours = AdamW(_groups(m1), lr=1e-3, max_grad_norm=1.0)
    _train(m1, ours, 5, "cpu")
    # ours -> torch: torch continues exactly where we stopped
    m2.load_state_dict(m1.state_dict())
    theirs = torch.optim.AdamW(_groups(m2), lr=1e-3)
    # deep copies, as a checkpoint would be: in-process loading shares the `step` tensors
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    ours.max_grad_norm = None       # compare the plain AdamW step from here on (tame gain: unclipped)
    _train(m1, ours, 5, "cpu", gain=1.0)
    _train(m2, theirs, 5, "cpu", gain=1.0)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # torch -> ours
    m3 = _model()
    m3.load_state_dict(m2.state_dict())
    back = AdamW(_groups(m3), lr=1e-3)
    back.load_state_dict(copy.deepcopy(theirs.state_dict()))
    _train(m2, theirs, 3, "cpu", gain=1.0)
    _train(m3, back, 3, "cpu", gain=1.0)
    for a, b in zip(m3.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert int(back.state[next(m3.parameters())]["step"]) == 13


def test_grad_scaler_skips_inf_step(triton_on_cpu):
    model = _model(device=DEVICE)
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**10)
    x, y = _batch(0, DEVICE)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    opt.zero_grad()
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(v, opt.state[next(model.parameters())][k]) for k, v in state_before.items())
    assert scaler.get_scale() < scale


def test_grad_scaler_unscales_inside_the_step(triton_on_cpu):
    """A scaled step equals an unscaled one: unscaling happens in the kernel."""
    m1, m2 = _model(device=DEVICE), _model(device=DEVICE)
    o1 = AdamW(m1.parameters(), lr=1e-2, max_grad_norm=0.5)
    o2 = AdamW(m2.parameters(), lr=1e-2, max_grad_norm=0.5)
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**8, growth_interval=1000)
    for i in range(3):
        x, y = _batch(i, DEVICE)
        o1.zero_grad()
        scaler.scale(((m1(x) - y) ** 2).mean()).backward()
        scaler.step(o1)
        scaler.update()
        o2.zero_grad()
        ((m2(x) - y) ** 2).mean().backward()
        o2.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_master_weights_track_fp32_adamw(path, request):
    if path == "triton":
        request.getfixturevalue("triton_on_cpu")
    device = DEVICE if path == "triton" else "cpu"
    low = _model(torch.bfloat16, device)
    fp32 = copy.deepcopy(low).float()
    ours = AdamW(low.parameters(), lr=1e-3, master_weights=True, max_grad_norm=1.0)
    ref = torch.optim.AdamW(fp32.parameters(), lr=1e-3)
    for i in range(10):
        x, y = _batch(i, device)
        # identical gradients for both: computed once in fp32 from the fp32 master values
        for p32, st_p in zip(fp32.parameters(), low.parameters()):
            master = ours.state[st_p]["master"] if ours.state[st_p] else st_p.detach().float()
            p32.data.copy_(master)
        ref.zero_grad()
        ((fp32(x) - y) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(fp32.parameters(), 1.0)
        for p32, pl in zip(fp32.parameters(), low.parameters()):
            pl.grad = p32.grad.to(torch.bfloat16)
            p32.grad = pl.grad.float()     # both see the same (bf16-rounded) gradient
        torch.nn.utils.clip_grad_norm_(fp32.parameters(), 1.0)
        ref.step()
        ours.step()
        for p32, pl in zip(fp32.parameters(), low.parameters()):
            st = ours.state[pl]
            assert st["master"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
            torch.testing.assert_close(st["master"], p32.detach(), rtol=1e-5, atol=1e-6)
            if pl.is_cuda or path == "reference":
                assert torch.equal(pl.detach(), st["master"].to(torch.bfloat16))   # round to nearest even
            else:  # Triton's CPU interpreter truncates fp32 -> bf16 casts (rtne is ignored): within 1 ulp
                torch.testing.assert_close(pl.detach().float(), st["master"], rtol=2**-7, atol=0)


def test_master_state_survives_save_load():
    low = _model(torch.bfloat16)
    opt = AdamW(low.parameters(), master_weights=True)
    for p in low.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt2 = AdamW(low.parameters(), master_weights=True)
    opt2.load_state_dict(sd)
    p0 = next(low.parameters())
    assert opt2.state[p0]["master"].dtype == torch.float32
    assert torch.equal(opt2.state[p0]["master"], opt.state[p0]["master"])


def test_unsupported_options_are_clear_errors():
    with pytest.raises(NotImplementedError, match="amsgrad"):
        AdamW(_model().parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        AdamW(_model().parameters(), max_grad_norm=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
@pytest.mark.parametrize("kw", [dict(max_grad_norm=1.0), dict(), dict(state_bits=8, max_grad_norm=1.0)])
def test_cuda_step_never_syncs_with_the_host(kw):
    """After the first step (which builds the launch tables), a step issues its kernels without waiting
    for the GPU: a sync would stall the host behind backward in every training step."""
    model = _model(device="cuda")
    opt = AdamW(model.parameters(), lr=1e-3, **kw)
    x, y = _batch(0, "cuda")
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_tensor_lr_steps_like_a_float_lr(triton_on_cpu):
    """A learning rate held as a tensor (schedulers on the device keep it so) gives the float lr's step,
    on the kernel path, without turning it into a Python number."""
    m1, m2 = _model(device=DEVICE), _model(device=DEVICE)
    o1 = AdamW(m1.parameters(), lr=torch.tensor(1e-3, device=DEVICE), max_grad_norm=1.0)
    o2 = AdamW(m2.parameters(), lr=1e-3, max_grad_norm=1.0)
    _train(m1, o1, 3, DEVICE)
    _train(m2, o2, 3, DEVICE)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
