"""Decoder-only MoE transformer (OLMoE / Qwen3 style): pre-norm, RoPE, SDPA, MoE FFN.

Legend: B batch, S sequence, D hidden, V vocab.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.utils._pytree
from torch import Tensor, nn

from sonic.models.config import ModelConfig
from sonic.models.layers import Attention, RMSNorm, Rotary, SwiGLUMLP, document_causal_mask
from sonic.models.moe import MoE
from sonic.routing import RouterOutput


@dataclass
class ModelOutput:
    logits_BSV: Tensor
    router_loss: Tensor  # weighted aux + z losses summed over MoE layers (add to the LM loss)
    routed: list[RouterOutput]  # per MoE layer, for load statistics and the expert bias


# A pytree, so FSDP, compile and autograd utilities see the tensors inside.
torch.utils._pytree.register_dataclass(ModelOutput)

class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg.dim, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.qk_norm, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = layer >= cfg.first_k_dense
        self.ffn = MoE(cfg.dim, cfg.moe) if self.is_moe else SwiGLUMLP(cfg.dim, cfg.dense_dim)

    def forward(self, x_BSD: Tensor, rotary: Rotary, mask_BSS: Tensor | None):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), rotary, mask_BSS)
        h = self.ffn_norm(x_BSD)
        if self.is_moe:
            out, routed = self.ffn(h)
            return x_BSD + out, routed
        return x_BSD + self.ffn(h), None


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rotary = Rotary(cfg.head_size, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids_BS: Tensor, doc_ids_BS: Tensor | None = None) -> ModelOutput:
        mask_BSS = None if doc_ids_BS is None else document_causal_mask(doc_ids_BS)
        x = self.embed_tokens(input_ids_BS)
        routed: list[RouterOutput] = []
        for layer in self.layers:
            x, r = layer(x, self.rotary, mask_BSS)
            if r is not None:
                routed.append(r)
        x = self.norm(x)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = x @ head.to(x.dtype).T if self.lm_head is None else self.lm_head(x)
        router_loss = sum((r.loss for r in routed), start=x.new_zeros((), dtype=torch.float32))
        return ModelOutput(logits, router_loss, routed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std), residual outputs scaled by 1/sqrt(2L) (GPT-2), norms 1, biases 0.

        Call before sharding: every rank draws the same full tensors from `seed` on the
        parameters' device, so any world size starts from identical weights.
        """
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.num_layers)
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 1 or name.endswith(("b1_EF", "b2_ED")):
                p.fill_(1.0 if "norm" in name else 0.0)
                continue
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "w2_EDN")) else std
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(s))
        self.rotary.reset_buffers()
