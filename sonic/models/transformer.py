"""Decoder-only MoE transformer (OLMoE / Qwen3 style): pre-norm, RoPE, attention, MoE FFN.

The attention core (sonic/models/attention.py) and the LM head + loss (sonic/models/loss.py) are
backends chosen by the model config, like the expert kernels.

Legend: B batch, S sequence, D hidden, V vocab, T = B*S tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from sonic import compat
from sonic.models.attention import AttentionCore, build_attention_core
from sonic.models.config import ModelConfig
from sonic.models.layers import Attention, RMSNorm, Rotary, SwiGLUMLP, compute_dtype
from sonic.models.loss import get_loss_fn
from sonic.models.moe import MoE
from sonic.routing import RouterOutput


@dataclass
class ModelOutput:
    logits_BSV: Tensor | None  # None when labels were given: the loss backend never builds them
    loss: Tensor | None  # mean LM cross-entropy over the labelled tokens, when labels were given
    router_loss: Tensor  # weighted aux + z losses summed over MoE layers (add to the LM loss)
    routed: list[RouterOutput]  # per MoE layer, for load statistics and the expert bias


compat.register_pytree_dataclass(ModelOutput)  # so FSDP, compile and autograd see the tensors inside

class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, attn_core: AttentionCore):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg.dim, cfg.num_heads, cfg.kv_heads, cfg.head_size, cfg.qk_norm, cfg.norm_eps,
                              attn_core)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = layer >= cfg.first_k_dense
        self.ffn = MoE(cfg.dim, cfg.moe) if self.is_moe else SwiGLUMLP(cfg.dim, cfg.dense_dim)

    def forward(self, x_BSD: Tensor, rotary: Rotary, mask):
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), rotary, mask)
        h = self.ffn_norm(x_BSD)
        if self.is_moe:
            out, routed = self.ffn(h)
            return x_BSD + out, routed
        return x_BSD + self.ffn(h), None


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.attn_core = build_attention_core(cfg.attention_backend, cfg.head_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rotary = Rotary(cfg.head_size, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg, i, self.attn_core) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids_BS: Tensor, doc_ids_BS: Tensor | None = None,
                labels_BS: Tensor | None = None) -> ModelOutput:
        """Logits, or with labels (-100 = no target) the mean LM loss and no logits."""
        B, S = input_ids_BS.shape
        mask = self.attn_core.mask(doc_ids_BS, S, input_ids_BS.device)
        x = self.embed(input_ids_BS)
        routed: list[RouterOutput] = []
        for layer in self.layers:
            x, r = layer(x, self.rotary, mask)
            if r is not None:
                routed.append(r)
        x = self.norm(x)
        head_VD = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        router_loss = sum((r.loss for r in routed), start=x.new_zeros((), dtype=torch.float32))
        if labels_BS is None:
            logits = x @ head_VD.to(x.dtype).T if self.lm_head is None else self.lm_head(x)
            return ModelOutput(logits, None, router_loss, routed)
        dt = compute_dtype(x)  # as autocast would cast the head's matmul
        loss = get_loss_fn(self.cfg.loss_backend, x.device)(x.reshape(B * S, -1).to(dt), head_VD.to(dt),
                                                            labels_BS.reshape(B * S))
        return ModelOutput(None, loss, router_loss, routed)

    def embed(self, input_ids_BS: Tensor) -> Tensor:
        """The first block's input: the embedding times model.embed_scale (the tied head reads the table as is)."""
        x = self.embed_tokens(input_ids_BS)
        return x if self.cfg.embed_scale == 1.0 else x * self.cfg.embed_scale

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std), the FFN down projections scaled by 1/sqrt(2L) (GPT-2) unless
        model.ffn_out_init=unscaled (OLMo 2: init_std), norms 1, biases 0; the attention output
        projection starts at zero unless model.attn_out_init=scaled.

        Why unscaled can matter: scaled, sonic_7b's residual stream is RMS 0.03 after block 0 and 0.16
        after block 40, so at peak LR one AdamW step on an early output projection moves it by more
        than its size (docs/routing.md, "Gradient spikes").

        Why zero: at initialisation attention averages its values over the causal prefix, so
        every layer adds nearly the same vector to every position. Over 40 layers that common
        vector swamps the token signal, the routers' inputs become parallel and every token
        picks the same K experts (sonic_7b on BPE text: router inputs at cosine 0.7 to their mean,
        worst layer max/mean 15.2 of a possible E/K = 16; with a zero o_proj 0.09 and 2.5;
        docs/routing.md). The residual stream then starts as the embedding plus token-wise FFN outputs.

        Buffers: the rotary tables are computed, the router's running state starts at zero.

        Works before or after sharding (sonic/parallel/init.py: meta -> shard -> init): every
        rank draws the same full tensor per parameter from `seed`, in the same order, and keeps
        its own shard, so any world size starts from bit-identical weights.
        """
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.num_layers)
        attn_out_std = 0.0 if self.cfg.attn_out_init == "zero" else out_std
        ffn_out_std = out_std if self.cfg.ffn_out_init == "scaled" else std
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 1 or name.endswith(("b1_EF", "b2_ED")):
                p.fill_(1.0 if "norm" in name else 0.0)
                continue
            s = ffn_out_std if name.endswith(("down_proj.weight", "w2_EDN")) else std
            s = attn_out_std if name.endswith("o_proj.weight") else s
            # drawn even where s is 0, so every other parameter gets the same values either way
            p.copy_(_local_part(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(s), p))
        for b in self.buffers():  # after to_empty they hold garbage
            b.zero_()
        self.rotary.reset_buffers()


def _local_part(full: Tensor, like: Tensor) -> Tensor:
    """`full` as `like` stores it: this rank's shard when `like` is a DTensor (every rank drew
    the same `full`, so each slices its own part and no communication is needed)."""
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full
