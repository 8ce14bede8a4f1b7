"""bench.expert_parallel on 2 CPU processes (its smoke mode): both ep values run the real step and
report their numbers; only the EP run spends time in all-to-all."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_expert_parallel_bench_runs_each_ep(tmp_path):
    out = tmp_path / "ep.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "bench.expert_parallel", "--eps", "1,2", "--steps", "1", "--warmup", "0", "--batches", "1",
           "--json", str(out), "model=tiny", "model.num_layers=1", "data=embedded", "train.micro_batch_size=2",
           "train.seq_len=32"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", **os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    fsdp, ep = result["rows"]
    assert (fsdp["ep"], ep["ep"], result["world_size"]) == (1, 2, 2)
    assert fsdp["all_to_all_ms"] == 0 < ep["all_to_all_ms"] and ep["tokens_per_s_per_gpu"] > 0
    for row in (fsdp, ep):  # tiny, one MoE layer: E 8, K 2; all ranks' 2x32 tokens, K experts each
        [load_E] = row["expert_load"]
        assert len(load_E) == 8 and sum(load_E) == 2 * (2 * 32) * 2
        assert row["worst_load_max_over_mean"] == pytest.approx(max(load_E) / (sum(load_E) / len(load_E)))
