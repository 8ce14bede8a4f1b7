"""Scale-out: process groups, FSDP-2, meta-device init, activation checkpointing, torch.compile, preemption."""
from sonic.parallel.config import ParallelConfig
from sonic.parallel.distributed import DistInfo, all_reduce_, init_distributed
from sonic.parallel.init import build_model, load_full_state_dict, memory_after_init
from sonic.parallel.parallelize import parallelize, set_gradient_sync, weights_dtype
from sonic.parallel.preemption import PreemptionGuard

__all__ = ["DistInfo", "ParallelConfig", "PreemptionGuard", "all_reduce_", "build_model", "init_distributed",
           "load_full_state_dict", "memory_after_init", "parallelize", "set_gradient_sync",
           "weights_dtype"]
