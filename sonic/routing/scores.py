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

import importlib
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonic.ops import DualOp

CENTRINGS = ("none", "prefix")
EPS = 1e-6  # as RMSNorm's: c's RMS is O(1) (the block's input is normalised)


class RawScores(nn.Module):
    """routing.input_centring=none."""

    def forward(self, x_TD: Tensor, weight_ED: Tensor, seq_len: int | None = None, ops=None) -> Tensor:
        return F.linear(x_TD, weight_ED)


class PrefixCentredScores(nn.Module):
    """routing.input_centring=prefix."""

    def forward(self, x_TD: Tensor, weight_ED: Tensor, seq_len: int | None = None, ops=None) -> Tensor:
        """seq_len: the length S of the sequences x_TD holds, in order (None: one sequence of T). ops: the routing
        backend module whose prefix_centred_logits[_backward] compute it (None: this module's, the definition)."""
        S = _resolve_seq_len(x_TD.shape[0], seq_len)
        ops = ops or sys.modules[__name__]
        return _centred_logits(x_TD, weight_ED, S, ops.__name__, traced=_traced(ops))[0]


def _traced(ops) -> bool:
    """Whether the backend module's ops may be traced by torch.compile (sonic/ops.py): its TRACED_OPS."""
    return getattr(ops, "TRACED_OPS", False)


def _resolve_seq_len(T: int, seq_len: int | None) -> int:
    """The length of the sequences a (T, .) tensor holds in order: seq_len, or one sequence of T when None."""
    S = T if seq_len is None else seq_len
    assert S > 0 and T % S == 0, (T, S)
    return S


# logits = (W c) * rstd, rstd = rsqrt(mean(c^2) + EPS), c = prefix_centre(x), as one op with its own backward op,
# both run by the routing backend's prefix_centred_logits[_backward]: autograd through plain ops would keep c, one
# more T x D tensor per layer (and so would torch.compile's partitioner). rstd is a constant to autograd, as
# routing.logit_norm's statistics are: the router's own gradient (dW = dz^T c) is the same either way, and the
# gradient on x loses only the part of the rms's that is along c (measured at 16 and 40 layers: docs/routing.md,
# section 3). With it gone the backward is linear in dz: dx = P^T W^T dz = (P^T dz) W and dW = (P^T dz)^T x, two
# GEMMs and a scan over T x E, where the rms's part needed two more passes over x and a scan over T x D. Saved: x
# (which the experts keep anyway: the same storage), W and rstd. The ops' names change with their signatures or
# their autograd: torch.compile's caches know a custom op by name, so a cache warmed by earlier ops replays their
# graphs (one called the other's backward op, which no longer exists, on an H200).
def _centred_logits_impl(x_TD: Tensor, weight_ED: Tensor, seq_len: int, ops: str) -> tuple[Tensor, Tensor]:
    return importlib.import_module(ops).prefix_centred_logits(x_TD, weight_ED, seq_len)


def _centred_logits_fake(x_TD, weight_ED, seq_len, ops):
    acc = torch.promote_types(x_TD.dtype, torch.float32)
    return x_TD.new_empty((x_TD.shape[0], weight_ED.shape[0]), dtype=acc), x_TD.new_empty((x_TD.shape[0],), dtype=acc)


def _centred_logits_backward_impl(dlogits_TE: Tensor, x_TD: Tensor, weight_ED: Tensor, rstd_T: Tensor, seq_len: int,
                                  ops: str) -> tuple[Tensor, Tensor]:
    return importlib.import_module(ops).prefix_centred_logits_backward(dlogits_TE, x_TD, weight_ED, rstd_T, seq_len)


def _centred_logits_backward_fake(dlogits_TE, x_TD, weight_ED, rstd_T, seq_len, ops):
    return torch.empty_like(x_TD), torch.empty_like(weight_ED)


# The traced op's backward stays opaque (traced_backward=False): it ends in a GEMM, dx = q W, whose output autograd
# adds to the experts' dx. Traced, inductor fused that add into the GEMM as an addmm, which copies the experts' dx
# into its output first: on an H200 at 30B's shape the GEMM and the copy took 0.33 ms, the GEMM and the add 0.28 ms
# (bench/results/2026-11-26-h200-block_profile-traced-8bab608.json beside ...-block_profile-custom-99ee76a.json).
_centred_logits = DualOp("centred_router_logits_const_scale", _centred_logits_impl, _centred_logits_fake,
                         traced_backward=False)
_centred_logits_backward = DualOp("centred_router_logits_const_scale_backward", _centred_logits_backward_impl,
                                  _centred_logits_backward_fake)


def _setup(ctx, inputs, output):
    x_TD, weight_ED, seq_len, ops = inputs
    ctx.save_for_backward(x_TD, weight_ED, output[1])
    ctx.seq_len, ctx.ops = seq_len, ops
    ctx.mark_non_differentiable(output[1])


def _backward(backward_op, ctx, dlogits_TE, _drstd):
    x_TD, weight_ED, rstd_T = ctx.saved_tensors
    dx_TD, dweight_ED = backward_op(dlogits_TE.contiguous(), x_TD, weight_ED, rstd_T, ctx.seq_len, ctx.ops)
    return dx_TD, dweight_ED, None, None


_centred_logits.register_autograd(_backward, _setup, _centred_logits_backward)


def prefix_centred_logits(x_TD: Tensor, weight_ED: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """(logits_TE, rstd_T): logits = (W c) * rstd with c = prefix_centre(x) (rounded to x's dtype), W c summed
    and everything after it in fp32 or wider: the definition, which the fused backends match."""
    c_TD, mean_square_T = prefix_centre(x_TD, seq_len)
    rstd_T = torch.rsqrt(mean_square_T + EPS)
    acc = rstd_T.dtype
    return F.linear(c_TD.to(acc), weight_ED.to(acc)) * rstd_T.unsqueeze(-1), rstd_T


def prefix_centred_logits_backward(dlogits_TE: Tensor, x_TD: Tensor, weight_ED: Tensor, rstd_T: Tensor,
                                   seq_len: int) -> tuple[Tensor, Tensor]:
    """(dx_TD, dweight_ED) of prefix_centred_logits with rstd held constant: with dz = dlogits * rstd,
    dx = prefix_centre_backward(dz W) and dW = dz^T c."""
    acc = rstd_T.dtype
    dz_TE = dlogits_TE.to(acc) * rstd_T.unsqueeze(-1)
    c_TD = prefix_centre(x_TD, seq_len)[0].to(acc)
    dx_TD = prefix_centre_backward(dz_TE @ weight_ED.to(acc), seq_len)
    return dx_TD.to(x_TD.dtype), (dz_TE.t() @ c_TD).to(weight_ED.dtype)


def _counts(S: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """How many earlier positions each position's mean is over (position 0: 1, its mean is 0 anyway)."""
    return torch.arange(S, device=device, dtype=dtype).clamp_min(1)


def prefix_centre(x_TD: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """c_TD = x_t - mean(x_s, s < t) per sequence of seq_len (c_0 = x_0), in x's dtype (summed in fp32 or
    wider), and mean_square_T = mean over D of c^2 (fp32 or wider) of the rounded c: the definition, which
    the fused backends match."""
    T, D = x_TD.shape
    S = seq_len
    acc = torch.promote_types(x_TD.dtype, torch.float32)  # 4096 bf16 adds would drift
    # positions innermost: a CUDA scan along an outer dim is ~30x slower than along the innermost one
    x_BDS = x_TD.view(T // S, S, D).transpose(1, 2).to(acc, memory_format=torch.contiguous_format)
    earlier_BDS = x_BDS.cumsum(-1) - x_BDS  # the sum over s < t
    c_TD = (x_BDS - earlier_BDS / _counts(S, acc, x_TD.device)).transpose(1, 2).reshape(T, D).to(x_TD.dtype)
    return c_TD, torch.linalg.vector_norm(c_TD, dim=-1, dtype=acc).square() / D


def prefix_centre_backward(dc_TD: Tensor, seq_len: int) -> Tensor:
    """dx of prefix_centre for the gradient dc_TD on c (fp32 or wider): dx_s = g_s - sum_{t>s} g_t / n_t, at any
    width (the definition runs it on T x D; the fused backend computes the same map on T x E, P^T dz, in its own
    Triton kernels)."""
    T, D = dc_TD.shape
    S = seq_len
    acc = torch.promote_types(dc_TD.dtype, torch.float32)
    g_BDS = dc_TD.to(acc).view(T // S, S, D).transpose(1, 2)
    u_BDS = g_BDS / _counts(S, acc, dc_TD.device)
    later_BDS = u_BDS.flip(-1).cumsum(-1).flip(-1) - u_BDS  # the sum over t > s
    return (g_BDS - later_BDS).transpose(1, 2).reshape(T, D).to(dc_TD.dtype)


def build_scores(centring: str) -> nn.Module:
    assert centring in CENTRINGS, centring
    return PrefixCentredScores() if centring == "prefix" else RawScores()


# routing.logit_norm=prefix: how many positions' worth of the prior (mean 0, mean square 1: the logits' scale at
# initialisation, unit-RMS input and weight std dim^-1/2) the earlier positions' statistics start from, so the first
# positions of a sequence, with few earlier ones, are not divided by a noisy spread
PRIOR_POSITIONS = 64
LOGIT_NORMS = ("none", "prefix")


class PrefixStandardisedLogits(nn.Module):
    """routing.logit_norm=prefix: each expert's logit minus its mean over the earlier positions of the sequence,
    over their standard deviation (both with PRIOR_POSITIONS of the prior mixed in). The statistics are constants
    to autograd, as a running normaliser's.

    Why (docs/routing.md, section 3): at the peak learning rate the router's input concentrates its spread in a few
    directions, so an expert whose weight row leans into them has a wider logit distribution than the others and
    wins most tokens' top-K through its upper tail, even with the router's weights frozen at their initial values,
    and the expert bias (a shift, 0.01 a step) cannot narrow it. With each expert's logits at one mean and one spread
    per sequence, top-K picks by how far a token stands out for that expert. It reads only earlier positions of the
    same sequence, so evaluation routes as training does; no state."""

    def forward(self, logits_TE: Tensor, seq_len: int | None = None, ops=None) -> Tensor:
        """ops: the routing backend module whose prefix_standardise[_backward] compute it (None: this module's)."""
        S = _resolve_seq_len(logits_TE.shape[0], seq_len)
        ops = ops or sys.modules[__name__]
        return _standardised(logits_TE, S, ops.__name__, traced=_traced(ops))[0]


def standardise_by_prefix(logits_TE: Tensor, seq_len: int) -> Tensor:
    """The definition of routing.logit_norm=prefix (fp32 or wider): (z_t - mu_t) / sqrt(var_t), per sequence of
    seq_len and expert, mu_t = sum(z_s, s < t) / (t + P), var_t = (sum(z_s^2, s < t) + P) / (t + P) - mu_t^2,
    P = PRIOR_POSITIONS; mu and var carry no gradient."""
    z_BES = _by_position(logits_TE, seq_len)
    with torch.no_grad():
        mean, rstd = _moments(*_earlier_sums(z_BES), torch.arange(z_BES.shape[-1], device=z_BES.device))
    return ((z_BES - mean) * rstd).transpose(1, 2).reshape(logits_TE.shape)


def _earlier_sums(z_BES: Tensor) -> tuple[Tensor, Tensor]:
    """The sums of z and of z^2 over the positions before each one (positions last)."""
    zz_BES = z_BES * z_BES
    return z_BES.cumsum(-1) - z_BES, zz_BES.cumsum(-1) - zz_BES


def _by_position(logits_TE: Tensor, S: int) -> Tensor:
    """(B, E, S) in fp32 or wider: positions innermost, where a scan is fast."""
    T, E = logits_TE.shape
    acc = torch.promote_types(logits_TE.dtype, torch.float32)
    return logits_TE.to(acc).view(T // S, S, E).transpose(1, 2)


def _moments(earlier: Tensor, earlier_sq: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """(mu, rstd) at positions s from the sums of z and z^2 over the earlier positions (positions last)."""
    n = s.to(earlier.dtype) + PRIOR_POSITIONS
    mean = earlier / n
    return mean, torch.rsqrt(((earlier_sq + PRIOR_POSITIONS) / n - mean * mean).clamp_min(1e-4))


# routing.logit_norm=prefix as one op with its own backward op, run by the routing backend's
# prefix_standardise[_backward]. Autograd through plain ops keeps the scale rstd, one more T x E fp32 tensor per
# layer beside the standardised logits y that the selection keeps for its own backward. The op keeps y instead (the
# same storage as the selection's) and the sums of z and z^2 over the positions before every STAT_CHUNK-th one
# (E / STAT_CHUNK values per token); its backward recovers z and so rstd from them, one position at a time:
# z_t = y_t / rstd_t + mu_t, where mu_t and rstd_t need only the positions before t. In fp32 the recovered scale is
# the forward's to a few ulps: the recurrence divides each error by the position count, so it does not grow.
STAT_CHUNK = 64


def _standardised_impl(logits_TE: Tensor, seq_len: int, ops: str) -> tuple[Tensor, Tensor]:
    return importlib.import_module(ops).prefix_standardise(logits_TE, seq_len)


def _standardised_fake(logits_TE, seq_len, ops):
    acc = torch.promote_types(logits_TE.dtype, torch.float32)
    T, E = logits_TE.shape
    chunks = -(-seq_len // STAT_CHUNK)
    return logits_TE.new_empty((T, E), dtype=acc), logits_TE.new_empty((T // seq_len, chunks, 2, E), dtype=acc)


def _standardised_backward_impl(dy_TE: Tensor, y_TE: Tensor, stats: Tensor, seq_len: int, ops: str) -> Tensor:
    return importlib.import_module(ops).prefix_standardise_backward(dy_TE, y_TE, stats, seq_len)


def _standardised_backward_fake(dy_TE, y_TE, stats, seq_len, ops):
    return torch.empty_like(y_TE)


_standardised = DualOp("prefix_standardised_logits", _standardised_impl, _standardised_fake)
_standardised_backward = DualOp("prefix_standardised_logits_backward", _standardised_backward_impl,
                                _standardised_backward_fake)


def _setup_standardised(ctx, inputs, output):
    logits_TE, seq_len, ops = inputs
    ctx.save_for_backward(*output)
    ctx.seq_len, ctx.ops, ctx.dtype = seq_len, ops, logits_TE.dtype
    ctx.mark_non_differentiable(output[1])


def _backward_standardised(backward_op, ctx, dy_TE, _dstats):
    y_TE, stats = ctx.saved_tensors
    dz_TE = backward_op(dy_TE.contiguous(), y_TE, stats, ctx.seq_len, ctx.ops)
    return dz_TE.to(ctx.dtype), None, None


_standardised.register_autograd(_backward_standardised, _setup_standardised, _standardised_backward)


def prefix_standardise(logits_TE: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """(y_TE, stats): y = standardise_by_prefix(logits), the definition, and stats (B, chunks, 2, E), the sums of z
    and of z^2 over the positions before each chunk of STAT_CHUNK (fp32 or wider, as y)."""
    z_BES = _by_position(logits_TE, seq_len)
    earlier = torch.stack(_earlier_sums(z_BES), dim=1)
    stats = earlier[..., ::STAT_CHUNK].permute(0, 3, 1, 2).contiguous()  # (B, 2, E, chunks) -> (B, chunks, 2, E)
    mean, rstd = _moments(earlier[:, 0], earlier[:, 1], torch.arange(seq_len, device=logits_TE.device))
    return ((z_BES - mean) * rstd).transpose(1, 2).reshape(logits_TE.shape), stats


def prefix_standardise_backward(dy_TE: Tensor, y_TE: Tensor, stats: Tensor, seq_len: int) -> Tensor:
    """dz = dy * rstd, with rstd recovered from y and stats (see STAT_CHUNK): every chunk at once, one position of
    each per step."""
    T, E = y_TE.shape
    S, L = seq_len, STAT_CHUNK
    if T == 0:
        return torch.empty_like(y_TE)
    B, C = stats.shape[:2]

    def chunked(t_TE: Tensor) -> Tensor:  # (B, C, L, E), the last chunk padded with zeros
        t_BSE = t_TE.to(stats.dtype).view(B, S, E)
        return F.pad(t_BSE, (0, 0, 0, C * L - S)).view(B, C, L, E)

    y, dy = chunked(y_TE), chunked(dy_TE)
    earlier, earlier_sq = stats[:, :, 0].clone(), stats[:, :, 1].clone()
    dz = torch.empty_like(y)
    first = torch.arange(C, device=y.device)[:, None] * L  # (C, 1): each chunk's first position
    for j in range(L):
        mean, rstd = _moments(earlier, earlier_sq, first + j)
        dz[:, :, j] = dy[:, :, j] * rstd
        z = y[:, :, j] / rstd + mean
        earlier += z
        earlier_sq += z * z
    return dz.view(B, C * L, E)[:, :S].reshape(T, E).to(y_TE.dtype)


def build_logit_norm(norm: str) -> nn.Module:
    assert norm in LOGIT_NORMS, norm
    return PrefixStandardisedLogits() if norm == "prefix" else _Unnormalised()


class _Unnormalised(nn.Module):
    """routing.logit_norm=none."""

    def forward(self, logits_TE: Tensor, seq_len: int | None = None, ops=None) -> Tensor:
        return logits_TE
