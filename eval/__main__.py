"""`python -m eval checkpoint=<path> tasks=[sonic_world]`: lm-eval tasks on a Sonic checkpoint.

Writes results.json and results.md to output_dir (default <checkpoint>/eval; checked to be writable
before the evaluation starts) and prints the table. The checkpoint's files are checked against its
meta.json first. The paper's 11 tasks: tasks=[sonic_paper] (downloads their datasets on first use).
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig

from eval.config import EvalConfig
from eval.lm import SonicLM
from eval.run import evaluate, markdown, output_dir, write_results
from sonic.train.config import to_dataclass

log = logging.getLogger("eval")


def to_eval_config(raw: DictConfig) -> EvalConfig:
    return to_dataclass(EvalConfig, raw)  # unknown keys fail, also as +key=value


def run(cfg: EvalConfig) -> Path:
    out_dir = output_dir(cfg.checkpoint, cfg.output_dir)  # a ValueError now, not after the evaluation
    lm = SonicLM(checkpoint=cfg.checkpoint, tokenizer=cfg.tokenizer, batch_size=cfg.batch_size, device=cfg.device,
                 precision=cfg.precision, kernel_backend=cfg.kernel_backend, seed=cfg.seed)
    results = evaluate(lm, cfg.tasks, limit=cfg.limit, num_fewshot=cfg.num_fewshot,
                       bootstrap_iters=cfg.bootstrap_iters, seed=cfg.seed)
    meta = {"checkpoint": cfg.checkpoint, "evaluated": lm.checkpoint_path, "step": lm.checkpoint_step,
            "tasks": cfg.tasks, "limit": cfg.limit, "num_fewshot": cfg.num_fewshot,
            "device": str(lm.device), "precision": cfg.precision}
    json_path, md_path = write_results(results, out_dir, meta)
    print(markdown(results))
    log.info("wrote %s and %s", json_path, md_path)
    return json_path


@hydra.main(version_base=None, config_path="conf", config_name="eval")
def main(raw: DictConfig) -> None:
    run(to_eval_config(raw))


if __name__ == "__main__":
    main()
