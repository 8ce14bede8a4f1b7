"""Attention cores: o = softmax(q k^T / sqrt(Hd) + mask) v, causal, optionally blocked across
the documents of a packed row.

One core serves every layer of a model (`model.attention_backend`). The model builds the mask
once per forward with `core.mask(doc_ids_BS, S, device)` and each layer calls `core(q, k, v, mask)`.

| name | causal                                | document-masked                                   |
|------|---------------------------------------|---------------------------------------------------|
| sdpa | SDPA is_causal (cuDNN's kernel on H100)| SDPA with a dense B x S x S bool mask (reference) |
| flex | FlexAttention, causal BlockMask       | FlexAttention, document BlockMask: no dense mask  |
| auto | sdpa                                  | flex on CUDA, sdpa elsewhere                      |

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
])


class AttentionCore(Protocol):
    """What every registered core is: one mask per forward, then one call per layer."""

    name: str

    def mask(self, doc_ids_BS: Tensor | None, S: int, device: torch.device) -> Any: ...

    def __call__(self, q_BHSd: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, mask: Any) -> Tensor: ...


def document_causal_mask(doc_ids_BS: Tensor) -> Tensor:
    """Dense causal mask that also blocks attention across packed documents (True = attend)."""
    S = doc_ids_BS.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=doc_ids_BS.device).tril()
    return causal & (doc_ids_BS[:, :, None] == doc_ids_BS[:, None, :])


class SDPACore:
    name = "sdpa"

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

    def __init__(self):
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


class AutoCore:
    """sdpa's fused kernel for plain causal attention; flex where documents are masked on a GPU."""

    name = "auto"

    def __init__(self):
        self.sdpa, self.flex = SDPACore(), FlexCore()

    def _pick(self, documents: bool, device: torch.device):
        return self.flex if documents and device.type == "cuda" else self.sdpa

    def mask(self, doc_ids_BS: Tensor | None, S: int, device: torch.device):
        core = self._pick(doc_ids_BS is not None, device)
        return core, core.mask(doc_ids_BS, S, device)

    def __call__(self, q_BHSd: Tensor, k_BGSd: Tensor, v_BGSd: Tensor, mask) -> Tensor:
        core, inner = mask
        return core(q_BHSd, k_BGSd, v_BGSd, inner)


def build_attention_core(name: str) -> AttentionCore:
    return ATTENTION_BACKENDS.load(name)()
