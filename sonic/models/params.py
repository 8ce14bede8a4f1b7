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


@dataclass(frozen=True)
class TrainingFlops:
    """Training FLOPs per token (forward + backward), split so MFU can count attention either way.

    matmul: 6 x active matmul parameters (2 forward + 4 backward per weight and token; Kaplan's 6N).
    attention: QK^T and PV over the whole S x S score matrix, 4*S*H*hd per layer forward, x3 with the
    backward: 12*L*H*hd*S (PaLM's count). A causal mask computes only the lower triangle, so the work
    actually needed is half of it; `causal` counts that (as the paper and torchtitan's fixed
    accounting do), `full` the PaLM figure. docs/performance.md works both out for sonic_7b.
    """

    matmul: float
    attention: float

    @property
    def causal(self) -> float:
        return self.matmul + self.attention / 2

    @property
    def full(self) -> float:
        return self.matmul + self.attention


def training_flops(cfg: ModelConfig, seq_len: int) -> TrainingFlops:
    """Training FLOPs per token of `cfg` at sequence length `seq_len` (see TrainingFlops)."""
    return TrainingFlops(matmul=6 * param_counts(cfg).active_matmul,
                         attention=12 * cfg.num_layers * cfg.num_heads * cfg.head_size * seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False) -> float:
    """Training FLOPs per token: 6 * active matmul params + attention, the full S x S attention
    (PaLM's 12*L*H*Hd*S, the `mfu` metric) or its causal half (`mfu_causal`, the headline)."""
    flops = training_flops(cfg, seq_len)
    return flops.causal if causal else flops.full
