"""Models: config dataclasses, the decoder, parameter counts. Presets live in configs/model/."""
from sonic.models.config import ModelConfig, MoEConfig
from sonic.models.params import ParamCounts, TrainingFlops, flops_per_token, param_counts, training_flops
from sonic.models.transformer import ModelOutput, Transformer

__all__ = ["ModelConfig", "MoEConfig", "ModelOutput", "ParamCounts", "TrainingFlops", "Transformer",
           "flops_per_token", "param_counts", "training_flops"]
