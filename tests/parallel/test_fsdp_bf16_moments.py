"""TritonAdamW's bf16 moments (optim.moment_dtype=auto on CUDA) under FSDP-2, on 2 CPU processes (gloo) through
Triton's interpreter: the moments are bf16 DTensors placed like their parameters; the sharded steps are torch's fp32
steps of one process to bf16 precision; and a checkpoint (DCP, through the trainer's Checkpointer) resumes the next
step bit for bit. The single-process kernel checks are tests/train/test_triton_adamw.py's."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from sonic.parallel import ParallelConfig, init_distributed, parallelize
from sonic.train.checkpoint import Checkpointer
from sonic.train.optim import TritonAdamW, clip_grad_norm, optimizer_step
from tests.helpers import free_port, run_in_triton_interpreter, spawn_ranks
from tests.parallel.test_fsdp import CLIP, WORLD, batches, build, clean, micro_loss

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
STEPS, SAVE_AT = 3, 2  # the checkpoint is written before step SAVE_AT (0-based), which both runs then take


def _groups(model) -> list[dict]:
    """Two param groups, with and without weight decay, alike on both sides."""
    params = list(model.parameters())
    return [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0}]


def _optimizer(model) -> TritonAdamW:
    return TritonAdamW(_groups(model), moment_dtype=torch.bfloat16, **HYPER)


def _step(model, optimizer, ids_BS) -> None:
    micro_loss(model, ids_BS).backward()
    _, grad_scale = clip_grad_norm(model.parameters(), CLIP, scale_in_step=True)
    optimizer_step(optimizer, grad_scale)
    optimizer.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _snapshot(model, optimizer) -> dict:
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        out[clean(name)] = {"param": _full(p), "placements": p.placements,
                            **{key: _full(state[key]) for key in ("exp_avg", "exp_avg_sq")},
                            **{f"{key} held as": (state[key].dtype, state[key].placements)
                               for key in ("exp_avg", "exp_avg_sq")}}
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    info = init_distributed(ParallelConfig(), "cpu")
    ids = batches()[rank]  # this rank's micro-batches; step s trains on ids[s % 2]
    checkpoints = Checkpointer(Path(out_dir) / "checkpoints", keep_last=2)
    model = parallelize(build("reference", 3), ParallelConfig(), info)  # E=3: expert weights shard on dim 1
    optimizer = _optimizer(model)
    for step in range(STEPS):
        if step == SAVE_AT:
            path = checkpoints.save(step, model, optimizer, {}, "model: {}\n")
        _step(model, optimizer, ids[step % 2])
    results = {"trained": _snapshot(model, optimizer)}
    again = parallelize(build("reference", 3), ParallelConfig(), info)
    again_opt = _optimizer(again)
    checkpoints.load(path, again, again_opt)
    _step(again, again_opt, ids[SAVE_AT % 2])
    results["resumed"] = _snapshot(again, again_opt)
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")
    torch.distributed.barrier()
    info.shutdown()


def _one_process() -> dict:
    """torch's fp32 AdamW on one process: each step the mean loss over both ranks' batches, the same clip."""
    model = build("reference", 3)
    optimizer = torch.optim.AdamW(_groups(model), foreach=False, **HYPER)
    ids = batches()
    for step in range(STEPS):
        sum(micro_loss(model, ids[rank][step % 2]) for rank in range(WORLD)).div(WORLD).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {clean(name): (p.detach(), optimizer.state[p]) for name, p in model.named_parameters()}


def _main(out_dir: str) -> None:
    spawn_ranks(_worker, (free_port(), out_dir), WORLD, 500, "FSDP bf16 moments")
    results = torch.load(Path(out_dir) / "results.pt", weights_only=False)
    want = _one_process()
    trained, resumed = results["trained"], results["resumed"]
    assert trained.keys() == want.keys()
    assert trained["layers.0.ffn.w1_EFD"]["placements"][0].dim == 1  # the sharding that is not FSDP's usual dim 0
    initial, moved = build("reference", 3).state_dict(), 0
    for name, (p_ref, state_ref) in want.items():
        got = trained[name]
        # bf16 moments err by up to a bf16 step of a moment's largest recent value, which where momentum cancels is
        # a visible part of the update (lr at most): a few elements move by ~lr/10, the mean by far less (measured
        # on this model: at most lr/12 and lr/700 under FSDP, lr/4.4 and lr/650 on one process). A shard stepped
        # with another's moments or offsets moves many elements by ~lr.
        diff = (got["param"] - p_ref).abs()
        assert diff.max() < HYPER["lr"] / 4 and diff.mean() < HYPER["lr"] * 2 ** -8, (name, diff.max(), diff.mean())
        for key in ("exp_avg", "exp_avg_sq"):
            value, (dtype, placements) = got[key], got[f"{key} held as"]
            assert dtype == torch.bfloat16 and placements == got["placements"], (name, key, dtype, placements)
            ref = state_ref[key]
            torch.testing.assert_close(value.float(), ref, rtol=2 ** -6, atol=2 ** -5 * ref.abs().mean().item(),
                                       msg=f"{name} {key}")
        moved += int(not torch.equal(got["param"], initial[name]))
        for field in ("param", "exp_avg", "exp_avg_sq"):  # the resumed step drew the same rounding bits
            assert torch.equal(got[field], resumed[name][field]), (name, field)
    assert moved == len(want)  # every parameter took the steps
    print("fsdp bf16 moments ok")


def test_bf16_moments_under_fsdp_take_torchs_step_and_resume_exactly(tmp_path):
    run_in_triton_interpreter(f"import tests.parallel.test_fsdp_bf16_moments as t; t._main({str(tmp_path)!r})",
                              "fsdp bf16 moments ok")


if __name__ == "__main__":
    _main(sys.argv[1])
