"""Evaluation: the lm-eval model class `sonic` (eval/lm.py), offline and paper task lists (eval/tasks),
`python -m eval` (eval/__main__.py) and `run_lm_eval` for periodic evaluation during training."""
from eval.run import run_lm_eval

__all__ = ["run_lm_eval"]
