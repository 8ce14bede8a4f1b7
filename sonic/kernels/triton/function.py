"""The Triton backend's forward / backward (run as the sonic::experts custom op, sonic/kernels/op.py) and
kernel launchers (see gemm.py for the kernels).

Forward: up-proj (H, A), down-proj (Y), gather-sum (O). Saves X, H and the plan, like
the reference, so the saved bytes are identical. Backward: dH (dH, A', dS partials),
dW2 / db2, dX~, dW1 / db1, gather-sum (dX). A, Y, A', dH and dX~ are transients.

No launch reads a device value on the host: grids come from tensor shapes (R, T, E) and
tile configs, which depend on the shape class only (tuning.py).
"""
from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from sonic.kernels import op
from sonic.kernels.triton import gemm, tuning
from sonic.routing.plan import RoutingPlan

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Every buffer a kernel writes is allocated here (tests poison it to catch unwritten output)."""
    return torch.empty(shape, dtype=dtype, device=device)


class TileMap:
    """Device-side (expert, first row) of every BM-row tile, for one plan and one BM."""

    def __init__(self, expert_offsets_E1: Tensor, num_rows: int, bm: int):
        E = expert_offsets_E1.numel() - 1
        self.max_tiles = triton.cdiv(num_rows, bm) + E
        dev = expert_offsets_E1.device
        self.tile_expert = _alloc((self.max_tiles,), torch.int32, dev)
        self.tile_row = _alloc((self.max_tiles,), torch.int32, dev)
        self.num_tiles = _alloc((1,), torch.int32, dev)
        gemm.tile_map_kernel[(E,)](expert_offsets_E1, self.tile_expert, self.tile_row, self.num_tiles,
                                   E, BM=bm, BLOCK_E=max(16, min(1024, triton.next_power_of_2(E))),
                                   BLOCK_J=64)

    def args(self, expert_offsets_E1: Tensor) -> tuple:
        return self.tile_expert, self.tile_row, self.num_tiles, expert_offsets_E1


class _Maps:
    """Tile maps built lazily, once per BM, for one plan within one forward or backward."""

    def __init__(self, plan_offsets_E1: Tensor, num_rows: int):
        self.off, self.R, self.maps = plan_offsets_E1, num_rows, {}

    def __call__(self, bm: int) -> TileMap:
        if bm not in self.maps:
            self.maps[bm] = TileMap(self.off, self.R, bm)
        return self.maps[bm]


def _key(x: Tensor, D: int, N: int, E: int) -> tuple:
    return (D, N, tuning.e_bucket(E), str(x.dtype).removeprefix("torch."))


# ---------------------------------------------------------------- launchers (one per kernel)

def up_proj(x_TD, w1_EFD, b1_EF, token_idx_R, maps: _Maps, key) -> tuple[Tensor, Tensor]:
    R, (E, F, D) = token_idx_R.numel(), w1_EFD.shape
    h_RF = _alloc((R, F), x_TD.dtype, x_TD.device)
    a_RN = _alloc((R, F // 2), x_TD.dtype, x_TD.device)
    # W1's gate rows (even) and up rows (odd) as two (E*N, D) views that TMA reads
    gate_up = w1_EFD.view(E * F // 2, 2, D).unbind(1)
    if _tma_ok(*gate_up):
        def run_tma(cfg: tuning.Config):
            tm = maps(cfg.bm)
            g_desc, u_desc = (TensorDescriptor.from_tensor(w, [cfg.bn // 2, cfg.bk]) for w in gate_up)
            sms = _num_sms(x_TD.device)
            gemm.up_proj_tma_kernel[(sms,)](x_TD, token_idx_R, g_desc, u_desc,
                                            b1_EF if b1_EF is not None else w1_EFD, h_RF, a_RN, *tm.args(maps.off),
                                            R, D, F, HAS_BIAS=b1_EF is not None, NUM_SMS=sms, **cfg.kwargs())

        cfg = tuning.choose("up_tma", key, run_tma, lambda c: tuning.halves(tuning.fit(c, F, D)))
        if D % cfg.bk == 0:
            run_tma(cfg)
            return h_RF, a_RN

    def run(cfg: tuning.Config):
        tm = maps(cfg.bm)
        grid = (tm.max_tiles * triton.cdiv(F, cfg.bn),)
        gemm.up_proj_kernel[grid](x_TD, token_idx_R, w1_EFD, b1_EF if b1_EF is not None else w1_EFD,
                                  h_RF, a_RN, *tm.args(maps.off), R, D, F,
                                  HAS_BIAS=b1_EF is not None, EVEN_K=D % cfg.bk == 0, **cfg.kwargs())

    cfg = tuning.choose("up", key, run, lambda c: tuning.halves(tuning.fit(c, F, D)))
    run(cfg)
    return h_RF, a_RN


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM (a few under the CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _tma_ok(*tensors: Tensor) -> bool:
    """Whether TMA can load these row-major operands: sm_90 or later, 16-bit (the fp32 tiles would not fit shared
    memory at the tuned sizes), 16-byte aligned base and rows. On the CPU the kernels run only under Triton's
    interpreter, which runs the TMA kernels too (in every dtype), so the CPU tests cover both paths."""
    dev = tensors[0].device
    if dev.type == "cuda" and (torch.cuda.get_device_capability(dev)[0] < 9
                               or tensors[0].dtype not in (torch.bfloat16, torch.float16)):
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.stride(-2) * t.element_size() % 16 == 0
               for t in tensors)


def varlen_m(a_RK, b_EKN, stride_bk, stride_bn, N, bias_EN, maps: _Maps, kernel: str, key) -> Tensor:
    R, K = a_RK.shape
    E = b_EKN.shape[0]
    out_RN = _alloc((R, N), a_RK.dtype, a_RK.device)
    # B_e as TMA reads it: rows n (stride_bk == 1: W2 (E, D, N) for the down-projection) or rows k (W1 (E, F, D)
    # for dX~), every expert's rows stacked
    b_rows = b_EKN.reshape(E * N, K) if stride_bk == 1 else b_EKN.reshape(E * K, N)
    if _tma_ok(a_RK, b_rows):
        def run_tma(cfg: tuning.Config):
            tm = maps(cfg.bm)
            a_desc = TensorDescriptor.from_tensor(a_RK, [cfg.bm, cfg.bk])
            b_desc = TensorDescriptor.from_tensor(b_rows, [cfg.bn, cfg.bk] if stride_bk == 1 else [cfg.bk, cfg.bn])
            sms = _num_sms(a_RK.device)
            gemm.varlen_m_tma_kernel[(sms,)](a_desc, b_desc, bias_EN if bias_EN is not None else b_EKN, out_RN,
                                             *tm.args(maps.off), R, K, N, N if stride_bk == 1 else K,
                                             HAS_BIAS=bias_EN is not None, B_NK=stride_bk == 1, NUM_SMS=sms,
                                             **cfg.kwargs())

        cfg = tuning.choose(kernel + "_tma", key, run_tma, lambda c: tuning.fit(c, N, K))
        if K % cfg.bk == 0:
            run_tma(cfg)
            return out_RN

    def run(cfg: tuning.Config):
        tm = maps(cfg.bm)
        grid = (tm.max_tiles * triton.cdiv(N, cfg.bn),)
        gemm.varlen_m_gemm_kernel[grid](a_RK, b_EKN, bias_EN if bias_EN is not None else b_EKN, out_RN,
                                        *tm.args(maps.off), R, K, N, stride_bk, stride_bn,
                                        HAS_BIAS=bias_EN is not None, EVEN_K=K % cfg.bk == 0,
                                        EVEN_N=N % cfg.bn == 0, **cfg.kwargs())

    cfg = tuning.choose(kernel, key, run, lambda c: tuning.fit(c, N, K))
    run(cfg)
    return out_RN


def dh(dout_TD, token_idx_R, scores_R, w2_EDN, b2_ED, h_RF, maps: _Maps, key):
    R, (E, D, N) = token_idx_R.numel(), w2_EDN.shape
    dh_RF = _alloc((R, 2 * N), h_RF.dtype, h_RF.device)
    aprime_RN = _alloc((R, N), h_RF.dtype, h_RF.device)
    result = {}

    def run(cfg: tuning.Config):
        tm = maps(cfg.bm)
        num_n = triton.cdiv(N, cfg.bn)
        ds_part_JR = _alloc((num_n, R), torch.float32, h_RF.device)
        gemm.dh_kernel[(tm.max_tiles * num_n,)](
            dout_TD, token_idx_R, scores_R, w2_EDN, b2_ED if b2_ED is not None else w2_EDN, h_RF,
            dh_RF, aprime_RN, ds_part_JR, *tm.args(maps.off), R, D, N,
            HAS_BIAS=b2_ED is not None, EVEN_K=D % cfg.bk == 0, EVEN_N=N % cfg.bn == 0,
            PREFETCH_H=h_RF.is_cuda, LINE=128 // h_RF.element_size(), **cfg.kwargs())
        result["ds_part"] = ds_part_JR

    cfg = tuning.choose("dh", key, run, lambda c: tuning.fit(c, N, D))
    run(cfg)
    ds_R = result["ds_part"].sum(0)  # fixed-order sum over column tiles: deterministic
    return dh_RF, aprime_RN, ds_R


def varlen_k(p_XI, p_idx_R, q_YJ, q_idx_R, expert_offsets_E1, out_dtype, weight_R=None,
             bias_grad: bool = False, key=(), kernel: str = "dw") -> tuple[Tensor, Tensor | None]:
    """out_e = P[rows of e]^T Q[rows of e] (rows optionally gathered), (E, I, J). `kernel` names the product's
    TMA tile configs in tuning.py (dw1, dw2); the pointer kernel's are "dw"."""
    I, J = p_XI.shape[1], q_YJ.shape[1]
    E = expert_offsets_E1.numel() - 1
    out_EIJ = _alloc((E, I, J), out_dtype, p_XI.device)
    bias_EI = _alloc((E, I), out_dtype, p_XI.device) if bias_grad else None

    contiguous = [t for t, idx in ((p_XI, p_idx_R), (q_YJ, q_idx_R)) if idx is None]
    tma = bool(contiguous) and _tma_ok(*contiguous)

    def run(cfg: tuning.Config):
        grid = (E * triton.cdiv(I, cfg.bm) * triton.cdiv(J, cfg.bn),)
        p, q = p_XI, q_YJ
        if tma:  # the operands that are not gathered as TMA descriptors of (BK rows) x (the tile's columns)
            p = p if p_idx_R is not None else TensorDescriptor.from_tensor(p_XI, [cfg.bk, cfg.bm])
            q = q if q_idx_R is not None else TensorDescriptor.from_tensor(q_YJ, [cfg.bk, cfg.bn])
        launch = gemm.varlen_k_tma_kernel if tma else gemm.varlen_k_gemm_kernel
        launch[grid](p, p_idx_R if p_idx_R is not None else expert_offsets_E1, q,
                     q_idx_R if q_idx_R is not None else expert_offsets_E1,
                     weight_R if weight_R is not None else p_XI, out_EIJ,
                     bias_EI if bias_EI is not None else out_EIJ, expert_offsets_E1, I, J,
                     EVEN_IJ=I % cfg.bm == 0 and J % cfg.bn == 0, GATHER_P=p_idx_R is not None,
                     GATHER_Q=q_idx_R is not None, BIAS_GRAD=bias_grad, WEIGHTED=weight_R is not None,
                     **cfg.kwargs())

    def adjust(c: tuning.Config) -> tuning.Config:
        f = tuning.fit(c, J, 1 << 30)
        return tuning.Config(max(16, min(f.bm, triton.next_power_of_2(I))), f.bn, f.bk, f.warps, f.stages)

    cfg = tuning.choose(kernel + "_tma" if tma else "dw", key + (I, J), run, adjust)
    run(cfg)
    return out_EIJ, bias_EI


def gather_sum(rows_RD: Tensor, plan: RoutingPlan, weight_R: Tensor | None, out_dtype) -> Tensor:
    T, D = plan.num_tokens, rows_RD.shape[1]
    out_TD = _alloc((T, D), out_dtype, rows_RD.device)
    block_d = min(triton.next_power_of_2(D), 4096)
    gemm.gather_sum_kernel[(T, triton.cdiv(D, block_d))](
        rows_RD, weight_R if weight_R is not None else rows_RD, plan.token_offsets_T1,
        plan.rows_by_token_R, out_TD, D, WEIGHTED=weight_R is not None, BLOCK_D=block_d, CHUNK=4,
        num_warps=max(1, min(8, block_d // 256)))
    return out_TD


# ---------------------------------------------------------------- sonic::experts (sonic/kernels/op.py)

def forward(x_TD, w1_EFD, w2_EDN, b1_EF, b2_ED, plan: RoutingPlan) -> tuple[Tensor, Tensor]:
    T, D = x_TD.shape
    E, F, _ = w1_EFD.shape
    N, R = F // 2, plan.num_rows
    if R == 0:
        return x_TD.new_zeros(T, D), x_TD.new_empty(0, F)
    key = _key(x_TD, D, N, E)
    maps = _Maps(plan.expert_offsets_E1, R)
    h_RF, a_RN = up_proj(x_TD, w1_EFD, b1_EF, plan.token_idx_R, maps, key)
    # Y_e = A_e W2_e^T: B[k, n] = w2[e, n, k]
    y_RD = varlen_m(a_RN, w2_EDN, 1, N, D, b2_ED, maps, "down", key)
    del a_RN
    return gather_sum(y_RD, plan, plan.scores_R, x_TD.dtype), h_RF


def backward(dout_TD, x_TD, h_RF, w1_EFD, w2_EDN, b1_EF, b2_ED, plan: RoutingPlan, needs) -> tuple:
    scores_R = plan.scores_R
    T, D = x_TD.shape
    E, F, _ = w1_EFD.shape
    N, R = F // 2, plan.num_rows
    need_dx, need_dw1, need_dw2, need_db1, need_db2, _ = needs
    dout_TD = dout_TD.to(x_TD.dtype).contiguous()
    if R == 0:
        zero = lambda t: None if t is None else torch.zeros_like(t)  # noqa: E731
        return (torch.zeros_like(x_TD), zero(w1_EFD), zero(w2_EDN), zero(b1_EF), zero(b2_ED),
                torch.zeros_like(scores_R))
    key = _key(x_TD, D, N, E)
    maps = _Maps(plan.expert_offsets_E1, R)
    tok = plan.token_idx_R
    dh_RF, aprime_RN, ds_R = dh(dout_TD, tok, scores_R, w2_EDN, b2_ED, h_RF, maps, key)
    dw2 = db2 = dw1 = db1 = dx_TD = None
    if need_dw2 or need_db2:  # dW2_e = dO[pi_e]^T A'_e ; db2_e = sum s * dO[pi_e]
        dw2, db2 = varlen_k(dout_TD, tok, aprime_RN, None, plan.expert_offsets_E1, w2_EDN.dtype,
                            weight_R=scores_R if b2_ED is not None else None,
                            bias_grad=b2_ED is not None, key=key, kernel="dw2")
    del aprime_RN
    if need_dx:  # dX~_e = dH_e W1_e: B[k, n] = w1[e, k, n]
        dxt_RD = varlen_m(dh_RF, w1_EFD, D, 1, D, None, maps, "dxt", key)
        dx_TD = gather_sum(dxt_RD, plan, None, x_TD.dtype)
        del dxt_RD
    if need_dw1 or need_db1:  # dW1_e = dH_e^T X[pi_e] ; db1_e = sum dH_e
        dw1, db1 = varlen_k(dh_RF, None, x_TD, tok, plan.expert_offsets_E1, w1_EFD.dtype,
                            bias_grad=b1_EF is not None, key=key, kernel="dw1")
    return (dx_TD, dw1, dw2, db1 if b1_EF is not None else None, db2 if b2_ED is not None else None,
            ds_R.to(scores_R.dtype))


def _check(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan, b1_EF, b2_ED) -> None:
    if x_TD.dim() != 2:
        raise ValueError(f"x_TD must be 2-D (tokens, hidden), got shape {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    if w1_EFD.dim() != 3 or w1_EFD.shape[2] != D or w1_EFD.shape[1] % 2:
        raise ValueError(f"w1_EFD must be (E, 2N, {D}), got {tuple(w1_EFD.shape)}")
    E, F, _ = w1_EFD.shape
    if tuple(w2_EDN.shape) != (E, D, F // 2):
        raise ValueError(f"w2_EDN must be ({E}, {D}, {F // 2}), got {tuple(w2_EDN.shape)}")
    if b1_EF is not None and tuple(b1_EF.shape) != (E, F):
        raise ValueError(f"b1_EF must be ({E}, {F}), got {tuple(b1_EF.shape)}")
    if b2_ED is not None and tuple(b2_ED.shape) != (E, D):
        raise ValueError(f"b2_ED must be ({E}, {D}), got {tuple(b2_ED.shape)}")
    if plan.num_experts != E or plan.num_tokens != T:
        raise ValueError(f"plan is for {plan.num_tokens} tokens x {plan.num_experts} experts, "
                         f"inputs have {T} x {E}")
    if x_TD.dtype not in _SUPPORTED:
        raise ValueError(f"triton backend supports {_SUPPORTED}, got {x_TD.dtype}")
    for name, t in (("w1_EFD", w1_EFD), ("w2_EDN", w2_EDN), ("b1_EF", b1_EF), ("b2_ED", b2_ED)):
        if t is not None and t.dtype != x_TD.dtype:
            raise ValueError(f"{name} is {t.dtype} but x_TD is {x_TD.dtype}; cast them alike")


def experts(x_TD: Tensor, w1_EFD: Tensor, w2_EDN: Tensor, plan: RoutingPlan,
            b1_EF: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    _check(x_TD, w1_EFD, w2_EDN, plan, b1_EF, b2_ED)
    c = lambda t: None if t is None else t.contiguous()  # noqa: E731
    plan = RoutingPlan.from_metadata(plan.scores_R.contiguous(), tuple(m.contiguous() for m in plan.metadata()))
    return op.experts(x_TD.contiguous(), w1_EFD.contiguous(), w2_EDN.contiguous(), plan, c(b1_EF), c(b2_ED),
                      backend="triton")
