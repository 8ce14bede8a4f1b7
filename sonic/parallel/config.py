"""Parallelism configuration: FSDP-2 mesh, expert parallelism, mixed precision, activation checkpointing, compile."""
from __future__ import annotations

from dataclasses import dataclass

from sonic import compat

AC_MODES = ("none", "full", "selective")
PARAM_DTYPES = ("bf16", "fp32")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # HSDP: replicas across nodes (1 = plain FSDP over all ranks)
    ep: int = 1  # expert parallelism: experts split over groups of `ep` adjacent ranks (inside a node), tokens all-to-all
    reshard_after_forward: bool = True  # False keeps gathered params until backward (more memory, less comm)
    param_dtype: str = "bf16"  # GPU: the weights' dtype in forward and backward (FSDP gathers in it; one GPU holds it)
    reduce_dtype: str = "fp32"  # gradient reduce-scatter dtype
    activation_checkpoint: str = "none"  # none | full (every block) | selective (every `ac_every`-th block)
    ac_every: int = 2
    compile: bool | None = None  # torch.compile each transformer block; None: on when training on a GPU
    compile_backend: str = "inductor"  # inductor (fast kernels) | aot_eager (checks graph capture, compiles in seconds)
    backend: str = "auto"  # process-group backend: auto (nccl on GPU, gloo on CPU) | nccl | gloo

    def __post_init__(self):
        if self.activation_checkpoint not in AC_MODES:
            raise ValueError(f"parallel.activation_checkpoint={self.activation_checkpoint!r} "
                             f"is not one of {', '.join(AC_MODES)}")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in PARAM_DTYPES:
                raise ValueError(f"parallel.{name}={getattr(self, name)!r} is not one of {', '.join(PARAM_DTYPES)}")
        for name in ("dp_replicate", "ep", "ac_every"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)!r} must be an integer >= 1")
        if self.ep > 1:
            compat.require("expert_parallel", f"parallel.ep={self.ep}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"parallel.compile_backend={self.compile_backend!r} is not one of "
                             f"{', '.join(COMPILE_BACKENDS)}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend={self.backend!r} is not one of auto, nccl, gloo")
