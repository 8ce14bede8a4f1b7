"""Model configuration dataclasses (Hydra structured configs; presets in configs/model/)."""
from __future__ import annotations

from dataclasses import dataclass, field

from sonic.kernels import BACKENDS
from sonic.models.attention import ATTENTION_BACKENDS
from sonic.models.loss import LOSS_BACKENDS
from sonic.routing.config import RoutingConfig

QK_NORMS = ("none", "full", "head")  # full: OLMoE, over all heads at once; head: Qwen3, per head
ATTN_OUT_INITS = ("zero", "scaled")  # attention o_proj at init: zero, or GPT-2's init_std / sqrt(2L)
FFN_OUT_INITS = ("scaled", "unscaled")  # FFN down projections at init: GPT-2's init_std / sqrt(2L), or init_std


@dataclass
class MoEConfig:
    num_experts: int = 8  # E
    top_k: int = 2  # K
    expert_dim: int = 128  # n, each expert's intermediate width
    shared_expert_dim: int = 0  # width of an always-on shared SwiGLU expert; 0 = none
    expert_bias: bool = False  # biases b1/b2 inside the routed experts
    kernel_backend: str = "auto"  # auto | reference | triton | cute | naive | grouped_mm
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def __post_init__(self):
        if self.num_experts < 1 or self.expert_dim < 1:
            raise ValueError(f"moe.num_experts={self.num_experts} and moe.expert_dim={self.expert_dim} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} must be between 1 and moe.num_experts={self.num_experts}")
        if self.shared_expert_dim < 0:
            raise ValueError(f"moe.shared_expert_dim={self.shared_expert_dim} must be >= 0 (0 disables it)")
        BACKENDS.check(self.kernel_backend, ("auto",))


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 384
    dim: int = 128  # d
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # grouped-query attention; None = num_heads
    head_dim: int | None = None  # None = dim // num_heads
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    qk_norm: str = "none"  # none | full (OLMoE) | head (Qwen3)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    first_k_dense: int = 0  # the first k layers use a dense SwiGLU FFN instead of MoE
    dense_dim: int = 0  # FFN width of those dense layers
    init_std: float = 0.02
    attn_out_init: str = "zero"  # zero keeps deep routers healthy at init (Transformer.init_weights) | scaled
    ffn_out_init: str = "scaled"  # scaled | unscaled: the FFN down projections' init std (Transformer.init_weights)
    embed_scale: float = 1.0  # the embedding's output times this before the first block (the tied head reads it x1)
    attention_backend: str = "auto"  # auto | sdpa | flex (sonic/models/attention.py)
    loss_backend: str = "chunked"  # torch | chunked | liger | cce: LM head + cross-entropy (sonic/models/loss.py)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self):
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.head_dim is None and self.dim % self.num_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.num_heads={self.num_heads}; "
                             f"change one of them or set model.head_dim explicitly")
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of "
                             f"model.num_kv_heads={self.num_kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"head dimension {self.head_size} must be even for RoPE")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"model.qk_norm={self.qk_norm!r} is not one of {', '.join(QK_NORMS)}")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"model.first_k_dense={self.first_k_dense} must be in [0, num_layers={self.num_layers}]")
        if self.first_k_dense and self.dense_dim < 1:
            raise ValueError(f"model.first_k_dense={self.first_k_dense} needs model.dense_dim >= 1")
        if self.attn_out_init not in ATTN_OUT_INITS:
            raise ValueError(f"model.attn_out_init={self.attn_out_init!r} is not one of {', '.join(ATTN_OUT_INITS)}")
        if self.ffn_out_init not in FFN_OUT_INITS:
            raise ValueError(f"model.ffn_out_init={self.ffn_out_init!r} is not one of {', '.join(FFN_OUT_INITS)}")
        ATTENTION_BACKENDS.check(self.attention_backend)
        LOSS_BACKENDS.check(self.loss_backend)
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0 or self.embed_scale <= 0:
            raise ValueError("model.rope_theta, model.norm_eps, model.init_std and model.embed_scale must be > 0")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_size(self) -> int:
        return self.dim // self.num_heads if self.head_dim is None else self.head_dim
