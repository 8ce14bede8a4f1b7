"""AdamW with decoupled weight decay and the learning-rate schedules."""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sonic import compat

SCHEDULES = ("cosine", "wsd", "constant")
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop", "triton")
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MASTER_WEIGHTS = ("none", "fp32")
GRAD_NORMS = ("auto", "torch", "triton")


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # final lr = min_lr_ratio * lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine: warmup then cosine | wsd: warmup, stable, decay | constant
    warmup_steps: int = 20
    decay_fraction: float = 0.2  # wsd: share of the steps spent in the final linear decay
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    decay_norms_and_embeddings: bool = False  # True applies weight decay to norms, biases, embeddings too
    # fused: one kernel per step for all parameters (sonic_7b cut to 4 layers on an H100: AdamW step
    # 9.1 ms vs 25.1 ms foreach, +11% tokens/s; bench/results/2026-11-22-h100-train_step-4L.json).
    # triton: Sonic's one-pass kernel (TritonAdamW) that also applies the clip as it reads each gradient; CUDA
    # only (sonic_7b cut to 8 layers on an H200: clip + step 12.65 ms vs fused's 16.01 ms with the clip as its
    # grad_scale; bench/results/2026-11-24-h200-train_step-8L-optimizers.json). auto: triton on CUDA, else fused.
    implementation: str = "auto"  # auto | triton | fused | foreach | for_loop (the last three: torch.optim.AdamW's)
    # bf16: triton's AdamW keeps both moments in bf16, stored with stochastic rounding (sonic/kernels/triton/adamw.py):
    # 8 bytes per weight less to hold and to move each step (DeepSeek-V3 trains its AdamW moments in bf16 too).
    # fp32: torch's. auto: bf16 where the implementation resolves to triton, fp32 elsewhere (docs/performance.md).
    moment_dtype: str = "auto"  # auto | fp32 | bf16
    # Where one GPU holds its weights in bf16 (sonic.parallel.weights_dtype), none: triton's AdamW steps the bf16
    # weights in place, rounded stochastically (sonic/kernels/triton/adamw.py), 6 bytes per weight less to move each
    # step and 4 less to hold than fp32: an fp32 master of each, stepped and rounded into the weight. The tiny model's
    # 500-step loss curves agree, and sonic_7b trains faster (docs/performance.md). Elsewhere the weights are fp32.
    master_weights: str = "none"  # none | fp32
    # The clip's global gradient norm. triton: one launch over every gradient of a dtype (TritonAdamW.global_norm);
    # torch: its multi-tensor norm, which took about twice the bytes' time (docs/performance.md). auto: triton where
    # the implementation resolves to triton, torch elsewhere.
    grad_norm: str = "auto"  # auto | torch | triton

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim.beta1={self.beta1} and optim.beta2={self.beta2} must be in [0, 1)")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("optim.warmup_steps, optim.weight_decay and optim.grad_clip must be >= 0")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"optim.implementation={self.implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}")
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"optim.decay_fraction={self.decay_fraction} must be in [0, 1]")
        if self.moment_dtype != "auto" and self.moment_dtype not in MOMENT_DTYPES:
            raise ValueError(f"optim.moment_dtype={self.moment_dtype!r} is not one of auto, {', '.join(MOMENT_DTYPES)}")
        if self.master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"optim.master_weights={self.master_weights!r} is not one of {', '.join(MASTER_WEIGHTS)}")
        if self.grad_norm not in GRAD_NORMS:
            raise ValueError(f"optim.grad_norm={self.grad_norm!r} is not one of {', '.join(GRAD_NORMS)}")


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step is Sonic's Triton kernel (sonic/kernels/triton/adamw.py): one launch per param
    group, one pass over each parameter, that also applies the gradient clip as a divisor (`grad_scale`) and skips
    on `found_inf`, the attributes torch's fused AdamW reads (GradScaler's protocol; `optimizer_step` sets them).
    Its state is torch's (step, exp_avg, exp_avg_sq), so checkpoints move between it and torch's implementations.

    compute_dtype (e.g. bf16; one GPU, see `weights_dtype`): the parameters are cast to it here, after an fp32
    copy of each is kept as state["master"]. The forward and backward then run on them with no cast, their
    gradients come in that dtype, and each step updates the master and writes it back rounded. The moments are
    fp32 unless moment_dtype says otherwise. A checkpoint holds the masters as the model's weights
    (`sonic.train.checkpoint.state_dicts`), so it is the same as one of fp32 weights, whichever way it moves.

    keep_masters=False (optim.master_weights=none, compute_dtype bf16): no master; each step updates the bf16
    parameter in place, stored with stochastic rounding. A checkpoint still holds fp32 weights (`fp32_weights`).

    moment_dtype=bf16 (optim.moment_dtype): both moments are held in bf16 (stochastic rounding in the kernel).
    Loaded moments are cast to it, so a checkpoint moves between bf16 and fp32 moments either way."""

    def __init__(self, params, compute_dtype: torch.dtype | None = None, moment_dtype: torch.dtype | None = None,
                 keep_masters: bool = True, **kwargs):
        super().__init__(params, foreach=None, fused=None, **kwargs)
        assert moment_dtype in (None, torch.float32, torch.bfloat16), moment_dtype
        self.moment_dtype = moment_dtype  # None: the parameter's dtype, as torch's (fp32 with compute_dtype)
        self.compute_dtype = compute_dtype
        self.triton_norm = True  # `norm_function` takes `global_norm` here (optim.grad_norm, set by apply_config)
        self._blocks: dict[tuple, tuple] = {}  # per group and dtypes: (the sizes, adamw_tensors_'s block table)
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]:
                raise ValueError("optim.implementation=triton is plain AdamW: no amsgrad, maximize, capturable "
                                 "or differentiable; use optim.implementation=fused for those")
        assert keep_masters or compute_dtype == torch.bfloat16, (keep_masters, compute_dtype)  # the kernel's rounding
        if compute_dtype is not None:
            for p in self._params():
                assert p.dtype == torch.float32, p.dtype  # the master copies the weights as they were initialised
                # the whole state now, not at the first step: a checkpoint load reads into it in place
                self.state[p].update(step=torch.zeros((), device=p.device),
                                     exp_avg=torch.zeros_like(p, dtype=moment_dtype),
                                     exp_avg_sq=torch.zeros_like(p, dtype=moment_dtype))
                if keep_masters:
                    self.state[p]["master"] = p.detach().clone()
                p.data = p.data.to(compute_dtype)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def masters(self) -> dict[torch.Tensor, torch.Tensor]:
        """{parameter: its fp32 master}, empty without compute_dtype."""
        return {p: self.state[p]["master"] for p in self._params() if "master" in self.state[p]}

    def fp32_weights(self) -> dict[torch.Tensor, torch.Tensor]:
        """{parameter: the fp32 tensor a checkpoint holds for it} for the parameters not held in fp32: its master,
        or (no masters) an fp32 copy, which a checkpoint load fills and `set_state_dict` then rounds into it."""
        masters = self.masters()
        return {p: masters[p] if p in masters else p.detach().float() for p in self._params()
                if p.dtype != torch.float32}

    def global_norm(self, tensors) -> torch.Tensor:
        """`global_norm` of `tensors` (its gradients, or weights): for plain tensors one Triton launch per dtype over a
        block table kept while their sizes stay (`sum_squares`); DTensors (FSDP-2) go to `global_norm`. torch's
        multi-tensor norm took 5.6 ms per step for sonic_7b's 40 layers of bf16 gradients on an H200, about twice
        the time their bytes take (bench/results/2026-11-25-h200-trainer_profile-c0ef921.json)."""
        from sonic.kernels.triton.adamw import NORM_BLOCK, block_table, sum_squares  # noqa: PLC0415 (Triton)

        tensors = list(tensors)
        if not tensors or any(isinstance(t, DTensor) for t in tensors):
            return global_norm(tensors)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        sums = []
        for dtype, group in by_dtype.items():
            sizes, kept = [t.numel() for t in group], self._blocks.get(("norm", dtype))
            if kept is None or kept[0] != sizes:
                kept = self._blocks["norm", dtype] = sizes, block_table(sizes, group[0].device, NORM_BLOCK)
            sums.append(sum_squares(group, kept[1]))
        return torch.stack(sums).sum().sqrt()

    def load_state_dict(self, state_dict):
        self._load_state_dict(state_dict)
        if self.moment_dtype is not None:  # torch cast them to the parameter's (or the master's) dtype
            for state in self.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key] = state[key].to(self.moment_dtype)

    def _load_state_dict(self, state_dict):
        if self.compute_dtype is None:
            return super().load_state_dict(state_dict)
        # torch casts each loaded tensor to its parameter's dtype: it is shown the fp32 masters (without masters,
        # fp32 copies) instead, so the moments stay fp32. A state without masters (a checkpoint's, see
        # checkpoint.state_dicts) keeps these.
        masters, shown = self.masters(), {p: p.data for p in self._params()}
        for p in shown:
            p.data = masters.get(p, p.data.float())
        try:
            super().load_state_dict(state_dict)
        finally:
            for p, data in shown.items():
                p.data = data
        for p in shown:
            loaded = self.state[p].get("master")
            if loaded is not None and loaded is not masters.get(p):  # a state with its own masters: the
                p.data.copy_(loaded)  # parameter follows them
            if p in masters:
                self.state[p].setdefault("master", masters[p])
            else:
                self.state[p].pop("master", None)  # keep_masters=False keeps none

    @torch.no_grad()
    def step(self, closure=None):
        from sonic.kernels.triton.adamw import adamw_tensors_, block_table  # noqa: PLC0415 (Triton: CUDA only)

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        first = 0  # salt: each parameter's index over the groups, seeds its stochastic rounding (the same on resume)
        for group in self.param_groups:
            launches: dict[tuple, list] = {}  # one launch per dtype combination (usually one per group)
            for salt, p in enumerate(group["params"], first):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype,
                                                           memory_format=torch.preserve_format)
                elif state["step"].device != p.device:  # a checkpoint of a non-fused implementation keeps it on the CPU
                    state["step"] = state["step"].to(p.device, torch.float32)
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                key = (*(t.dtype for t in tensors), "master" in state)
                launches.setdefault(key, []).append((*tensors, state["step"], state.get("master"), salt))
            first += len(group["params"])
            beta1, beta2 = group["betas"]
            for key, rows in launches.items():
                params, grads, exp_avgs, exp_avg_sqs, steps, masters, salts = map(list, zip(*rows))
                one = torch.ones((), device=steps[0].device) if found_inf is None else 1 - found_inf
                compat.foreach_add_(steps, one)  # a skipped step does not count
                sizes, kept = [p.numel() for p in params], self._blocks.get((id(group), key))
                if kept is None or kept[0] != sizes:  # the launch's (tensor, block) table depends on the sizes alone
                    kept = self._blocks[id(group), key] = sizes, block_table(sizes, params[0].device)
                adamw_tensors_(params, grads, exp_avgs, exp_avg_sqs, steps, lr=group["lr"],
                               weight_decay=group["weight_decay"], beta1=beta1, beta2=beta2, eps=group["eps"],
                               grad_scale=grad_scale, found_inf=found_inf, masters=masters if key[-1] else None,
                               salts=salts, blocks=kept[1])
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP-2), else `t`: AdamW is elementwise, so each rank steps its own."""
    return t.to_local() if isinstance(t, DTensor) else t


def takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s step takes `grad_scale` and `found_inf` on the device (torch's fused AdamW, Sonic's
    TritonAdamW): the clip and the skip of a bad step then cost no pass and no host sync."""
    return isinstance(optimizer, TritonAdamW) or all(group.get("fused") for group in optimizer.param_groups)


def optimizer_step(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None = None,
                   found_inf: torch.Tensor | None = None) -> None:
    """optimizer.step() with the gradient divisor and the skip flag that a `takes_grad_scale` optimizer reads."""
    assert takes_grad_scale(optimizer) or (grad_scale is None and found_inf is None)
    for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if value is not None:
            setattr(optimizer, name, value)
    try:
        optimizer.step()
    finally:
        for name in ("grad_scale", "found_inf"):
            optimizer.__dict__.pop(name, None)


def build_optimizer(model: nn.Module, cfg: OptimConfig, compute_dtype: torch.dtype | None = None) -> torch.optim.AdamW:
    """AdamW over two groups (decay, no decay). compute_dtype: the model's weights become that dtype, with fp32
    masters in the optimizer unless optim.master_weights=none (`TritonAdamW`; `sonic.parallel.weights_dtype`
    says where)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_vector_or_embedding = p.dim() < 2 or "embed_tokens" in name or name.endswith(("b1_EF", "b2_ED"))
        (no_decay if is_vector_or_embedding and not cfg.decay_norms_and_embeddings else decay).append(p)
    groups = [{"params": decay}, {"params": no_decay}]
    implementation = resolve_implementation(cfg.implementation, decay + no_decay)
    if compute_dtype is not None and implementation != "triton":
        raise ValueError(f"optim.implementation={cfg.implementation} keeps no fp32 master weights, which one GPU "
                         f"needs to hold its weights in parallel.param_dtype (bf16); use optim.implementation=triton "
                         f"(auto), or set parallel.param_dtype=fp32 to keep fp32 weights cast per op by autocast")
    moment_dtype = resolve_moment_dtype(cfg, implementation)
    if implementation == "triton":
        optimizer = TritonAdamW(groups, lr=cfg.lr, compute_dtype=compute_dtype,
                                moment_dtype=None if moment_dtype == "fp32" else MOMENT_DTYPES[moment_dtype],
                                keep_masters=compute_dtype is None or cfg.master_weights == "fp32")
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, **_IMPLEMENTATION_FLAGS[implementation])
    apply_config(optimizer, cfg)
    return optimizer


def resolve_implementation(implementation: str, params) -> str:
    """optim.implementation for these parameters: auto is triton where they are all on CUDA and Triton
    imports, else fused."""
    devices = sorted({p.device.type for p in params} - {"cuda"})
    if implementation == "auto":
        return "triton" if not devices and importlib.util.find_spec("triton") is not None else "fused"
    if implementation == "triton" and devices:
        raise ValueError(f"optim.implementation=triton runs on CUDA GPUs; the parameters are on {', '.join(devices)}. "
                         "Use optim.implementation=fused (torch's, also on the CPU) or auto")
    return implementation


def resolve_moment_dtype(cfg: OptimConfig, implementation: str) -> str:
    """optim.moment_dtype for the resolved implementation: auto is bf16 with triton, whose kernel rounds the moments
    stochastically (round to nearest would stall them), and fp32 with torch's implementations."""
    if cfg.moment_dtype == "auto":
        return "bf16" if implementation == "triton" else "fp32"
    if cfg.moment_dtype != "fp32" and implementation != "triton":
        raise ValueError(f"optim.moment_dtype={cfg.moment_dtype} needs optim.implementation=triton (auto on CUDA), "
                         f"whose kernel rounds the moments stochastically; optim.implementation={cfg.implementation} "
                         f"resolves to {implementation} here: set optim.moment_dtype=fp32 or auto")
    return cfg.moment_dtype


# torch.optim.AdamW's flags for each optim.implementation (None: torch's default, False here)
_IMPLEMENTATION_FLAGS = {"fused": {"fused": True, "foreach": None}, "foreach": {"foreach": True, "fused": None},
                         "for_loop": {"foreach": False, "fused": None}, "triton": {"foreach": None, "fused": None}}


def apply_config(optimizer: torch.optim.AdamW, cfg: OptimConfig) -> None:
    """Set every hyperparameter of the two groups (decay, no decay) from `cfg`. Called again after a
    resume: loading an optimizer's state also loads the checkpoint's hyperparameters, and a changed
    optim.* on resume is meant to apply (the LR is set every step, see `set_lr`)."""
    decay, no_decay = optimizer.param_groups
    implementation = resolve_implementation(cfg.implementation, decay["params"] + no_decay["params"])
    assert (implementation == "triton") == isinstance(optimizer, TritonAdamW), "build it with build_optimizer(cfg)"
    for group, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0)):
        group.update(weight_decay=weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                     **_IMPLEMENTATION_FLAGS[implementation])
    if isinstance(optimizer, TritonAdamW):
        optimizer.triton_norm = resolve_grad_norm(cfg, implementation) == "triton"
    else:
        resolve_grad_norm(cfg, implementation)  # its error


def resolve_grad_norm(cfg: OptimConfig, implementation: str) -> str:
    """optim.grad_norm for the resolved implementation: auto is triton with triton's AdamW, torch elsewhere."""
    if cfg.grad_norm == "auto":
        return "triton" if implementation == "triton" else "torch"
    if cfg.grad_norm == "triton" and implementation != "triton":
        raise ValueError(f"optim.grad_norm=triton is triton's AdamW's (optim.implementation=triton, auto on CUDA); "
                         f"optim.implementation={cfg.implementation} resolves to {implementation} here: set "
                         f"optim.grad_norm=torch or auto")
    return cfg.grad_norm


def set_lr(optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Give the optimizer the LR of the step after `step` completed steps, from the config alone
    (no scheduler state: a resumed run with a new optim.lr or train.steps follows it). Returns it."""
    lr = cfg.lr * lr_factor(step, total_steps, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def _by_mesh(tensors) -> list[list]:
    """`tensors` grouped by device mesh: DTensor norms take one mesh at a time, and under expert
    parallelism the experts live on another mesh than the rest."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)
    return list(groups.values())


def global_norm(tensors) -> torch.Tensor:
    """The L2 norm of all of `tensors` together, over every shard, as a plain tensor (no host sync)."""
    norms = []
    for group in _by_mesh(tensors):
        if isinstance(group[0], DTensor) or all(t.dtype == torch.float32 for t in group):
            norm = torch.nn.utils.get_total_norm(group)
        else:  # bf16 (one GPU's weights and gradients): summed in fp32, or the norm would keep 8 bits
            norm = torch.linalg.vector_norm(torch.stack(compat.foreach_norm_fp32(group)))
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def norm_function(optimizer: torch.optim.Optimizer):
    """The `global_norm` to take of `optimizer`'s gradients and weights: TritonAdamW's own (one Triton launch,
    optim.grad_norm=triton, auto's choice with optim.implementation=triton), else `global_norm`."""
    return optimizer.global_norm if isinstance(optimizer, TritonAdamW) and optimizer.triton_norm else global_norm


def clip_grad_norm(params, max_norm: float, scale_in_step: bool = False,
                   norm=global_norm) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clip the gradients to a global L2 norm of at most max_norm (inf: only measure it). Returns that norm
    over every shard, as a plain tensor (no host sync), and the clip as a divisor of the gradients, or None
    where the gradients were scaled here. scale_in_step=True leaves them as they are, for an optimizer that
    divides each gradient as it reads it (`takes_grad_scale`): one read and write of every gradient fewer.
    `norm`: `global_norm` or the optimizer's (`norm_function`)."""
    params = [p for p in params if p.grad is not None]
    total = norm([p.grad for p in params])
    if math.isinf(max_norm):
        return total, None
    if scale_in_step:  # torch's clip_grads_with_norm_'s factor, inverted
        return total, ((total.float() + 1e-6) / max_norm).clamp_min(1.0)
    for group in _by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total, None


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at `step` (0-based count of completed optimizer steps)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    lo = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = total_steps - int(cfg.decay_fraction * total_steps)  # wsd
    if step < decay_start:
        return 1.0
    return 1.0 - (1 - lo) * (step - decay_start) / max(1, total_steps - decay_start)
