"""Process group and device setup from torchrun / srun environment variables."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sonic import compat
from sonic.parallel.config import ParallelConfig

REDUCE_OPS = ("sum", "mean", "max")


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None  # (dp_replicate, dp_shard); None in a single process
    owns_group: bool = False  # init_distributed created the process group, so shutdown() destroys it
    experts_mesh: DeviceMesh | None = None  # (dp_replicate, efsdp, ep): dp_shard split for expert parallelism

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shutdown(self) -> None:
        """Destroy the process group if we created it (a clean exit, no NCCL/gloo warnings)."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device=cuda but no CUDA GPU is visible; use train.device=cpu or auto")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible; "
                             f"start at most one process per GPU (torchrun --nproc-per-node)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if requested != "cpu":
        raise ValueError(f"train.device={requested!r} is not one of auto, cpu, cuda")
    return torch.device("cpu")


def slurm_rendezvous() -> None:
    """Without torchrun, e.g. under Hydra's submitit launcher, srun starts one task per GPU:
    translate srun's variables into the env:// rendezvous of torch.distributed."""
    env = os.environ
    if "RANK" in env or int(env.get("SLURM_STEP_NUM_TASKS", "1")) <= 1:
        return  # torchrun's variables, or a single process (the batch script itself sets no STEP_ variables)
    nodes = env["SLURM_STEP_NODELIST"]
    head = nodes if not any(c in nodes for c in "[,") else subprocess.run(
        ["scontrol", "show", "hostnames", nodes], check=True, capture_output=True, text=True).stdout.split()[0]
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_STEP_NUM_TASKS"], LOCAL_RANK=env["SLURM_LOCALID"])
    env.setdefault("MASTER_ADDR", head)
    env.setdefault("MASTER_PORT", str(20000 + int(env["SLURM_JOB_ID"]) % 20000))


def init_distributed(cfg: ParallelConfig, device: str) -> DistInfo:
    """Join the process group that torchrun describes in RANK/WORLD_SIZE/... (or srun: see
    `slurm_rendezvous`). One process without those variables runs unsharded (mesh None)."""
    slurm_rendezvous()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world == 1:
        if cfg.ep > 1:
            raise ValueError(f"parallel.ep={cfg.ep} needs {cfg.ep} processes (torchrun --nproc-per-node); "
                             f"this is a single process, so use parallel.ep=1")
        return DistInfo(0, 1, 0, dev, None)
    if world % cfg.dp_replicate:
        raise ValueError(f"parallel.dp_replicate={cfg.dp_replicate} does not divide the world size {world}; "
                         f"use the number of nodes (or 1 for plain FSDP)")
    if (world // cfg.dp_replicate) % cfg.ep:
        raise ValueError(f"parallel.ep={cfg.ep} does not divide the {world // cfg.dp_replicate} ranks of a "
                         f"data-parallel replica (world size {world} / dp_replicate {cfg.dp_replicate}); "
                         f"use a divisor of the GPUs per node")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError("parallel.backend=nccl needs train.device=cuda; use parallel.backend=gloo on CPU")
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend=backend, device_id=dev if dev.type == "cuda" else None)
    mesh = init_device_mesh(dev.type, (cfg.dp_replicate, world // cfg.dp_replicate),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
    return DistInfo(rank, world, local_rank, dev, mesh, owns, experts_mesh(mesh, cfg.ep))


def experts_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh | None:
    """Under expert parallelism, dp_shard split into (efsdp, ep), ep innermost so that an ep
    group is adjacent ranks (one node); efsdp are the ranks that hold the same experts."""
    if ep == 1:
        return None
    return compat.unflatten_mesh(mesh, "dp_shard", (mesh["dp_shard"].size() // ep, ep), ("efsdp", "ep"))


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place sum, mean or max across data-parallel ranks (no-op in one process; gloo has no AVG)."""
    assert op in REDUCE_OPS, op
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            t.div_(dist.get_world_size())
    return t
