"""Causal attention by FlashAttention-4's CuTe DSL kernels (`flash-attn-4`, Dao-AILab), as two custom ops.

`model.attention_backend=fa4` (sonic/models/attention.py) calls `causal_attention`; `auto` takes it on Hopper
and Blackwell when the package is installed (Sonic's `fa4` extra), because at sonic_7b's attention it beat
cuDNN's kernel through SDPA, alone (`python -m bench.attention`) and in the 40-layer training step: the figures are
in docs/performance.md, from bench/results/2026-11-29-h200-attention.json and ...-1xh200-e2e-40L-fa4*.json.

The library's own autograd Function is opaque to torch.compile, so the forward and the backward are each one
`torch.library.custom_op` here, with fake implementations and `register_autograd`: a compiled block keeps
attention in its graph. Tensors are (B, S, H, Hd), the layout the kernels read; the forward also returns the
row log-sum-exp (B, H, S) fp32 that the backward needs. flash_attn is imported inside the ops, so this module
imports anywhere; `unavailable_reason` says why it cannot run on a device.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings

import torch
from torch import Tensor

HEAD_DIMS = (64, 128)  # the head sizes measured and tested here (the kernels' own set is wider)
INSTALL = "pip install 'flash-attn-4==4.0.0b36' (Sonic's 'fa4' extra)"


@functools.cache
def package_problem() -> str | None:
    """Why the flash-attn-4 package cannot be used here (None when it imports): absent, or installed but broken.

    Imported, not only looked up: an install whose CuTe DSL or quack-kernels it cannot use must send `auto` to
    sdpa with the reason, not fail the first training step. Cached: a process imports a package once."""
    try:
        found = importlib.util.find_spec("flash_attn") is not None and \
            importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"the flash-attn-4 package is not installed: {INSTALL}"
    try:
        importlib.import_module("flash_attn.cute.interface")
    except Exception as err:  # any failure of a third-party import is a broken install, whatever it raises
        reason = f"flash-attn-4 is installed but does not import ({type(err).__name__}: {err}); reinstall it: {INSTALL}"
        warnings.warn(reason)  # said once (cached): auto then runs sdpa, which a user of fa4 would not guess
        return reason
    return None


def unavailable_reason(device: torch.device, head_dim: int) -> str | None:
    """Why FA4 cannot run here (None when it can): no CUDA, a GPU before Hopper, a head size, or the package."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU (got {device.type})"
    if head_dim not in HEAD_DIMS:
        return f"head size {head_dim} is not one of {HEAD_DIMS}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"its kernels need Hopper or datacenter Blackwell (sm90, sm100); this GPU is sm{major}{minor}"
    return package_problem()


@torch.library.custom_op("sonic::fa4_causal_attention", mutates_args=())
def _forward(q_BSHd: Tensor, k_BSGd: Tensor, v_BSGd: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(q_BSHd, k_BSGd, v_BSGd, softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


@_forward.register_fake
def _(q_BSHd, k_BSGd, v_BSGd, scale):
    B, S, H, _ = q_BSHd.shape
    return q_BSHd.new_empty(B, S, H, v_BSGd.shape[-1]), q_BSHd.new_empty(B, H, S, dtype=torch.float32)


@torch.library.custom_op("sonic::fa4_causal_attention_backward", mutates_args=())
def _backward(dout_BSHd: Tensor, q_BSHd: Tensor, k_BSGd: Tensor, v_BSGd: Tensor, out_BSHd: Tensor, lse_BHS: Tensor,
              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q_BSHd, k_BSGd, v_BSGd, out_BSHd, dout_BSHd, lse_BHS, scale, True)
    return dq, dk, dv


@_backward.register_fake
def _(dout_BSHd, q_BSHd, k_BSGd, v_BSGd, out_BSHd, lse_BHS, scale):
    return torch.empty_like(q_BSHd), torch.empty_like(k_BSGd), torch.empty_like(v_BSGd)


def _setup_context(ctx, inputs, output):
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _autograd_backward(ctx, dout, _dlse):  # the log-sum-exp never leaves causal_attention: no gradient flows into it
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def causal_attention(q_BSHd: Tensor, k_BSGd: Tensor, v_BSGd: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(Hd), causal) v with G kv heads shared by H / G query heads each, (B, S, H, Hd)."""
    return _forward(q_BSHd, k_BSGd, v_BSGd, q_BSHd.shape[-1] ** -0.5)[0]
