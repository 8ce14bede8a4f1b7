"""A tiny byte-level Sonic checkpoint in the trainer's real layout (DCP + config.yaml + meta.json)."""
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.train.checkpoint import Checkpointer
from sonic.train.config import Config, TrainConfig, to_yaml


def tiny_config(max_seq_len: int = 128) -> ModelConfig:
    return ModelConfig(name="eval_tiny", vocab_size=260, dim=32, num_layers=2, num_heads=4, max_seq_len=max_seq_len,
                       qk_norm="full", tie_embeddings=True,
                       moe=MoEConfig(num_experts=4, top_k=2, expert_dim=32, kernel_backend="reference"))


def tiny_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed)
    with torch.no_grad():  # a sharper random model than the 0.02 init, so scores differ visibly
        model.embed_tokens.weight.normal_(0, 1, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def save_checkpoint(model: Transformer, run_dir: Path, step: int = 7) -> Path:
    cfg = Config(model=model.cfg, train=TrainConfig(seq_len=min(64, model.cfg.max_seq_len)))
    optimizer = torch.optim.AdamW(model.parameters())
    return Checkpointer(run_dir / "checkpoints", keep_last=2).save(step, model, optimizer, {}, to_yaml(cfg))


@dataclass
class TinyCheckpoint:
    model: Transformer
    path: Path  # the step directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> TinyCheckpoint:
    model = tiny_model(tiny_config())
    return TinyCheckpoint(model, save_checkpoint(model, tmp_path_factory.mktemp("run")))
