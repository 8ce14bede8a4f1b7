"""Dense building blocks: RMSNorm, rotary embeddings, attention, SwiGLU MLP.

Legend: B batch, S sequence, D hidden, H query heads, G kv heads, Hd head dim.
Weight names follow the Hugging Face OLMoE/Qwen3 modules so import/export is a rename.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonic.models.attention import AttentionCore


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype autocast would compute in for `x`: the inputs of our autograd Functions (expert
    kernels, loss backends) are cast to it by hand, since autocast does not reach inside them."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """RoPE in the rotate-half convention (as OLMoE and Qwen3), tables kept in fp32."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos_SHd", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin_SHd", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the tables in place, e.g. after building the model on the meta device."""
        if self.cos_SHd.is_meta:
            return
        dev = self.cos_SHd.device
        inv_freq = self.theta ** -(torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=dev) / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=dev), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos_SHd.copy_(angles.cos())
        self.sin_SHd.copy_(angles.sin())

    def forward(self, x_BHSHd: Tensor) -> Tensor:
        S = x_BHSHd.shape[-2]
        if S > self.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds model.max_seq_len={self.max_seq_len}; "
                             f"raise model.max_seq_len or lower train.seq_len")
        x = x_BHSHd.float()
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x * self.cos_SHd[:S] + rotated * self.sin_SHd[:S]).to(x_BHSHd.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: str, eps: float,
                 core: AttentionCore):
        super().__init__()
        self.H, self.G, self.Hd = num_heads, num_kv_heads, head_dim
        self.core = core  # shared by all layers; see sonic/models/attention.py
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=False)
        self.qk_norm = qk_norm
        if qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(num_heads * head_dim, eps), RMSNorm(num_kv_heads * head_dim, eps)
        elif qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def forward(self, x_BSD: Tensor, rotary: Rotary, mask) -> Tensor:
        """mask: what `core.mask` built for this batch (None, a dense mask or a BlockMask)."""
        B, S, _ = x_BSD.shape
        # One GEMM for q, k and v: a wider N runs nearer the GPU's peak, and the backward's dx is one GEMM
        # rather than three and their sum. The weights stay three parameters (checkpoints and HF names).
        w_QD = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        q, k, v = F.linear(x_BSD, w_QD).split((self.H * self.Hd, self.G * self.Hd, self.G * self.Hd), dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.H, self.Hd)
        k = k.view(B, S, self.G, self.Hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q.transpose(1, 2)), rotary(k.transpose(1, 2))
        v = v.view(B, S, self.G, self.Hd).transpose(1, 2)
        o = self.core(q, k, v, mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.H * self.Hd))


class SwiGLUMLP(nn.Module):
    """Dense FFN (first-k dense layers) and the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # gate and up as one GEMM, as q, k and v in Attention
        gate, up = F.linear(x, torch.cat((self.gate_proj.weight, self.up_proj.weight))).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
