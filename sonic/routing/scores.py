"""Router scores: the block's hidden state x -> router logits, by routing.input_centring.

Legend: T tokens (B sequences of S), D hidden, E experts.

none    logits = W x (every published MoE router; what Hugging Face OLMoE / Qwen3-MoE compute).
prefix  logits = W c / rms(c), c_t = x_t - mean(x_s for the earlier positions s < t of its sequence)
        (position 0 keeps c = x). The router sees each token minus its context's shared vector.

Why (docs/routing.md, section 3): at a high learning rate attention's output projection grows, and
attention, which averages its values over the causal prefix, adds nearly the same vector to every
position of a sequence, in every layer. Deep layers' hidden states become mostly that shared vector
plus a small token part, so the part of the logits that every token of a sequence shares decides their
top-K: all of them go to the same K experts. The vector differs between sequences and moves a large
fraction of its norm between steps, so a running mean over past batches cannot remove it; the causal
prefix mean, the same kind of average that attention takes, does. The rescale
to unit RMS keeps the logits' scale whatever the share of the shared vector.

Both read only earlier positions of the same sequence, so a token's route never depends on the
future or on other sequences, and evaluation routes as training does. No state, nothing in a
checkpoint. The experts and the rest of the block still read the full hidden state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CENTRINGS = ("none", "prefix")
EPS = 1e-6  # as RMSNorm's: c's RMS is O(1) (the block's input is normalised)


class RawScores(nn.Module):
    """routing.input_centring=none."""

    def forward(self, x_TD: Tensor, weight_ED: Tensor, seq_len: int | None = None) -> Tensor:
        return F.linear(x_TD, weight_ED)


class PrefixCentredScores(nn.Module):
    """routing.input_centring=prefix."""

    def forward(self, x_TD: Tensor, weight_ED: Tensor, seq_len: int | None = None) -> Tensor:
        """seq_len: the length S of the sequences x_TD holds, in order (None: one sequence of T)."""
        T, D = x_TD.shape
        S = T if seq_len is None else seq_len
        assert S > 0 and T % S == 0, (T, S)
        acc = torch.promote_types(x_TD.dtype, torch.float32)  # 4096 bf16 adds would drift
        # positions innermost: a CUDA scan along an outer dim is ~30x slower than along the innermost one
        x_BDS = x_TD.view(T // S, S, D).transpose(1, 2).to(acc, memory_format=torch.contiguous_format)
        earlier_BDS = x_BDS.cumsum(-1) - x_BDS  # the sum over s < t
        count_S = torch.arange(S, device=x_TD.device, dtype=acc).clamp_min(1)
        c_TD = (x_BDS - earlier_BDS / count_S).transpose(1, 2).reshape(T, D).to(x_TD.dtype)
        # W (c / rms(c)) as (W c) / rms(c): autograd keeps only c (the linear keeps it anyway) and rms(c)
        mean_square_T = torch.linalg.vector_norm(c_TD, dim=-1, dtype=acc).square() / D
        return F.linear(c_TD, weight_ED) * torch.rsqrt(mean_square_T + EPS).unsqueeze(-1)


def build_scores(centring: str) -> nn.Module:
    assert centring in CENTRINGS, centring
    return PrefixCentredScores() if centring == "prefix" else RawScores()
