"""The repro table/plot writers on synthetic results: numbers land in the right cells, PNGs get written.

Synthetic inputs are built here with known values, so a writer that drops, swaps or mis-scales
a number fails. Each test renders into tmp_path (never docs/repro).
"""
from __future__ import annotations

import json
import math

import pytest

from scripts.repro import activation_memory, e2e_throughput, kernel_throughput, paper, sparse_tr, tr_quality
from tests.helpers import changed_files, checkout_files

PNG = b"\x89PNG"
SEVEN_B = list(paper.TABLE_9B["7B"][0])  # (24576, 1536, 256, 128, 8)


def _rec(fwd_ms, bwd_ms, shape, held=2**20):
    T, d, n, E, K = shape
    unit = T * K * n * d / 1e9
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwdbwd_ms": fwd_ms + bwd_ms, "fwd_tf": 6 * unit / fwd_ms,
            "bwd_tf": 12 * unit / bwd_ms, "fwdbwd_tf": 18 * unit / (fwd_ms + bwd_ms), "held_bytes": held,
            "check": {"out": 1e-3}, "check_ok": True}


def _png(path):
    assert path.read_bytes()[:4] == PNG


def test_kernel_throughput_table(tmp_path):
    other = [1024, 256, 128, 8, 2]
    payload = {"command": "python -m bench.moe_layer", "device": "FakeGPU", "configs": [
        {"config": "7B", "shape": SEVEN_B, "backends": {"cute": _rec(1.0, 1.0, SEVEN_B), "official": _rec(2.0, 2.0, SEVEN_B),
                                                         "triton": {"error": "boom"}}},
        {"config": "x", "shape": other, "backends": {"cute": _rec(1.0, 1.0, other)}}]}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(payload))
    text = kernel_throughput.render([src], [], tmp_path)
    row = next(line for line in text.splitlines() if "(24576, 1536, 256, 128, 8)" in line)
    c = _rec(1.0, 1.0, SEVEN_B)
    assert f"{c['fwd_tf']:.0f} / {c['bwd_tf']:.0f} / {c['fwdbwd_tf']:.0f}" in row
    assert "| 2.00 |" in row  # cute / official f+b, same run
    assert "225–249 / 466–517 / 361" in row  # the README's official H100 row
    assert "triton fwd" not in text  # a backend that failed everywhere gets no column
    assert "(1024, 256, 128, 8, 2)" in text  # a non-Table-9b config is still listed
    assert text.count("not run") >= 11 * 2  # the other eleven Table 9b configs, one cell per backend
    _png(tmp_path / "kernel_throughput.png")


def test_kernel_table_reads_cute_rows(tmp_path):
    src = tmp_path / "cute.json"
    src.write_text(json.dumps({"name": "7b", "shape": {"T": 24576, "D": 1536, "N": 256, "E": 128, "K": 8},
                               "rows": [{"kernel": "up", "tflops": 500.4, "vs_cublas": 0.9},
                                        {"kernel": "gather_sum_fwd", "tflops": None}],
                               "layer": {"fwd_tf": 1, "bwd_tf": 2, "fwd_bwd_tf": 3}}))
    text = kernel_throughput.kernel_table([src])
    assert "| up | 500 | 0.90 | 559 |" in text
    assert "gather_sum" not in text
    assert "1 / 2 / 3" in text


def test_sparse_tr_table_and_paper_row(tmp_path):
    sweep = [{"E": E, "backend": "triton", "topk": {"rows": 65536, "fwdbwd_ms": 2.0}, "rounded": {"rows": 65536 - 64,
              "fwdbwd_ms": 2.0 / s}, "speedup_fwd": s, "speedup_bwd": 1.0, "speedup_fwdbwd": s}
             for E, s in ((128, 1.05), (256, 1.2))]
    src = tmp_path / "s.json"
    src.write_text(json.dumps({"command": "python -m bench.moe_layer --sparse-sweep --sweep-shape 16384,4096,1024,4,128,256",
                               "device": "FakeGPU", "sparse_sweep": sweep}))
    assert sparse_tr.sweep_shape(json.loads(src.read_text())) == (16384, 4096, 1024, 4)
    text = sparse_tr.render([src], tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| (16384, 4096, 1024, 4) | 256 |"))
    assert "| 2 |" in row  # T*K/E/128 = 16384*4/256/128
    assert "+20.0%" in row and "+25.7% / +11.8% / +15.9%" in row  # ours, and the paper's E=256 K=4 numbers
    assert "| E=256, K=4 | +25.7% | +11.8% | +15.9% | yes |" in text
    _png(tmp_path / "sparse_tr.png")


def test_activation_memory_measures_the_formula():
    """The Sonic line is X + H + plan exactly, at any granularity; naive holds more."""
    for shape in ((64, 32, 16, 4, 2), (64, 32, 8, 8, 4)):
        m = activation_memory.measure_config(shape, measure_T=16)
        f = activation_memory.formula_bytes(shape)
        assert m["reference"] == f["x"] + f["h"] + m["plan"]
        assert m["naive"] > m["reference"] and m["grouped_mm"] > m["reference"]


def test_activation_memory_render(tmp_path):
    rows = []
    for n, E, K in ((512, 64, 4), (256, 128, 8)):
        shape = [24576, 1536, n, E, K]
        f = activation_memory.formula_bytes(shape)
        rows.append({"size": "7B", "shape": shape, "in_table_9b": True, "formula": f,
                     "bytes": {"plan": 0.0, "reference": float(f["x"] + f["h"]), "grouped_mm": 4e9, "naive": 3e9}})
    payload = {"command": "x", "device": "cpu", "method": "synthetic", "rows": rows}
    gpu = {tuple(SEVEN_B): {"cute": 100 * 2**20, "_source": "g.json", "_device": "FakeGPU"}}
    text = activation_memory.render(payload, gpu, tmp_path, tmp_path / "a.json")
    f = rows[1]["formula"]
    expected = f"{100 * ((f['x'] + f['h']) / (f['x'] + f['h'] + f['y']) - 1):+.0f}%"
    assert expected in next(line for line in text.splitlines() if "(24576, 1536, 256, 128, 8) |" in line)
    assert "| 7B | (24576, 1536, 256, 128, 8) | 100 |" in text  # the GPU held row
    _png(tmp_path / "activation_memory.png")


def _metrics(path, vals, drop_resume=False):
    rows = [{"step": 10 * (i + 1), "loss": v + 0.1, "val_loss": v} for i, v in enumerate(vals)]
    if drop_resume:  # a resumed run appends a step again: the later record wins
        rows.insert(1, {"step": 10, "loss": 0.5, "val_loss": 0.5})
        rows[0], rows[1] = rows[1], rows[0]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tr_quality_collects_three_runs(tmp_path):
    files = [_metrics(tmp_path / "topk.jsonl", [3.0, 2.0], drop_resume=True), _metrics(tmp_path / "nr.jsonl", [3.0, 1.9]),
             _metrics(tmp_path / "drop.jsonl", [3.0, 2.2])]
    tr_quality.main(["--runs", *map(str, files), "--out-dir", str(tmp_path)])
    text = (tmp_path / "tr_quality.md").read_text()
    nr = next(line for line in text.splitlines() if line.startswith("| TR (NR-f)"))
    assert "| 1.9000 |" in nr and "| -0.1000 |" in nr and f"{100 * (math.exp(-0.1) - 1):+.2f}%" in nr
    assert "15.91 / 15.94 / 50.4" in nr and "-0.44%" in nr  # the paper's 0.5B row, NR-f vs top-K val PPL
    top = next(line for line in text.splitlines() if line.startswith("| top-K"))
    assert "| 2.6000 | 2.0000 |" in top  # mean train loss of steps 10, 20: the superseded step-10 record is gone
    _png(tmp_path / "tr_quality.png")


def test_tr_quality_pairs_seeds(tmp_path):
    def runs(finals):
        return [tr_quality.summarize([{"step": 10, "loss": 3.0, "val_loss": 3.0}, {"step": 20, "loss": v, "val_loss": v}])
                for v in finals]

    summaries = {"topk": runs([2.0, 2.2]), "nr_f": runs([2.1, 2.2]), "drop": runs([2.3, 2.5])}
    text = tr_quality.render(summaries, tmp_path, "proxy", "t", "n", {"drop": [0.8, 0.9]})
    drop = next(line for line in text.splitlines() if line.startswith("| token drop"))
    # paired differences 0.3 and 0.3: mean 0.3, sd 0; the unpaired sd of the finals is 0.1414
    assert "| 2 | 20 |" in drop and "| 2.4000 ± 0.1414 |" in drop and "| +0.3000 ± 0.0000 |" in drop
    assert "| 0.850 ± 0.071 |" in drop
    nr = next(line for line in text.splitlines() if line.startswith("| TR (NR-f)"))
    assert "| +0.0500 ± 0.0707 |" in nr and "2.1000 / 2.2000" in nr
    assert "t = +1.00, within seed noise (two-sided 95%: |t| < 12.71)" in text  # 0.05 / (0.0707 / sqrt 2)
    assert "t = +inf, outside seed noise" in text  # token drop: the same +0.3 for both seeds
    _png(tmp_path / "proxy.png")


def test_tr_quality_missing_runs_say_so(tmp_path):
    with pytest.raises(SystemExit, match="not run yet"):
        tr_quality.main(["--runs", *(str(tmp_path / x) for x in "abc"), "--out-dir", str(tmp_path)])


def test_e2e_throughput(tmp_path):
    cmd = "torchrun train.py model=sonic_7b model.num_layers=4 train.seq_len=4096"
    src = tmp_path / "fsdp.json"
    src.write_text(json.dumps({"device": "2x NVIDIA H200 (x MiB each), one host", "runs": {"eager": {
        "command": cmd, "steady_state": {"tokens_per_s_per_gpu": 100000.0, "tokens_per_s": 200000.0,
                                         "btokens_per_day": 17.28, "mfu": 0.2, "mem_peak_gib": 30.0}}}}))
    runs = e2e_throughput.measured_runs([src], [], 40, 0)
    assert runs[0]["layers"] == 4 and runs[0]["device"] == "H200"
    text = e2e_throughput.render(runs, tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| Sonic eager"))
    causal = 20.0 * e2e_throughput.flops_per_token(4, causal=True) / e2e_throughput.flops_per_token(4)
    assert f"| 100.0 | 8.64 | 17.3 (2 GPUs) | {causal:.1f}% | 20.0% |" in row  # MFU causal (headline), then full
    est = 100000.0 * e2e_throughput.flops_per_token(4) / e2e_throughput.flops_per_token(40) * 86400 / 1e9
    assert f"| {est:.2f} |" in row
    assert "| 3.33 | 213 (64 GPUs) |" in text and e2e_throughput.SLURM_64 in text
    _png(tmp_path / "e2e_throughput.png")


def test_e2e_steady_state_skips_warmup():
    rows = [{"step": s, "tokens_per_s_per_gpu": t, "mfu": 0.1} for s, t in ((5, 1.0), (10, 4.0), (15, 6.0))]
    assert e2e_throughput.steady(rows, skip=5)["tokens_per_s_per_gpu"] == 5.0


def test_e2e_payload_reads_each_runs_metrics(tmp_path):
    rows = [{"step": s, "tokens_per_s_per_gpu": v, "tokens_per_s": v, "btokens_per_day": v * 86400 / 1e9, "mfu": 0.1}
            for s, v in ((5, 1.0), (10, 100.0), (15, 300.0))]
    run_dir = tmp_path / "cute_4L"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = "python train.py model=sonic_7b model.num_layers=4"
    payload = e2e_throughput.e2e_payload({run_dir: cmd}, "1x NVIDIA H100 80GB HBM3, torch 2.11", skip=5)
    run = payload["runs"]["cute_4L"]
    assert run["command"] == cmd and run["windows_of_5_steps"] == rows
    assert run["steady_state"]["tokens_per_s_per_gpu"] == 200.0  # the warm-up window is left out
    src = tmp_path / "e2e.json"
    src.write_text(json.dumps(payload))
    runs = e2e_throughput.measured_runs([src], [], 40, 0)
    assert (runs[0]["name"], runs[0]["layers"], runs[0]["device"]) == ("cute_4L", 4, "H100")


def test_e2e_records_carry_speed_and_every_layers_load(tmp_path):
    rows = [{"step": s, "loss": 10.0 - s / 10, "tokens_per_s_per_gpu": v, "tokens_per_s": 2 * v,
             "btokens_per_day": 2 * v * 86400 / 1e9, "mfu": 0.3, "mfu_causal": 0.25, "mem_peak_gib": 80.0,
             "expert_load_max_worst": 3.5 + s, **{f"expert_load_max/{i}": 1.5 + i + s for i in range(3)}}
            for s, v in ((5, 10.0), (10, 40e3), (15, 50e3))]
    run_dir = tmp_path / "triton_3L"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = ("torchrun --nproc-per-node 2 train.py model.num_layers=3 model.moe.kernel_backend=triton "
           "train.micro_batch_size=4 train.seq_len=4096 train.micro_batch_size=8")
    (rec,) = e2e_throughput.e2e_records({run_dir: cmd}, 2, "H200", skip=5, commit="abc123")
    assert rec["mfu_causal"] == 0.25 and (rec["micro_batch_size"], rec["seq_len"]) == (8, 4096)  # the last override
    assert rec["backend"] == "triton" and rec["layers"] == 3 and rec["num_gpus"] == 2 and rec["gpu"] == "H200"
    assert rec["tokens_per_s_per_gpu"] == 45e3 and rec["btokens_per_gpu_day"] == pytest.approx(45e3 * 86400 / 1e9)
    assert rec["max_load_over_mean"] == [16.5, 17.5, 18.5]  # the last logged step, one value per layer
    assert rec["max_load_over_mean_by_step"] == {5: 8.5, 10: 13.5, 15: 18.5}  # the worst layer, every log step
    assert rec["steps"] == 15 and rec["commit"] == "abc123" and rec["mfu"] == 0.3 and rec["peak_mem_gib"] == 80.0


@pytest.mark.slow
def test_reduced_run_trains_three_arms_and_renders(tmp_path):
    """--reduced end to end on CPU, with the model cut to a toy (the GPU run is the same commands).
    Its run directories go to --runs-dir: the checkout is left as it was (it used to train into the
    checkout's runs/tr_0p5b_reduced/, deleting a user's arm folders first)."""
    toy = ["model.num_layers=1", "model.dim=32", "model.num_heads=2", "model.moe.expert_dim=16",
           "model.moe.kernel_backend=reference", "model.moe.routing.tile_size=16", "train.seq_len=64",
           "train.micro_batch_size=4", "train.steps=4", "train.eval_every=2", "train.log_every=2",
           "optim.warmup_steps=1", "data.val_docs=8"]
    before = checkout_files()
    tr_quality.main(["--reduced", "--seeds", "0,1", "--corpus-mb", "1", "--out-dir", str(tmp_path),
                     "--runs-dir", str(tmp_path / "runs"), "--", *toy])
    assert changed_files(before, checkout_files()) == []
    assert sorted(p.name for p in (tmp_path / "runs" / "tr_0p5b_reduced").iterdir()) == sorted(
        ["corpus.jsonl", *(f"{arm}_s{seed}" for arm in tr_quality.ARMS for seed in (0, 1))])
    kept = tmp_path / "tr_reduced"
    assert sorted(f.name for f in kept.glob("*.metrics.jsonl")) == sorted(
        f"{arm}.s{seed}.metrics.jsonl" for arm in tr_quality.ARMS for seed in (0, 1))
    info = json.loads((kept / "run.s1.json").read_text())
    assert info["completed"] == {arm: True for arm in tr_quality.ARMS} and info["corpus"]["documents"] > 0
    assert all("train.seed=1" in c and "model.dim=32" in c for c in info["commands"].values())
    text = (tmp_path / "tr_reduced.md").read_text()
    assert "seeds 0, 1" in text and "over 2 paired seeds" in text
    drop = next(line for line in text.splitlines() if line.startswith("| token drop"))
    assert "| 2 | 4 |" in drop  # two seeds, four steps
    _png(tmp_path / "tr_reduced.png")


def test_e2e_variants_average_the_base_runs_steps_unless_told(tmp_path, monkeypatch):
    """A variant that ran another number of steps than the base run would average another step range."""
    seen = []

    def fake_run_training(*args):
        seen.append(args[10])  # variant_steps
        return sorted(e2e_throughput.RESULTS.glob("*-e2e-40L*.json"))[0]

    monkeypatch.setattr(e2e_throughput, "run_training", fake_run_training)
    argv = ["--run", "--steps", "50", "--variant", "x=optim.lr=1e-4", "--out-dir", str(tmp_path)]
    e2e_throughput.main(argv)
    e2e_throughput.main([*argv, "--variant-steps", "30"])
    assert seen == [50, 30]
