"""``opsmath.optim.AdamW``: a drop-in for ``torch.optim.AdamW`` with the gradient clip, GradScaler
unscaling/skip, optional fp32 master weights and optional 8-bit moments fused into its step (math in
``src/opsmath/kernels/adamw.py`` and ``src/opsmath/kernels/adamw_8bit.py``).

    opt = opsmath.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()       # no separate clip_grad_norm_ pass

* ``max_grad_norm``: the global L2 norm over every gradient the optimizer holds is computed and
  applied inside the step, as ``torch.nn.utils.clip_grad_norm_(params, max_grad_norm)`` would do first;
  ``opt.last_grad_norm`` holds it (a 0-d tensor, no host sync). A non-finite norm does what torch does:
  the clip factor is 0 (inf) or NaN, and inf/NaN gradients reach the moments and weights.
  ``skip_nonfinite=True`` skips such steps instead (nothing changes, ``step`` is not advanced), counted
  in ``opt.skipped_steps`` (a 0-d device tensor), as ``GradScaler`` skips.
* ``state`` is the truth, as for any ``torch.optim.Optimizer``: replaced (``opt.state = ...``), cleared,
  an entry deleted, or a tensor in an entry swapped, the next step uses what is there (fresh moments for a
  parameter whose state is gone) and ``state_dict()`` saves it.
* ``master_weights=True``: 16-bit parameters get an fp32 master copy and fp32 moments in the state;
  the step updates the master and writes the rounded parameter in the same pass.
* ``state_bits=8``: both moments stored block-wise quantized (``src/opsmath/kernels/adamw_8bit.py``): 2 bytes of
  state per parameter instead of 8 (fp32) or 4 (bf16). ``state_bits="auto"``: 32 unless a model's byte
  ``memory_budget`` cannot be met with it; the memory planner then makes it 8 before the first step and
  its report says so, with the bytes saved (``src/opsmath/optim/footprint.py``).
* ``in_backward=True`` (``"auto"``: turned on by the memory planner before the first step where a byte
  ``memory_budget`` cannot be met otherwise, and the report says so; never with ``max_grad_norm``):
  each parameter is updated inside backward as soon as its gradient is final, and
  its ``.grad`` freed, so no full set of gradients is ever alive (``src/opsmath/optim/in_backward.py``; under
  ``opsmath.optimize`` with Inductor the model is then captured one graph per block, whose backward each
  returns its block's gradients: ``src/opsmath/runtime/blocks.py``);
  ``step()`` then has nothing left to do. Exact with respect to the same optimizer stepping after
  backward; ``max_grad_norm``, gradient accumulation and ``GradScaler`` need every gradient first and
  raise a clear error instead.
* ``torch.amp.GradScaler``: the optimizer declares ``_step_supports_amp_scaling``, so the scaler hands it
  ``grad_scale`` and ``found_inf``; gradients are unscaled inside the kernel and a step with inf/NaN
  gradients changes nothing (parameters, moments and step counts stay).
* ``state_dict()``/``load_state_dict()`` use torch's AdamW layout (``step``, ``exp_avg``,
  ``exp_avg_sq``; ``master`` extra), so checkpoints move both ways. 8-bit state is saved as its codes
  and block maxima (``exp_avg_q``, ``exp_avg_max``, ``exp_avg_sq_q``, ``exp_avg_sq_max``); loading
  converts between the layouts either way (a torch checkpoint into 8-bit state, or 8-bit state into
  ``state_bits=32``, whose ``state_dict()`` torch then reads).

CUDA tensors take two multi-tensor Triton launches per dtype combination (one without clipping); the
launch tables are built once and reused while the parameters stay in place, so a step does no
per-tensor host work beyond reading the gradients' addresses. CPU tensors and non-contiguous
parameters take the reference path (torch ops).
"""
from __future__ import annotations

import torch

from opsmath.kernels import adamw_8bit as q8
from opsmath.kernels._common import use_triton
from opsmath.kernels.adamw import (Gate, MultiTensor, adamw_reference, adamw_triton, global_grad_norm_reference,
                                   grad_sumsq_triton, group_table)

from opsmath.optim import footprint
from opsmath.optim.in_backward import InBackward
from opsmath.optim.state import TrackedState, plain, tracked

_Q8_KEYS = ("exp_avg_q", "exp_avg_sq_q", "exp_avg_max", "exp_avg_sq_max")


class AdamW(torch.optim.Optimizer):
    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 max_grad_norm: float | None = None, master_weights: bool = False, state_bits: int | str = 32,
                 skip_nonfinite: bool = False, in_backward: bool = False, bucket_bytes: int = 2**25,
                 amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        for name, flag in (("amsgrad", amsgrad), ("maximize", maximize), ("differentiable", differentiable)):
            if flag:
                raise NotImplementedError(f"opsmath.optim.AdamW does not support {name}=True; "
                                          "use torch.optim.AdamW for it")
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if in_backward not in (False, True, "auto"):
            raise ValueError(f"in_backward must be False, True or 'auto' (True where a memory budget needs it), "
                             f"got {in_backward!r}")
        if in_backward is True and max_grad_norm is not None:
            raise ValueError("in_backward=True updates each parameter before the global gradient norm exists; "
                             "max_grad_norm needs it: clip with in_backward=False")
        if state_bits not in (8, 32, "auto"):
            raise ValueError("state_bits must be 32 (moments in fp32, or the parameter's dtype), 8 or 'auto' "
                             f"(8 where a memory budget needs it), got {state_bits!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=foreach, capturable=capturable, differentiable=False, fused=fused,
                        decoupled_weight_decay=True, master_weights=master_weights, state_bits=state_bits)
        super().__init__(params, defaults)
        self.state = tracked(self.state)
        self.max_grad_norm, self.skip_nonfinite = max_grad_norm, skip_nonfinite
        self.last_grad_norm: torch.Tensor | None = None
        self.skipped_steps: torch.Tensor | int = 0
        self._plans: dict = {}      # parameters stepped together -> (what the tables depend on, _Plan)
        self._in_backward, self._bucket_bytes = None, bucket_bytes
        # "auto": the memory planner may turn it on (``footprint.in_backward_lever``); never with a clip
        self.in_backward_auto = in_backward == "auto" and max_grad_norm is None
        if in_backward is True:
            self.step_in_backward()
        footprint.LIVE.add(self)   # the memory planner reads its state's layout before the first step

    def step_in_backward(self) -> None:
        """From now on, update each parameter inside backward as its gradient is final (``in_backward=True``)."""
        if self._in_backward is None:
            self._in_backward = InBackward(self._step_entries, self._bucket_bytes)
            for gi, group in enumerate(self.param_groups):
                self._in_backward.watch(gi, group["params"])
        self.in_backward_auto = False

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_in_backward", None) is not None:
            self._in_backward.watch(len(self.param_groups) - 1, self.param_groups[-1]["params"])

    # ---- state ---------------------------------------------------------------------------------
    def _state_for(self, p: torch.Tensor, group: dict) -> dict:
        """The state of ``p``, created or converted to what ``group`` asks for (master, 8-bit)."""
        st = self.state[p]
        master = group.get("master_weights", False) and p.dtype != torch.float32
        sdt = torch.float32 if master else p.dtype
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if st["step"].device != p.device or st["step"].dtype != torch.float32:
            st["step"] = st["step"].to(p.device, torch.float32)
        if group.get("state_bits", 32) == 8:
            if "exp_avg" in st:         # torch's layout (e.g. loaded from a torch AdamW checkpoint)
                for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                    st[key + "_q"], st[key + "_max"] = q8.encode(st.pop(key).to(p.device).float(), signed)
            elif "exp_avg_q" not in st:
                st.update(q8.new_state(p))
        else:
            if "exp_avg_q" in st:       # 8-bit layout loaded into 32-bit state
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key] = q8.decode(st.pop(key + "_q"), st.pop(key + "_max")).to(sdt)
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in st:
                    st[key] = torch.zeros_like(p, dtype=sdt, memory_format=torch.contiguous_format)
                elif st[key].dtype != sdt:
                    st[key] = st[key].to(sdt)
        if master and "master" not in st:
            st["master"] = p.detach().float().clone()   # e.g. loaded from a torch AdamW checkpoint
        return st

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts state tensors to the parameter's dtype; fp32 masters, moments and block
        maxima of 16-bit parameters and the 8-bit codes keep the dtype they were saved in, so a save/load
        round trip loses nothing. How this optimizer stores state (``master_weights``, ``state_bits``)
        stays as constructed: the loaded state is converted to it at the next step; ``state_bits="auto"``
        takes 8 from a checkpoint whose group a memory budget had made 8-bit."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        storage = [{k: g[k] for k in ("master_weights", "state_bits")} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for g, keep, saved_g in zip(self.param_groups, storage, state_dict["param_groups"]):
            if keep["state_bits"] == "auto" and saved_g.get("state_bits") == 8:   # the budget chose 8: kept
                keep = dict(keep, state_bits=8)
            g.update(keep)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for k, v in saved.get(i, {}).items():
                if k != "step" and isinstance(v, torch.Tensor) and v.dtype != self.state[p][k].dtype:
                    self.state[p][k] = v.to(p.device, copy=True)
        self._plans.clear()

    # ---- step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._in_backward is not None:
            self._in_backward.flush()
            self._in_backward.check_step(self)
        entries = [(gi, p) for gi, group in enumerate(self.param_groups) for p in group["params"]
                   if p.grad is not None]
        if entries:
            self._step_entries(entries)
        return loss

    def _step_entries(self, entries: list) -> None:
        """Update ``[(group index, parameter)]`` with their gradients, through launch tables cached per set
        of parameters stepped together (all of them, or one in-backward bucket)."""
        ids = tuple(id(p) for _, p in entries)
        key = self._key(entries)
        key_plan = self._plans.get(ids)
        if key_plan is None or key_plan[0] != key:
            for gi, p in entries:
                if p.grad.is_sparse:
                    raise RuntimeError("opsmath.optim.AdamW does not support sparse gradients")
            plan = _Plan([(self.param_groups[gi], gi, p, self._state_for(p, self.param_groups[gi]))
                          for gi, p in entries])
            if len(self._plans) > 256:
                self._plans.clear()
            key_plan = self._plans[ids] = (self._key(entries), plan)   # with the state entries just made
        self.last_grad_norm, taken = key_plan[1].run(self.param_groups, self.max_grad_norm, self.skip_nonfinite,
                                                     getattr(self, "grad_scale", None),
                                                     getattr(self, "found_inf", None))
        if self.skip_nonfinite and self.max_grad_norm is not None:
            self.skipped_steps = self.skipped_steps + (1 - taken)

    def _key(self, entries) -> tuple:
        """What the launch tables depend on: the parameters, their gradients' dtypes, the groups' constants,
        and the state (``optim_state``): the dict itself and its version, which every replaced, cleared or
        deleted entry and every tensor swapped into one bumps, so a step after any of them rebuilds the
        tables from what ``state`` holds. A state rebound to a plain dict (``opt.state = ...``,
        ``load_state_dict``) is tracked from here on."""
        if not isinstance(self.state, TrackedState):
            self.state = tracked(self.state)
        state = self.state
        return (tuple((id(p), p.data_ptr(), p.grad.dtype, p.grad.device) for _, p in entries),
                tuple((g["betas"], g["eps"], g.get("master_weights"), g.get("state_bits")) for g in self.param_groups),
                id(state), state.version)

    def state_dict(self) -> dict:
        """torch's layout, each entry a plain dict (loads with ``weights_only=True`` and into torch's AdamW)."""
        sd = super().state_dict()
        sd["state"] = {k: plain(v) for k, v in sd["state"].items()}
        return sd


class _Bucket:
    """Parameters that share one update launch: device, dtypes, master or not, state bits, betas, eps."""

    def __init__(self, items, fast: bool):
        group = items[0][0]
        self.params = [p for _, _, p, _ in items]
        self.states = [st for _, _, _, st in items]
        self.group_index = [gi for _, gi, _, _ in items]
        self.device = self.params[0].device
        self.bits = group.get("state_bits", 32)
        self.master = "master" in self.states[0]
        self.betas, self.eps = group["betas"], group["eps"]
        self.dtypes = (self.params[0].dtype, self.params[0].grad.dtype,
                       None if self.bits == 8 else self.states[0]["exp_avg"].dtype)
        self.tables = MultiTensor([p.numel() for p in self.params], self._static(), self.group_index,
                                  self.device) if fast else None

    def _static(self) -> list[list[torch.Tensor]]:
        keys = (("exp_avg_q", "exp_avg_sq_q", "step", "exp_avg_max", "exp_avg_sq_max") if self.bits == 8
                else ("exp_avg", "exp_avg_sq", "step"))
        lists = [self.params] + [[st[k] for st in self.states] for k in keys]
        return lists + ([[st["master"] for st in self.states]] if self.master else [])

    def grads(self) -> list[torch.Tensor]:
        return [g if g.is_contiguous() else g.contiguous() for g in (p.grad for p in self.params)]

    def sumsq(self, grads) -> torch.Tensor:
        if self.tables is not None:
            return grad_sumsq_triton(self.tables, grads)
        return global_grad_norm_reference(grads) ** 2

    def update_fast(self, grads, hyper, gate: Gate) -> None:
        b1, b2 = self.betas
        fn = q8.adamw8_triton if self.bits == 8 else adamw_triton
        fn(self.tables, grads, *hyper, b1, b2, self.eps, gate, self.dtypes)

    def update_reference(self, grads, groups, coef_scale, found) -> None:
        b1, b2 = self.betas
        lrs = [float(groups[gi]["lr"]) for gi in self.group_index]
        wds = [float(groups[gi]["weight_decay"]) for gi in self.group_index]
        steps = [float(st["step"]) + 1.0 for st in self.states]
        masters = [st.get("master") for st in self.states]
        if self.bits == 8:
            q = [[st[k] for st in self.states] for k in _Q8_KEYS]
            q8.adamw8_reference(self.params, grads, *q, masters, steps, lrs, wds, b1, b2, self.eps, coef_scale, found)
        else:
            adamw_reference(self.params, grads, [st["exp_avg"] for st in self.states],
                            [st["exp_avg_sq"] for st in self.states], masters, steps, lrs, wds, b1, b2, self.eps,
                            coef_scale, found)


class _Plan:
    """The buckets of one set of parameters with gradients, and their step counters per device."""

    def __init__(self, items):
        by_key: dict = {}
        for group, gi, p, st in items:
            fast = use_triton(p) and p.is_contiguous()
            k = (p.device, p.dtype, p.grad.dtype, "master" in st, group.get("state_bits", 32),
                 tuple(group["betas"]), group["eps"], fast)
            by_key.setdefault(k, []).append((group, gi, p, st))
        self.buckets = [_Bucket(v, k[-1]) for k, v in by_key.items()]
        self.steps: dict = {}
        for _, _, p, st in items:
            self.steps.setdefault(p.device, []).append(st["step"])
        self._hyper_key: dict = {}
        self._hyper: dict = {}
        dev = self.buckets[0].device
        # one device, every bucket on the kernels: the gate stays on the device (no scalar torch ops)
        self.on_device = len(self.steps) == 1 and all(b.tables is not None for b in self.buckets)
        self._one, self._zero = torch.ones(1, device=dev), torch.zeros(1, device=dev)
        self._inc = torch.empty(1, device=dev)

    def hyper(self, groups, device):
        """Per-group lr and weight decay tables on ``device``, re-uploaded when a value changes. A tensor
        lr (a scheduler that keeps it on the device) is gathered on the device: no host sync."""
        if any(torch.is_tensor(g["lr"]) or torch.is_tensor(g["weight_decay"]) for g in groups):
            f32 = dict(device=device, dtype=torch.float32)
            return tuple(torch.stack([torch.as_tensor(g[k], **f32).reshape(()) for g in groups])
                         for k in ("lr", "weight_decay"))
        values = ([float(g["lr"]) for g in groups], [float(g["weight_decay"]) for g in groups])
        if self._hyper_key.get(device) != values:
            self._hyper_key[device] = values
            self._hyper[device] = tuple(group_table(v, device) for v in values)
        return self._hyper[device]

    def run(self, groups, max_grad_norm, skip_nonfinite, scale, found):
        """One step; returns the global gradient norm (None without clipping) and 1, or 0 when the step was
        skipped (0-d tensors)."""
        device = self.buckets[0].device
        scale = self._one if scale is None else scale.to(device, torch.float32).reshape(1)
        found = self._zero if found is None else found.to(device, torch.float32).reshape(1)
        grads = [b.grads() for b in self.buckets]
        sumsq = None
        if max_grad_norm is not None:
            # pass 1: the scaled gradients' sum of squares (per bucket, summed on the first device)
            parts = [b.sumsq(g).to(device) for b, g in zip(self.buckets, grads)]
            sumsq = (parts[0] if len(parts) == 1 else torch.stack(parts).sum()).reshape(1)
        norm_out = torch.empty(1, device=device)
        for b, g in zip(self.buckets, grads):
            if b.tables is not None:
                # the norm, clip factor and skip are computed on the bucket's device, in its kernel
                dev = b.device
                gate = Gate(scale.to(dev), found.to(dev), None if sumsq is None else sumsq.to(dev),
                            max_grad_norm or 1.0, norm_out if dev == device else torch.empty(1, device=dev),
                            self._inc if dev == device else torch.empty(1, device=dev), skip_nonfinite)
                b.update_fast(g, self.hyper(groups, dev), gate)
        if self.on_device:
            # alpha= selects the Tensor overload: without it the 0-d tensor binds to the Scalar one,
            # whose .item() is a host sync every step
            torch._foreach_add_(self.steps[device], self._inc.reshape(()), alpha=1.0)
            return (norm_out.reshape(()) if sumsq is not None else None), self._inc.reshape(())
        # CPU (or non-contiguous) parameters: the same gate with torch ops
        coef_scale, norm = 1.0 / scale, None
        if sumsq is not None:
            norm = sumsq.sqrt() / scale
            if skip_nonfinite:
                found = torch.maximum(found, (~torch.isfinite(norm)).float())
            coef_scale = coef_scale * torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
        for b, g in zip(self.buckets, grads):
            if b.tables is None:
                b.update_reference(g, groups, coef_scale.reshape(()).to(b.device), found.reshape(()).to(b.device))
        for dev, steps in self.steps.items():
            torch._foreach_add_(steps, 1.0 - found.reshape(()).to(dev), alpha=1.0)
        return (None if norm is None else norm.reshape(())), 1.0 - found.reshape(())
