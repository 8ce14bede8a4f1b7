"""The offline task end-to-end through lm-eval, `run_lm_eval`, the `python -m eval` config and outputs."""
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("lm_eval")
import lm_eval  # noqa: E402
import lm_eval.tasks  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from eval import run_lm_eval  # noqa: E402
from eval.__main__ import run, to_eval_config  # noqa: E402
from eval.config import EvalConfig  # noqa: E402
from eval.run import TASKS_DIR, task_manager  # noqa: E402
from eval.tasks.sonic_world import build  # noqa: E402
from sonic.data.tokenizer import ByteTokenizer  # noqa: E402
from tests.eval.test_lm import direct_logprob  # noqa: E402

TOK = ByteTokenizer()
PAPER_TASKS = {"winogrande", "social_iqa", "sciq", "piqa", "openbookqa", "hellaswag", "copa", "commonsense_qa",
               "boolq", "arc_easy", "arc_challenge"}


def docs():
    return [json.loads(line) for line in build.DATA_FILE.read_text().splitlines()]


def test_shipped_task_file_is_what_its_generator_writes():
    rows = docs()
    assert build.DATA_FILE.read_text() == build.render(build.items())
    assert len(rows) == 120 and {r["kind"] for r in rows} == {"sound", "food", "colour", "home", "river", "sum"}
    for r in rows:
        assert len(set(r["choices"])) == 4 and 0 <= r["label"] < 4
    labels = [r["label"] for r in rows]
    assert max(labels.count(i) for i in range(4)) < 0.4 * len(rows)  # no answer position to exploit


def test_simple_evaluate_scores_the_local_task_with_real_loglikelihoods(tiny_checkpoint):
    limit = 8
    out = lm_eval.simple_evaluate(
        model="sonic", model_args={"checkpoint": str(tiny_checkpoint.path), "kernel_backend": "reference",
                                   "batch_size": 7},
        tasks=["sonic_world"], limit=limit, task_manager=task_manager(["sonic_world"]), bootstrap_iters=0,
        log_samples=True)
    res = out["results"]["sonic_world"]
    assert out["n-samples"]["sonic_world"]["effective"] == limit
    model = tiny_checkpoint.model
    correct = correct_norm = 0
    samples = {s["doc_id"]: s for s in out["samples"]["sonic_world"]}
    for doc_id, doc in enumerate(docs()[:limit]):
        lls = [direct_logprob(model, doc["context"], " " + c) for c in doc["choices"]]
        correct += max(range(4), key=lambda i: lls[i]) == doc["label"]
        correct_norm += max(range(4), key=lambda i: lls[i] / len(doc["choices"][i])) == doc["label"]
        assert samples[doc_id]["doc"] == doc
        assert [r[0] for r in samples[doc_id]["filtered_resps"]] == pytest.approx(lls, abs=1e-4)
    assert res["acc,none"] == pytest.approx(correct / limit)
    assert res["acc_norm,none"] == pytest.approx(correct_norm / limit)


def test_run_lm_eval_returns_flat_metrics_and_restores_train_mode(tiny_checkpoint):
    model = tiny_checkpoint.model.train()
    try:
        metrics = run_lm_eval(model, TOK, ["sonic_world"], limit=4, batch_size=16)
        assert model.training
    finally:
        model.eval()
    assert set(metrics) == {"sonic_world/acc", "sonic_world/acc_norm"}
    assert all(0.0 <= v <= 1.0 and v * 4 == int(v * 4) for v in metrics.values())  # k correct out of 4


def test_cli_config_runs_and_writes_json_and_markdown(tiny_checkpoint, tmp_path):
    with initialize_config_dir(config_dir=str(TASKS_DIR.parent / "conf"), version_base=None):
        raw = compose(config_name="eval", overrides=[f"checkpoint={tiny_checkpoint.path}", "limit=6",
                                                      "kernel_backend=reference", f"output_dir={tmp_path}",
                                                      "batch_size=4"])
    cfg = to_eval_config(raw)
    assert cfg.limit == 6 and isinstance(cfg.limit, int) and cfg.tasks == ["sonic_world"]
    json_path = run(cfg)
    saved = json.loads(json_path.read_text())
    assert saved["meta"]["checkpoint"] == str(tiny_checkpoint.path)
    assert set(saved["metrics"]) == {"sonic_world/acc", "sonic_world/acc_norm"}
    assert saved["metrics"]["sonic_world/acc"] == saved["results"]["sonic_world"]["acc,none"]
    table = (tmp_path / "results.md").read_text()
    assert "sonic_world" in table and "acc_norm" in table


@pytest.mark.parametrize("kw, match", [
    (dict(), "checkpoint is required"),
    (dict(checkpoint="x", tasks=[]), "tasks is empty"),
    (dict(checkpoint="x", limit=0), "limit"),
    (dict(checkpoint="x", limit=2.5), "whole"),
    (dict(checkpoint="x", precision="fp16"), "precision"),
])
def test_eval_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        EvalConfig(**kw)


def test_paper_group_names_the_11_tasks():
    group = yaml.safe_load((TASKS_DIR / "sonic_paper.yaml").read_text())
    assert set(group["task"]) == PAPER_TASKS and len(group["task"]) == 11


def test_paper_tasks_are_lm_eval_task_names():
    # A text scan of lm-eval's task YAMLs (about a second) instead of its full task index (many seconds).
    pattern = re.compile(r"^task:\s*(\S+)\s*$", re.MULTILINE)
    found = set()
    for f in (Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml"):
        found.update(name for name in pattern.findall(f.read_text(errors="ignore")) if name in PAPER_TASKS)
    assert found == PAPER_TASKS


def test_unknown_tasks_are_named_and_lm_eval_is_indexed_only_when_needed(monkeypatch):
    built = []

    class FakeManager:  # stands in for lm-eval's TaskManager, whose full index takes many seconds
        def __init__(self, include_path=None, include_defaults=True):
            built.append(include_defaults)
            self.all_subtasks = ["sonic_world"] + (["hellaswag"] if include_defaults else [])
            self.all_tasks = self.all_subtasks + ["sonic_paper"]

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", FakeManager)
    assert task_manager(["sonic_world"]).all_subtasks == ["sonic_world"] and built == [False]
    assert "hellaswag" in task_manager(["hellaswag"]).all_subtasks and built == [False, False, True]
    with pytest.raises(ValueError, match=r"unknown lm-eval task\(s\) \['nope'\]"):
        task_manager(["hellaswag", "nope"])
    with pytest.raises(ValueError, match="tasks is empty"):
        task_manager([])


def test_local_tasks_do_not_index_lm_eval_defaults():
    manager = task_manager(["sonic_world"])
    assert "sonic_world" in manager.all_subtasks and "hellaswag" not in manager.all_tasks


def test_model_registered_under_sonic():
    from eval.lm import SonicLM

    assert lm_eval.api.registry.get_model("sonic") is SonicLM
    assert torch.is_grad_enabled()  # scoring must not leave grad mode off for the caller
