"""SwiGLU on the fused, interleaved gate/up layout used by every backend.

W1 is stored as w1_EFD with F = 2N rows, gate and up interleaved: row 2j is gate j and
row 2j+1 is up j. An epilogue tile of H then holds the gate and up of the same N columns,
so SwiGLU / dSwiGLU need no cross-tile exchange. H (R x 2N) has the same interleaving.
"""
from __future__ import annotations

import torch
from torch import Tensor


def acc(t: Tensor) -> Tensor:
    """Upcast to the accumulation dtype: fp32, or fp64 for fp64 inputs (gradient checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def swiglu(h_RF: Tensor) -> Tensor:
    """a = silu(gate) * up, computed and returned in the accumulation dtype."""
    h = acc(h_RF)
    gate, up = h[..., 0::2], h[..., 1::2]
    return torch.nn.functional.silu(gate) * up


def dswiglu(da_RN: Tensor, h_RF: Tensor) -> Tensor:
    """dH from dA and H, in the accumulation dtype, interleaved like H."""
    h = acc(h_RF)
    gate, up = h[..., 0::2], h[..., 1::2]
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dgate = da_RN * up * (sig + silu * (1.0 - sig))
    dup = da_RN * silu
    return torch.stack((dgate, dup), dim=-1).flatten(-2)


def interleave(gate_END: Tensor, up_END: Tensor) -> Tensor:
    """(E, N, D) gate and up weights -> fused w1 (E, 2N, D)."""
    return torch.stack((gate_END, up_END), dim=-2).flatten(-3, -2)


def deinterleave(w1_EFD: Tensor) -> tuple[Tensor, Tensor]:
    """Fused w1 (E, 2N, D) -> (gate, up), each (E, N, D)."""
    return w1_EFD[..., 0::2, :], w1_EFD[..., 1::2, :]
