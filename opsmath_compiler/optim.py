"""``opsmath.optim.AdamW``: a drop-in for ``torch.optim.AdamW`` with the gradient clip, GradScaler
unscaling/skip and optional fp32 master weights fused into its step (math in ``kernels/adamw.py``).

    opt = opsmath.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()       # no separate clip_grad_norm_ pass

* ``max_grad_norm``: the global L2 norm over every gradient the optimizer holds is computed and
  applied inside the step, as ``torch.nn.utils.clip_grad_norm_(params, max_grad_norm)`` would do first;
  ``opt.last_grad_norm`` holds it (a 0-d tensor, no host sync).
* ``master_weights=True``: 16-bit parameters get an fp32 master copy and fp32 moments in the state;
  the step updates the master and writes the rounded parameter in the same pass.
* ``torch.amp.GradScaler``: the optimizer declares ``_step_supports_amp_scaling``, so the scaler hands it
  ``grad_scale`` and ``found_inf``; gradients are unscaled inside the kernel and a step with inf/NaN
  gradients changes nothing (parameters, moments and step counts stay).
* ``state_dict()``/``load_state_dict()`` use torch's AdamW layout (``step``, ``exp_avg``,
  ``exp_avg_sq``; ``master`` extra), so checkpoints move both ways.

CUDA tensors take two multi-tensor Triton launches per dtype combination (one without clipping);
CPU tensors the reference path.
"""
from __future__ import annotations

import torch

from opsmath.kernels._common import use_triton
from opsmath.kernels.adamw import adamw_reference, adamw_triton, global_grad_norm_reference, grad_sumsq_triton

_FP32_STATE = ("master", "exp_avg", "exp_avg_sq")


class AdamW(torch.optim.Optimizer):
    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 max_grad_norm: float | None = None, master_weights: bool = False, amsgrad=False,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
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
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=foreach, capturable=capturable, differentiable=False, fused=fused,
                        decoupled_weight_decay=True, master_weights=master_weights)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        self._tables: dict = {}   # kernel tables reused across steps (kernels/adamw.py)

    # ---- state ---------------------------------------------------------------------------------
    def _state_for(self, p: torch.Tensor, group: dict) -> dict:
        st = self.state[p]
        master = group.get("master_weights", False) and p.dtype != torch.float32
        sdt = torch.float32 if master else p.dtype
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.contiguous_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.contiguous_format)
        if master and "master" not in st:
            st["master"] = p.detach().float().clone()   # e.g. loaded from a torch AdamW checkpoint
        if st["step"].device != p.device:
            st["step"] = st["step"].to(p.device, torch.float32)
        for k in ("exp_avg", "exp_avg_sq"):
            if st[k].dtype != sdt:
                st[k] = st[k].to(sdt)
        return st

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts floating state to the parameter dtype; fp32 masters and moments of
        16-bit parameters are put back in fp32 so a save/load round trip loses nothing."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for k in _FP32_STATE:
                v = saved.get(i, {}).get(k)
                if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and p.dtype != torch.float32:
                    self.state[p][k] = v.to(p.device, copy=True)

    # ---- step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (group, param, state)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("opsmath.optim.AdamW does not support sparse gradients")
                work.append((group, p, self._state_for(p, group)))
        if not work:
            return loss
        device = work[0][1].device
        fast = use_triton(work[0][1])
        grads = [p.grad for _, p, _ in work]
        scale = getattr(self, "grad_scale", None)
        found = getattr(self, "found_inf", None)
        scale = torch.ones((), device=device) if scale is None else scale.to(device, torch.float32)
        found = torch.zeros((), device=device) if found is None else found.to(device, torch.float32)
        coef_scale = 1.0 / scale
        if self.max_grad_norm is not None:
            # pass 1: the global norm of the unscaled gradients (per device, then summed)
            sumsq = sum((grad_sumsq_triton(gs, self._tables) if use_triton(gs[0])
                         else global_grad_norm_reference(gs) ** 2).to(device) for gs in _by_device(grads).values())
            norm = sumsq.sqrt() / scale
            self.last_grad_norm = norm
            found = torch.maximum(found, (~torch.isfinite(norm)).float())
            coef_scale = coef_scale * torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        # pass 2: one update launch per (device, dtypes, master, betas, eps) bucket: betas and eps are
        # kernel scalars, lr and weight decay per-tensor tables, so param groups mostly share a launch
        buckets: dict = {}
        for group, p, st in work:
            key = (p.device, p.dtype, p.grad.dtype, st["exp_avg"].dtype, "master" in st,
                   tuple(group["betas"]), group["eps"])
            buckets.setdefault(key, []).append((group, p, st))
        for (dev, *_), items in buckets.items():
            coef = coef_scale.to(dev) if torch.is_tensor(coef_scale) else torch.tensor(coef_scale, device=dev)
            self._update(items, fast, coef, found.to(dev), self._tables)
        steps = [st["step"] for _, _, st in work]
        torch._foreach_add_(steps, 1.0 - found.to(steps[0].device))
        return loss

    @staticmethod
    def _update(items, fast: bool, coef_scale: torch.Tensor, found: torch.Tensor, tables: dict) -> None:
        ps = [p for _, p, _ in items]
        args = (ps, [p.grad for p in ps], [st["exp_avg"] for _, _, st in items],
                [st["exp_avg_sq"] for _, _, st in items], [st.get("master") for _, _, st in items])
        lrs = [float(g["lr"]) for g, _, _ in items]
        wds = [float(g["weight_decay"]) for g, _, _ in items]
        (b1, b2), eps = items[0][0]["betas"], items[0][0]["eps"]
        if fast:
            new_steps = torch.stack([st["step"] for _, _, st in items]) + 1.0
            adamw_triton(*args, new_steps, lrs, wds, b1, b2, eps, coef_scale, found, cache=tables)
        else:
            new_steps = [float(st["step"]) + 1.0 for _, _, st in items]
            adamw_reference(*args, new_steps, lrs, wds, b1, b2, eps, coef_scale, found)


def _by_device(tensors):
    out: dict = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out
