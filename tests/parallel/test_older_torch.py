"""Sonic on the oldest torch it supports (2.11), simulated on this torch: the private symbols that
newer torch added and Sonic has used are removed from torch's modules, as every importer outside
torch sees them, before anything of Sonic is imported (torch's own functions keep their globals:
deleting the symbol outright would break torch itself). Then the trainer imports, trains at parallel.ep=1 on 2 gloo ranks, and parallel.ep=2
gives one clear error naming the feature and both torch versions.

At 5680b33 `sonic.parallel` imported ShardPlacementResult (torch >= 2.13) at import time, so the
trainer and 11 GPU test modules failed to import on the GPU machines' torch 2.11.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# (module, attribute) that torch 2.11 lacks; compat.FEATURES lists what each feature needs, and a
# feature needing a torch newer than the oldest supported one must have its symbols here.
NEWER_THAN_2_11 = [("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult")]

RUNNER = """
import importlib, runpy, sys, types

class Without(types.ModuleType):
    def __init__(self, module, hidden):
        super().__init__(module.__name__)
        self._module, self._hidden = module, hidden

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(self._module, name)

for module, attr in {symbols!r}:
    sys.modules[module] = Without(importlib.import_module(module), {{attr}})
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""
TINY = ["model.num_layers=2", "train.micro_batch_size=2", "train.seq_len=32", "train.steps=3", "train.log_every=1",
        "train.eval_every=0", "train.save_every=0", "train.progress=false", "train.resume=none"]


def _runner(tmp_path: Path) -> Path:
    path = tmp_path / "old_torch_train.py"
    path.write_text(textwrap.dedent(RUNNER.format(symbols=NEWER_THAN_2_11)))
    return path


def _run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_every_newer_torch_feature_is_simulated():
    from sonic import compat

    simulated = {f"{m}.{a}" for m, a in NEWER_THAN_2_11}
    for feature, (_, version, symbols) in compat.FEATURES.items():
        if tuple(map(int, version.split("."))) > compat.MIN_TORCH:
            uses = {f"{m}.{a}" for m, a in symbols}
            assert uses & simulated, f"{feature} needs torch {version}: add one of {uses} to NEWER_THAN_2_11"


def test_trainer_runs_at_ep1_on_gloo_and_ep2_fails_clearly(tmp_path):
    runner = _runner(tmp_path)
    run_dir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(runner),
                 *TINY, f"train.run_dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]

    proc = _run([sys.executable, str(runner), *TINY, "parallel.ep=2", f"train.run_dir={tmp_path / 'ep2'}"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "parallel.ep=2 needs torch>=2.13 (FSDP-2 per-parameter meshes); this is " in out, out[-3000:]
    assert "ShardPlacementResult" in out, out[-3000:]
    assert not (tmp_path / "ep2" / "checkpoints").exists()  # refused before the model was built
