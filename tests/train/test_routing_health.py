"""Routing health through the real trainer: a deep, narrow model keeps every layer's load in bounds
after a few steps, and every layer's max/mean and cv reach metrics.jsonl."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 12
# init_std^2 * dim as sonic_7b's, so the model collapses the way the 40-layer one does under GPT-2 init
DEEP_NARROW = [f"model.num_layers={LAYERS}", "model.init_std=0.07", "model.moe.num_experts=16", "model.moe.top_k=2",
               "model.moe.shared_expert_dim=64", "train.steps=10", "train.log_every=5", "train.eval_every=0",
               "train.save_every=0", "train.resume=none", "train.progress=false"]


def last_metrics(tmp_path, *overrides) -> dict:
    subprocess.run([sys.executable, "train.py", *DEEP_NARROW, f"train.run_dir={tmp_path}", *overrides], cwd=ROOT,
                   check=True, capture_output=True, timeout=600)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]


def test_deep_model_routing_stays_balanced(tmp_path):
    rec = last_metrics(tmp_path)
    loads = [rec[f"expert_load_max/{layer}"] for layer in range(LAYERS)]
    assert all(f"expert_load_cv/{layer}" in rec for layer in range(LAYERS))
    assert rec["expert_load_max_worst"] == max(loads)
    # GPT-2's attention init (model.attn_out_init=scaled) reaches 4.6-5.7 here; E/K = 8 is full collapse
    assert max(loads) < 4.2, loads
