"""The triton backend's expert kernels compile for Hopper (sm_90) on a machine without a GPU, without spilling.

The CPU tests run these kernels in Triton's interpreter, which neither lowers them to wgmma and TMA nor allocates
registers. A tile whose epilogue holds too many fp32 tiles compiles and passes there, then spills to local memory
on the GPU: dH's 128 x 128 tile did, and ran at two thirds of the other products' TFLOPS. Here every kernel of
sonic/kernels/triton/gemm.py goes through Triton's compiler to an sm_90 cubin, at every tile candidate of
`tuning.CANDIDATES` (the first runs untuned, autotuning may pick any) and in the branches the launchers take at
30B's shape, and cuobjdump's resource usage must show no stack frame (ptxas's spill slots). The compiles run in a subprocess whose
Triton cache is a temporary folder."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import run_triton_compiles

D, N, E, R = 4096, 512, 128, 262144  # 30B's shape (routed rows R = T * K = 32768 * 8)
SMS = 132
BF16, F32, I32 = "*bf16", "*fp32", "*i32"
# every kernel argument by name: its Triton type (the tensor descriptors are added per launch)
ARG_TYPES = {
    **dict.fromkeys(("x_TD", "w1_EFD", "b1_EF", "h_RF", "a_RN", "a_RK", "b_EKN", "bias_EN", "out_RN", "dout_TD",
                     "w2_EDN", "b2_ED", "dh_RF", "aprime_RN", "p_XI", "q_YJ", "weight_R", "out_EIJ",
                     "bias_grad_EI", "rows_RD", "out_TD"), BF16),
    **dict.fromkeys(("scores_R", "ds_part_JR"), F32),
    **dict.fromkeys(("token_idx_R", "tile_expert_M", "tile_row_M", "num_tiles_1", "expert_offsets_E1", "p_idx_R",
                     "q_idx_R", "token_offsets_T1", "rows_by_token_R"), I32),
}
ARG_TYPES.update(dict.fromkeys(("R", "D", "N", "K", "F", "I", "J", "E", "B_ROWS", "stride_bk", "stride_bn"), "i32"))
# the integer arguments Triton specialises as divisible by 16 at 30B's shape (R is do_not_specialize)
DIVISIBLE = ("D", "N", "K", "F", "I", "J", "B_ROWS", "stride_bn")


def _desc(rows: int, cols: int, block: list[int]) -> str:
    import torch
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    return mangle_type(TensorDescriptor.from_tensor(torch.empty(rows, cols, dtype=torch.bfloat16), block))


def launches() -> list[tuple[str, object, dict, dict, object]]:
    """(name, kernel, extra argument types, constexprs, config) per kernel, branch and tile candidate (autotuning
    may pick any of them); the config's tile is added to the constexprs of the tiled kernels, its warps and stages
    go to the compiler."""
    from sonic.kernels.triton import gemm, tuning

    F = 2 * N
    dw = dict(EVEN_IJ=True, BIAS_GRAD=True, WEIGHTED=False)
    tiled = (  # (tuning key, kernel, extra types of a config, constexprs)
        ("up", gemm.up_proj_kernel, lambda c: {}, dict(HAS_BIAS=False, EVEN_K=True)),
        ("up_tma", gemm.up_proj_tma_kernel, lambda c: dict.fromkeys(("g_desc", "u_desc"),
                                                                    _desc(E * N, D, [c.bn // 2, c.bk])),
         dict(HAS_BIAS=False, NUM_SMS=SMS)),
        ("down", gemm.varlen_m_gemm_kernel, lambda c: {}, dict(HAS_BIAS=False, EVEN_K=True, EVEN_N=True)),
        ("dxt", gemm.varlen_m_gemm_kernel, lambda c: {}, dict(HAS_BIAS=False, EVEN_K=True, EVEN_N=True)),
        ("down_tma", gemm.varlen_m_tma_kernel,
         lambda c: dict(a_desc=_desc(R, N, [c.bm, c.bk]), b_desc=_desc(E * D, N, [c.bn, c.bk])),
         dict(HAS_BIAS=False, B_NK=True, NUM_SMS=SMS)),
        ("dxt_tma", gemm.varlen_m_tma_kernel,
         lambda c: dict(a_desc=_desc(R, F, [c.bm, c.bk]), b_desc=_desc(E * F, D, [c.bk, c.bn])),
         dict(HAS_BIAS=False, B_NK=False, NUM_SMS=SMS)),
        ("dh", gemm.dh_kernel, lambda c: {},
         dict(HAS_BIAS=False, EVEN_K=True, EVEN_N=True, PREFETCH_H=True, LINE=64)),
        # dW2 = dO[pi]^T A' (P gathered), dW1 = dH^T X[pi] (Q gathered), by pointers
        ("dw", gemm.varlen_k_gemm_kernel, lambda c: {}, dict(dw, GATHER_P=True, GATHER_Q=False)),
        ("dw", gemm.varlen_k_gemm_kernel, lambda c: {}, dict(dw, GATHER_P=False, GATHER_Q=True)),
        # and with the contiguous operand by TMA: dH (R, F) for dW1, A' (R, N) for dW2
        ("dw1_tma", gemm.varlen_k_tma_kernel, lambda c: dict(p=_desc(R, F, [c.bk, c.bm]), q=BF16),
         dict(dw, GATHER_P=False, GATHER_Q=True)),
        ("dw2_tma", gemm.varlen_k_tma_kernel, lambda c: dict(p=BF16, q=_desc(R, N, [c.bk, c.bn])),
         dict(dw, BIAS_GRAD=False, GATHER_P=True, GATHER_Q=False)),
    )
    out = [(name, fn, types(cfg), constexprs, cfg)
           for name, fn, types, constexprs in tiled for cfg in tuning.CANDIDATES[name]]
    # untiled: the launchers' own constants (function.TileMap, function.gather_sum at D 4096)
    out.append(("tile_map", gemm.tile_map_kernel, {}, dict(BM=128, BLOCK_E=E, BLOCK_J=64),
                tuning.Config(0, 0, 0, 4, 3)))
    out.append(("gather_sum", gemm.gather_sum_kernel, {}, dict(WEIGHTED=True, BLOCK_D=D, CHUNK=4),
                tuning.Config(0, 0, 0, 8, 3)))
    return out


def _stack_bytes(cubin: bytes, tmp: Path) -> int:
    import triton

    path = tmp / "kernel.cubin"
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    found = re.findall(r"STACK:(\d+)", usage)
    assert found, usage
    return max(int(v) for v in found)


def _main(tmp: str) -> None:
    from tests.helpers import compile_for_hopper

    spilled = []
    for name, fn, extra, constexprs, cfg in launches():
        if cfg.bm:
            constexprs = dict(constexprs, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk)
        compiled = compile_for_hopper(fn, {**ARG_TYPES, **extra}, constexprs, cfg.warps, cfg.stages, DIVISIBLE)
        stack = _stack_bytes(compiled.asm["cubin"], Path(tmp))
        print(f"{name}: {cfg} stack {stack} bytes")
        if stack:
            spilled.append(f"{name} {cfg}: {stack} bytes of stack")
        if constexprs.get("PREFETCH_H"):  # dH asks L2 for its epilogue's H slab, evict-last (gemm._prefetch_l2)
            assert "prefetch.global.L2::evict_last" in compiled.asm["ptx"], f"{name} {cfg}: no H prefetch"
    assert not spilled, "tiles that spill registers on sm_90: " + "; ".join(spilled)
    print(f"compiled {len(launches())} kernels for sm_90")


@pytest.mark.slow
def test_expert_kernels_compile_for_hopper_without_spills(tmp_path):
    run_triton_compiles(f"import tests.kernels.test_triton_gemm_compile as t; t._main({str(tmp_path)!r})",
                        "compiled", tmp_path)
