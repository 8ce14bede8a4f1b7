"""Run lm-eval tasks on a Sonic model: from a checkpoint (`python -m eval`) or in-memory (the trainer).

Local tasks (eval/tasks: sonic_world, the sonic_paper group) are found through an lm-eval include
path. lm-eval's own ~15k task configs are indexed only when a requested task is not local,
because indexing them takes seconds.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
PAPER_TASKS = "sonic_paper"  # the group of the paper's 11 tasks (eval/tasks/sonic_paper.yaml)


def task_manager(tasks: list[str]):
    """An lm-eval TaskManager that knows `tasks`; a ValueError names the ones nobody knows."""
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError("tasks is empty; name at least one, e.g. tasks=[sonic_world]")
    local = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    if all(t in local.all_subtasks for t in tasks):
        return local
    manager = TaskManager(include_path=str(TASKS_DIR))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; local ones: {sorted(local.all_tasks)}, "
                         f"the paper's 11: {PAPER_TASKS}, or any name `lm-eval ls tasks` lists")
    return manager


def evaluate(lm, tasks: list[str], limit: int | float | None = None, num_fewshot: int | None = None,
             bootstrap_iters: int = 0, seed: int = 0) -> dict[str, Any]:
    """lm-eval's result dict (results, groups, versions, n-shot, configs) for an LM such as SonicLM."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=lm, tasks=list(tasks), limit=limit, num_fewshot=num_fewshot,
                          task_manager=task_manager(list(tasks)), bootstrap_iters=bootstrap_iters,
                          log_samples=False, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                          fewshot_random_seed=seed)
    assert out is not None, "simple_evaluate returns None only on non-zero ranks of its own data parallelism"
    return out


def metrics(results: dict[str, Any]) -> dict[str, float]:
    """Flat {task/metric: value} of the tasks and groups ('acc,none' -> 'acc'; stderrs left out)."""
    flat = {}
    for section in ("results", "groups"):
        for task, values in results.get(section, {}).items():
            for key, value in values.items():
                if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                    continue
                metric, filt = key.split(",", 1)
                name = f"{task}/{metric}" if filt == "none" else f"{task}/{metric}/{filt}"
                flat[name] = float(value)
    return flat


def run_lm_eval(model, tokenizer, tasks: list[str], limit: int | float | None = None,
                batch_size: int = 16, num_fewshot: int | None = None, precision: str = "auto") -> dict[str, float]:
    """Evaluate an in-memory model (e.g. every N training steps); returns {task/metric: value}.

    Under FSDP every rank must call this (each forward gathers shards from all ranks); every
    rank then computes the same full result, so log it from rank 0 only. The model's
    train/eval mode is restored afterwards.
    """
    from eval.lm import SonicLM

    was_training = model.training
    try:
        lm = SonicLM(model=model, tokenizer=tokenizer, batch_size=batch_size, precision=precision)
        return metrics(evaluate(lm, tasks, limit=limit, num_fewshot=num_fewshot))
    finally:
        model.train(was_training)


def markdown(results: dict[str, Any]) -> str:
    """lm-eval's markdown tables (tasks, then groups when there are any)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def output_dir(checkpoint: str, chosen: str | None) -> Path:
    """Where `python -m eval` writes its results: `chosen` (output_dir), else <checkpoint>/eval (a file:
    <file>.eval). A ValueError if it cannot be written, raised before any evaluation runs."""
    from sonic.train.checkpoint import unwritable

    source = Path(checkpoint)
    out = Path(chosen) if chosen else source / "eval" if source.is_dir() else source.with_name(source.name + ".eval")
    problem = unwritable(out)
    if problem:
        raise ValueError(f"output_dir={str(out)!r} cannot be written ({problem}); set output_dir to a writable "
                         f"directory (the default is <checkpoint>/eval), e.g. output_dir=eval_results")
    return out


def write_results(results: dict[str, Any], out_dir: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """results.json (lm-eval's results + our run metadata) and results.md in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    keep = {k: results[k] for k in ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better",
                                    "n-samples") if k in results}
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    json_path.write_text(json.dumps({"meta": meta, **keep, "metrics": metrics(results)}, indent=2, default=str)
                         + "\n")
    md_path.write_text(f"# {meta.get('checkpoint', 'model')}\n\n{markdown(results)}")
    return json_path, md_path
