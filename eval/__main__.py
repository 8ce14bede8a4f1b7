"""`python -m eval checkpoint=<path> tasks=[sonic_world]`: lm-eval tasks on a Sonic checkpoint.

Writes results.json and results.md to output_dir (default <checkpoint>/eval) and prints the table.
The paper's 11 tasks: tasks=[sonic_paper] (downloads their datasets on first use).
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from eval.config import EvalConfig
from eval.lm import SonicLM
from eval.run import evaluate, markdown, write_results

log = logging.getLogger("eval")


def to_eval_config(raw: DictConfig) -> EvalConfig:
    raw = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "hydra"]) if "hydra" in raw else raw
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EvalConfig), raw))


def run(cfg: EvalConfig) -> Path:
    lm = SonicLM(checkpoint=cfg.checkpoint, tokenizer=cfg.tokenizer, batch_size=cfg.batch_size, device=cfg.device,
                 precision=cfg.precision, kernel_backend=cfg.kernel_backend, seed=cfg.seed)
    results = evaluate(lm, cfg.tasks, limit=cfg.limit, num_fewshot=cfg.num_fewshot,
                       bootstrap_iters=cfg.bootstrap_iters, seed=cfg.seed)
    source = Path(cfg.checkpoint)
    default_out = source / "eval" if source.is_dir() else source.with_name(source.name + ".eval")
    meta = {"checkpoint": cfg.checkpoint, "evaluated": lm.checkpoint_path, "step": lm.checkpoint_step,
            "tasks": cfg.tasks, "limit": cfg.limit, "num_fewshot": cfg.num_fewshot,
            "device": str(lm.device), "precision": cfg.precision}
    json_path, md_path = write_results(results, Path(cfg.output_dir) if cfg.output_dir else default_out, meta)
    print(markdown(results))
    log.info("wrote %s and %s", json_path, md_path)
    return json_path


@hydra.main(version_base=None, config_path="conf", config_name="eval")
def main(raw: DictConfig) -> None:
    run(to_eval_config(raw))


if __name__ == "__main__":
    main()
