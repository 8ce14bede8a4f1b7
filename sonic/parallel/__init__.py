"""Scale-out: process groups, FSDP-2, activation checkpointing, torch.compile, preemption."""
from sonic.parallel.config import ParallelConfig
from sonic.parallel.distributed import DistInfo, all_reduce_, init_distributed
from sonic.parallel.parallelize import parallelize, set_gradient_sync
from sonic.parallel.preemption import PreemptionGuard

__all__ = ["DistInfo", "ParallelConfig", "PreemptionGuard", "all_reduce_", "init_distributed", "parallelize",
           "set_gradient_sync"]
