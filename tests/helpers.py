"""Config composition for tests, through the same Hydra path as train.py."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from sonic.train.config import Config, register_schema, to_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def compose_config(*overrides: str) -> Config:
    register_schema()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """Run worker(rank, *args) in `nprocs` spawned processes; a failing rank's error is re-raised,
    and ranks still running after timeout_s are killed and the test fails."""
    import time

    import pytest
    import torch.multiprocessing as mp

    workers = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not workers.join(timeout=5):  # raises if a worker failed
        if time.monotonic() > deadline:
            for proc in workers.processes:
                proc.kill()
            pytest.fail(f"the {what} worker processes did not finish within {timeout_s:.0f} s")


def patch_triton_interpreter() -> None:
    """Let Triton's CPU interpreter (TRITON_INTERPRET=1) take int() of 1-element arrays under numpy >= 2.4,
    multiply bf16 operands in tl.dot as numbers (it keeps bf16 as raw 16-bit integers, which np.matmul multiplied
    as integers), and round fp32 to bf16 to nearest even, as the GPU does (it truncated)."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    builder = type(interp.interpreter_builder)
    if not getattr(builder.create_dot, "_sonic_bf16", False):
        orig_dot = builder.create_dot

        def as_fp32(h):
            if h.dtype.scalar == tl.bfloat16:  # the bits of an fp32 with its low half zeroed
                return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return h

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return orig_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

        create_dot._sonic_bf16 = True
        builder.create_dot = create_dot

    if not getattr(builder.cast_impl, "_sonic_rtne", False):  # fp32 -> bf16 rounds to nearest even, as on a GPU
        orig_cast = builder.cast_impl

        def cast_impl(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
                rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # finite values
                return interp.TensorHandle(rounded, tl.bfloat16)
            return orig_cast(self, src, dst_type)

        cast_impl._sonic_rtne = True
        builder.cast_impl = cast_impl  # create_fp_trunc and the other casts look it up on the builder

    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        orig = interp._patch_lang_tensor

        def patched(tensor, scope):
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interp._patch_lang_tensor = patched


def run_in_triton_interpreter(call: str, marker: str, timeout_s: float = 600) -> None:
    """Run `call` (Python, e.g. "import tests.x as t; t.main()") in a subprocess under TRITON_INTERPRET=1 and
    fail unless it printed `marker`; skip where Triton is not installed."""
    _run_triton_subprocess(call, marker, {"TRITON_INTERPRET": "1"}, timeout_s)


def run_triton_compiles(call: str, marker: str, tmp_path: Path, timeout_s: float = 900) -> None:
    """Run `call` in a subprocess that compiles for the GPU (no interpreter), its Triton cache under tmp_path, and
    fail unless it printed `marker`; skip where Triton is not installed."""
    _run_triton_subprocess(call, marker, {"TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_HOME": str(tmp_path),
                                          "TRITON_INTERPRET": None}, timeout_s)


def _run_triton_subprocess(call: str, marker: str, env_changes: dict, timeout_s: float) -> None:
    import importlib.util
    import os
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key, value in env_changes.items():
        env.pop(key, None)
        if value is not None:
            env[key] = value
    proc = subprocess.run([sys.executable, "-c", call], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def compile_for_hopper(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int = 3,
                       divisible: tuple = ()):
    """The Triton kernel `fn` compiled for sm_90 on any machine (a GPU is not needed). `types` gives every
    argument that is not a constexpr its Triton type by name; pointers, and the integers named in `divisible`,
    are specialised as divisible by 16, as a launch on aligned buffers and shapes specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name].startswith("*") or name in divisible}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm.get("cubin"), fn.__name__
    return compiled


def checkout_files(root: Path = CONFIGS.parent) -> dict[str, tuple[int, int]]:
    """Every file and directory of the checkout, tracked, untracked or ignored, with its size and
    mtime: two snapshots differ if anything was created, changed or deleted in between. Left out:
    .git, Python's __pycache__, pytest's cache and virtual environments (a directory with pyvenv.cfg)."""
    import os

    files = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in (".git", "__pycache__", ".pytest_cache")
                   and not os.path.isfile(os.path.join(folder, d, "pyvenv.cfg"))]
        for name in dirs + names:
            path = os.path.join(folder, name)
            stat = os.lstat(path)
            files[os.path.relpath(path, root)] = (stat.st_size if name in names else 0, stat.st_mtime_ns)
    return files


def changed_files(before: dict, after: dict) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def assert_padding(plan) -> None:
    """A plan's rows past its live ones are padding as sonic/routing/plan.py defines it: expert E, token 0,
    score 0, after every live row in rows_by_token_R and outside every expert's and token's range."""
    import torch

    live, R, E = plan.live_rows(), plan.num_rows, plan.num_experts
    assert 0 <= live <= R
    assert (plan.expert_idx_R[:live] < E).all() and (plan.expert_idx_R[live:] == E).all()
    assert (plan.token_idx_R[live:] == 0).all() and (plan.scores_R[live:] == 0).all()
    assert int(plan.token_offsets_T1[-1]) == live
    assert sorted(plan.rows_by_token_R[live:].tolist()) == list(range(live, R))
    by_token = plan.token_idx_R[plan.rows_by_token_R[:live].long()]
    assert torch.equal(by_token, by_token.sort().values)


def padded_plan_from_topk(expert_idx_TK, gates_TK, num_experts: int, extra: int):
    """The top-K picks' plan padded with `extra` rows (sonic/routing/plan.py), as token rounding sizes its plans."""
    import torch

    from sonic.routing.plan import plan_from_mask

    T, K = expert_idx_TK.shape
    gate_TE = torch.zeros(T, num_experts, device=gates_TK.device).scatter(1, expert_idx_TK, gates_TK)
    keep_ET = torch.zeros(T, num_experts, dtype=torch.bool, device=gates_TK.device).scatter(1, expert_idx_TK, True)
    return plan_from_mask(keep_ET.T.contiguous(), gate_TE, T * K + extra)


def saved_for_backward(fn, *args, compiled: bool):
    """(fn(*args), the tensors autograd saved for its backward), eagerly or under torch.compile with the min-cut
    partitioner (inductor's choice of what to save), so a test can see what a layer holds between passes."""
    import torch
    from functorch.compile import min_cut_rematerialization_partition, nop
    from torch._dynamo.backends.common import aot_autograd

    if compiled:
        torch._dynamo.reset()
        backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition)
        fn = torch.compile(fn, backend=backend, fullgraph=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved
