"""Config composition for tests, through the same Hydra path as train.py."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from sonic.train.config import Config, register_schema, to_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def compose_config(*overrides: str) -> Config:
    register_schema()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return to_config(compose(config_name="config", overrides=list(overrides)))
