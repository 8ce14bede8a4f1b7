"""Named model flavours: the Hydra group configs/model/*.yaml, readable without Hydra.

`python -m sonic.models.presets` prints each preset's total and active parameters.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from sonic.models.config import ModelConfig
from sonic.models.params import param_counts

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name: str, **overrides) -> ModelConfig:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(preset_names())}")
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path), overrides)
    return OmegaConf.to_object(merged)


def main() -> None:
    print(f"{'preset':<16}{'total':>12}{'active':>12}   E / K / n")
    for name in preset_names():
        cfg = load_preset(name)
        c = param_counts(cfg)
        m = cfg.moe
        print(f"{name:<16}{c.total / 1e9:>11.3f}B{c.active / 1e9:>11.3f}B   {m.num_experts} / {m.top_k} / {m.expert_dim}")


if __name__ == "__main__":
    main()
