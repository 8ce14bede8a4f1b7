"""Models: config dataclasses, the decoder, parameter counts. Presets live in configs/model/."""
from sonic.models.config import ModelConfig, MoEConfig
from sonic.models.params import ParamCounts, flops_per_token, param_counts
from sonic.models.transformer import ModelOutput, Transformer

__all__ = ["ModelConfig", "MoEConfig", "ModelOutput", "ParamCounts", "Transformer", "flops_per_token",
           "param_counts"]
