"""Parameter counts from a config alone (no weights), for presets and MFU."""
from __future__ import annotations

from dataclasses import dataclass

from sonic.models.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter
    active: int  # parameters used per token (K of E routed experts)
    embedding: int  # input embedding table (a lookup, not a matmul)

    @property
    def active_matmul(self) -> int:
        """Active parameters that take part in matmuls: the 6N of the FLOPs count."""
        return self.active - self.embedding


def param_counts(cfg: ModelConfig) -> ParamCounts:
    D, L, V, hd = cfg.dim, cfg.num_layers, cfg.vocab_size, cfg.head_size
    H, G = cfg.num_heads, cfg.kv_heads
    attn = 2 * D * H * hd + 2 * D * G * hd
    attn += {"none": 0, "full": (H + G) * hd, "head": 2 * hd}[cfg.qk_norm]
    norms = 2 * D
    m = cfg.moe
    E, K, N = m.num_experts, m.top_k, m.expert_dim
    expert = 3 * D * N + ((2 * N + D) if m.expert_bias else 0)
    shared = 3 * D * m.shared_expert_dim
    moe_total = E * D + E * expert + shared
    moe_active = E * D + K * expert + shared
    dense = 3 * D * cfg.dense_dim
    n_dense, n_moe = cfg.first_k_dense, L - cfg.first_k_dense
    body_total = L * (attn + norms) + n_dense * dense + n_moe * moe_total
    body_active = L * (attn + norms) + n_dense * dense + n_moe * moe_active
    embed = V * D
    head = 0 if cfg.tie_embeddings else V * D
    return ParamCounts(total=body_total + embed + head + D, active=body_active + embed + head + D,
                       embedding=embed if not cfg.tie_embeddings else 0)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * active matmul params + attention (PaLM's 12*L*H*Hd*S)."""
    return 6 * param_counts(cfg).active_matmul + 12 * cfg.num_layers * cfg.num_heads * cfg.head_size * seq_len
