"""Attention cores: o = softmax(q k^T / sqrt(Hd) + mask) v, causal, optionally blocked across
the documents of a packed row.

One core serves every layer of a model (`model.attention_backend`). The model builds the mask
once per forward with `core.mask(doc_ids_BS, S, device)` and each layer calls `core(q, k, v, mask)`.

| name | causal                                | document-masked                                   |
|------|---------------------------------------|---------------------------------------------------|
| sdpa | SDPA is_causal (cuDNN's kernel on H100)| SDPA with a dense B x S x S bool mask (reference) |
| flex | FlexAttention, causal BlockMask       | FlexAttention, document BlockMask: no dense mask  |
| fa4  | FlashAttention-4 (sonic/kernels/fa4.py)| refused: use auto or flex                         |
| auto | fa4 where it can run, else sdpa       | flex on CUDA, sdpa elsewhere                      |

fa4 runs where `sonic.kernels.fa4.unavailable_reason` is None: Hopper or datacenter Blackwell, head size 64 or 128,
the flash-attn-4 package installed (Sonic's `fa4` extra). At sonic_7b's attention it is faster than cuDNN's
kernel through SDPA, alone and in the training step (docs/performance.md has the measurements).

The cores are one Registry (sonic/registry.py), ATTENTION_BACKENDS: a name maps to a core class
that implements AttentionCore.

Legend: B batch, H query heads, G kv heads, S sequence, Hd head dim.
"""
from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from sonic.registry import Entry, Registry

ATTENTION_BACKENDS = Registry("model.attention_backend", [
    Entry("auto", "sonic.models.attention:AutoCore"),
    Entry("sdpa", "sonic.models.attention:SDPACore"),
    Entry("flex", "sonic.models.attention:FlexCore"),
    Entry("fa4", "sonic.models.attention:FA4Core"),
])


class AttentionCore(Protocol):
    """What every registered core is: built with the model's head size, one mask per forward, then one call per
    layer."""

    name: str
    head_dim: int

    def mask(self, doc_ids_BS: Tensor | None, S: int, device: torch.device) -> Any: ...

    def __call__(self, q_BHSd: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, mask: Any) -> Tensor: ...


def document_causal_mask(doc_ids_BS: Tensor) -> Tensor:
    """Dense causal mask that also blocks attention across packed documents (True = attend)."""
    S = doc_ids_BS.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=doc_ids_BS.device).tril()
    return causal & (doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :])


class SDPACore:
    name = "sdpa"

    def __init__(self, head_dim: int):  # every core is built with the model's head size; fa4's depends on it
        self.head_dim = head_dim

    def mask(self, doc_ids_BS: Tensor | None, S: int, device: torch.device) -> Tensor | None:
        return None if doc_ids_BS is None else document_causal_mask(doc_ids_BS)[:, None]

    def __call__(self, q_BHSd: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, mask: Tensor | None) -> Tensor:
        gqa = k_BGSd.shape[1] != q_BHSd.shape[1]
        if mask is None:
            return F.scaled_dot_product_attention(q_BHSd, k_BGSd, v_BGSd, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q_BHSd, k_BGSd, v_BGSd, attn_mask=mask, enable_gqa=gqa)


@functools.cache
def _compiled_flex():
    # FlexAttention is only fast compiled (eager runs a dense reference); one compiled
    # function per process, the way torchtitan holds it.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class FlexCore:
    """FlexAttention with block-sparse masks: fully masked tiles are skipped, no S x S tensor exists."""

    name = "flex"

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self._causal: dict[tuple[int, torch.device], object] = {}  # the causal BlockMask per (S, device)

    def mask(self, doc_ids_BS: Tensor | None, S: int, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        # _compile builds the mask with a compiled kernel on GPUs (what bench.levers measured on
        # torch 2.11; newer torch prefers torch.compile(create_block_mask))
        compile_mask = device.type == "cuda"
        if doc_ids_BS is None:
            key = (S, device)
            if key not in self._causal:
                self._causal[key] = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S,
                                                      device=device, _compile=compile_mask)
            return self._causal[key]

        def document_causal(b, h, q, kv):
            return (q >= kv) & (doc_ids_BS[b, q] == doc_ids_BS[b, kv])

        return create_block_mask(document_causal, doc_ids_BS.shape[0], None, S, S, device=device,
                                 _compile=compile_mask)

    def __call__(self, q_BHSd: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, block_mask) -> Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        if not q_BHSd.is_cuda and torch.is_grad_enabled() and q_BHSd.requires_grad:
            raise ValueError("model.attention_backend=flex cannot train on CPU (FlexAttention has no CPU "
                             "backward in this torch); use attention_backend=auto or sdpa there")
        gqa = k_BGSd.shape[1] != q_BHSd.shape[1]
        fn = _compiled_flex() if q_BHSd.is_cuda else flex_attention
        return fn(q_BHSd, k_BGSd, v_BGSd, block_mask=block_mask, enable_gqa=gqa)


class FA4Core:
    """FlashAttention-4's kernels for causal attention (sonic/kernels/fa4.py): one custom op forward, one backward."""

    name = "fa4"

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    def mask(self, doc_ids_BS: Tensor | None, S: int, device: torch.device) -> None:
        from sonic.kernels.fa4 import unavailable_reason

        if doc_ids_BS is not None:
            raise ValueError("model.attention_backend=fa4 runs plain causal attention only; with "
                             "train.document_masking=true use attention_backend=auto or flex")
        reason = unavailable_reason(device, self.head_dim)
        if reason is not None:
            raise ValueError(f"model.attention_backend=fa4 cannot run here: {reason}; use attention_backend=auto "
                             f"(it falls back to sdpa) or sdpa")
        return None

    def __call__(self, q_BHSd: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, mask: None) -> Tensor:
        from sonic.kernels.fa4 import causal_attention

        # the kernels read (B, S, H, Hd): the projections' own layout, so these transposes are views
        o_BSHd = causal_attention(q_BHSd.transpose(1, 2), k_BGSd.transpose(1, 2), v_BGSd.transpose(1, 2))
        return o_BSHd.transpose(1, 2)


class AutoCore:
    """FlashAttention-4 for plain causal attention where it can run, else sdpa's fused kernel; flex where documents
    are masked on a GPU."""

    name = "auto"

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.sdpa, self.flex, self.fa4 = SDPACore(head_dim), FlexCore(head_dim), FA4Core(head_dim)

    def _pick(self, documents: bool, device: torch.device):
        from sonic.kernels.fa4 import unavailable_reason

        if documents:
            return self.flex if device.type == "cuda" else self.sdpa
        return self.fa4 if unavailable_reason(device, self.head_dim) is None else self.sdpa

    def mask(self, doc_ids_BS: Tensor | None, S: int, device: torch.device):
        core = self._pick(doc_ids_BS is not None, device)
        return core, core.mask(doc_ids_BS, S, device)

    def __call__(self, q_BHSd: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, mask) -> Tensor:
        core, inner = mask
        return core(q_BHSd, k_BGSd, v_BGSd, inner)


def build_attention_core(name: str, head_dim: int) -> AttentionCore:
    return ATTENTION_BACKENDS.load(name)(head_dim)
