"""The triton routing backend's kernels compile for Hopper (sm_90) on a machine without a GPU.

The CPU tests run these kernels in Triton's interpreter, which accepts code that the GPU compiler rejects: a plain
Python global read inside a kernel passed every interpreter test of token rounding's keep kernel and failed its
first GPU run. Here each kernel of sonic/kernels/triton/routing.py and rounding.py goes through Triton's compiler to
a cubin, in every constexpr branch the backend launches, with the launchers' own tile configs. The compiles run in
a subprocess whose Triton cache is a temporary folder."""
from __future__ import annotations

import pytest

from tests.helpers import run_triton_compiles

# every kernel argument by name: its Triton type (pointers by element type; the rest are int32 scalars)
ARG_TYPES = {
    **dict.fromkeys(("logits_TE", "bias_E", "gates_TK", "lse_T", "probsum_CE", "dgates_TK", "dprobsum_E", "dlse_T",
                     "dP_TE", "dlogits_TE", "probsum_E", "uniform_E", "scores_R"), "*fp32"),
    **dict.fromkeys(("idx_TK", "residual_E", "topk_counts_E", "rounded_E"), "*i64"),
    **dict.fromkeys(("counts_CE", "key_ET", "prob_ET", "base_CE", "total_E", "expert_offsets_E1", "token_idx_R",
                     "expert_idx_R", "order_R", "rows_by_token_R", "f_E", "token_offsets_T1", "pick_R", "row_ET",
                     "chunk_counts"), "*i32"),
    **dict.fromkeys(("T", "C", "rows"), "i32"),
}


def launches() -> list[tuple[object, dict]]:
    """(kernel, constexprs with num_warps) for each kernel and branch, at sonic_7b's routing shape (E 128, K 8) and
    at K 16 (the select kernel's sort path)."""
    from sonic.kernels.triton import rounding, routing

    E, K = 128, 8
    tiles, chunks = routing._tiles(E, K), routing._chunks(E, K)
    sort_chunks = routing._chunks(E, 16)
    be, tb = 128, rounding.token_tile(E)
    out = []
    for cfg, k in ((chunks, K), (sort_chunks, 16)):
        for keys in (False, True):
            out.append((routing._select_kernel, dict(cfg, E=E, K=k, ORDER=0, RENORM=False, COUNT=True, KEYS=keys,
                                                     SORT=k >= routing.SORT_FROM_K)))
    for order, renorm, dp in ((0, False, False), (1, True, True)):
        out.append((routing._select_backward_kernel, dict(tiles, E=E, K=K, ORDER=order, RENORM=renorm, DP=dp)))
    out += [(routing._scan_chunks_kernel, dict(E=E, BC=routing.SCAN_C, BE=routing.SCAN_E, num_warps=4)),
            (routing._expert_offsets_kernel, dict(E=E, BE=E, num_warps=4)),
            (routing._scatter_kernel, dict(E=E, K=K, BT=chunks["BT"] * chunks["SUB"], KP=chunks["KP"], num_warps=8))]
    out += [(rounding._round_kernel, dict(E=E, TILE=128, MODE=mode, BE=be, num_warps=4))
            for mode in rounding.MODES.values()]
    out += [(rounding._keep_kernel, dict(RESIDENT=resident, ROW=16384, CHUNK=rounding._CHUNK, num_warps=16))
            for resident in (True, False)]
    out += [(rounding._chunk_counts_kernel, dict(E=E, TB=tb, BE=be, num_warps=4)),
            (rounding._token_rows_kernel, dict(E=E, K=K, TB=tb, BE=be, KP=K, NCHP=512, PAD=512, num_warps=4))]
    return out


def _main() -> None:
    from tests.helpers import compile_for_hopper

    for fn, constexprs in launches():
        constexprs = dict(constexprs)
        warps = constexprs.pop("num_warps")
        compile_for_hopper(fn, ARG_TYPES, constexprs, warps)
    print(f"compiled {len(launches())} kernels for sm_90")


@pytest.mark.slow
def test_routing_kernels_compile_for_hopper(tmp_path):
    run_triton_compiles("import tests.routing.test_triton_compile as t; t._main()", "compiled", tmp_path)
