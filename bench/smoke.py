"""GPU smoke: what every change to sonic/ is proven with before it lands (bash bench/gpu.sh smoke).

On the GPU machine's own torch, in one call of a few minutes:
  1. every GPU test (pytest -m gpu: the kernels against the reference, the fuzzed shapes, routing,
     attention, loss, guard), counted from pytest's junit XML;
  2. the real trainer for --steps steps of sonic_7b cut to --layers layers (micro-batch 4 x 4096,
     the embedded corpus so that no tokenizer is built), once per kernel backend, with tokens/s
     over the steps after the first log step (compilation excluded), peak memory, and every
     layer's expert load at every log step.

It writes bench/results/<date>-<gpu>-smoke.json: `commit` (the commit tested), `sonic_tree` (git's
tree hash of the sonic/ folder as it was on the machine, so `git rev-parse <commit>:sonic` proves the
tree tested is the commit's), torch, gpu, tests_passed/failed/skipped, and `train` per backend.

The rule (README, Contributing): a change to sonic/ lands with a smoke result whose commit has the
same sonic/ tree, i.e. `git diff --name-only <commit> HEAD -- sonic/` prints nothing.
`python -m bench.smoke --verify [FILE]` checks that rule here, for the newest smoke result by default.

Run:   python -m bench.smoke [--commit SHA] [--backends cute,triton] [--layers 16] [--steps 30]
       python -m bench.smoke --verify
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_tree_hash(path: Path) -> str:
    """git's tree object id of a folder's files (what `git rev-parse HEAD:<folder>` prints for a clean
    checkout), computed without git: the GPU machine gets a copy of the working tree, not the repository.
    Bytecode caches are skipped, as .gitignore skips them."""
    entries = []
    for child in path.iterdir():
        if child.name == "__pycache__" or child.suffix == ".pyc":
            continue
        if child.is_dir():
            entries.append((child.name + "/", b"40000 " + child.name.encode(), bytes.fromhex(git_tree_hash(child))))
        else:
            data = child.read_bytes()
            mode = b"100755" if os.access(child, os.X_OK) else b"100644"
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).digest()
            entries.append((child.name, mode + b" " + child.name.encode(), blob))
    body = b"".join(head + b"\0" + digest for _, head, digest in sorted(entries))  # git sorts dirs as "name/"
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def git(*args: str) -> str | None:
    proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def run_command(cmd: list[str], timeout_s: float) -> tuple[str, int, bool]:
    """(stdout + stderr, returncode, timed out) of `cmd` run in the repository; a timeout is rc 124, its
    partial output kept as text."""
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        return proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as err:  # its partial output comes as bytes, text=True or not
        partial = [b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (err.stdout, err.stderr)]
        return "\n".join(partial) + f"\ntimed out after {timeout_s:.0f} s", 124, True


def run_gpu_tests(timeout_s: float, log: Path) -> dict:
    """pytest -m gpu over tests/, counted from its junit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider",
               "--durations=10", f"--junitxml={xml}"]  # the slowest tests name what to cut when time runs out
        out, rc, timed_out = run_command(cmd, timeout_s)
        log.write_text(out)
        counts = {"tests_passed": 0, "tests_failed": 0, "tests_skipped": 0}
        if xml.exists():
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            counts = {"tests_passed": total - failed - skipped, "tests_failed": failed, "tests_skipped": skipped}
        elif rc != 0:
            counts["tests_failed"] = 1  # pytest died before writing its report: count it as a failure
        failures = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
        if timed_out:
            failures.append(f"TIMEOUT: pytest -m gpu ran past --tests-timeout {timeout_s:.0f} s (see {log.name})")
        return {**counts, "tests_rc": rc, "tests_timed_out": timed_out, "tests_failures": failures[:50]}


def run_trainer(backend: str, layers: int, steps: int, timeout_s: float, log: Path) -> dict:
    """The real trainer (train.py) on sonic_7b cut to `layers` layers with `backend`'s experts."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "train.py", "experiment=sonic_7b", "data=embedded", f"model.num_layers={layers}",
               f"model.moe.kernel_backend={backend}", f"train.steps={steps}", "train.log_every=5", "train.eval_every=0",
               "train.save_every=0", "train.resume=none", "train.progress=false", f"train.run_dir={run_dir}"]
        out, rc, _ = run_command(cmd, timeout_s)
        log.write_text(" ".join(cmd) + "\n" + out)
        path = Path(run_dir) / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    record = {"rc": rc, "command": " ".join(cmd[1:]), "steps_logged": [r["step"] for r in rows]}
    if rows:
        timed = rows[1:] or rows  # the first log window holds compilation
        record.update({
            "tokens_per_s": sum(r["tokens_per_s_per_gpu"] for r in timed) / len(timed),
            "peak_gib": max(r.get("mem_peak_gib", 0.0) for r in rows),
            "loss_first_last": [rows[0]["loss"], rows[-1]["loss"]],
            "worst_load": rows[-1].get("expert_load_max_worst"),
            "load_max_by_layer": [rows[-1].get(f"expert_load_max/{layer}") for layer in range(layers)],
            "worst_load_by_step": {r["step"]: r.get("expert_load_max_worst") for r in rows}})
    if rc != 0:
        record["error_tail"] = out.splitlines()[-30:]
    return record


def verify(path: Path) -> str | None:
    """None if `path` proves HEAD's sonic/ tree; otherwise why not."""
    rec = json.loads(path.read_text())
    commit, tree = rec.get("commit", ""), rec.get("sonic_tree")
    if not commit or git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return f"{path.name}: commit {commit!r} is not in this repository's history"
    if tree != git("rev-parse", f"{commit}:sonic"):
        return f"{path.name}: the sonic/ tree tested ({tree}) is not commit {commit}'s: the tree was dirty"
    changed = git("diff", "--name-only", commit, "HEAD", "--", "sonic/")
    if changed:
        return f"{path.name} tested {commit}; sonic/ changed since: {changed.splitlines()[:5]}"
    if rec.get("tests_timed_out") or rec.get("tests_rc") == 124:
        return f"{path.name}: the GPU tests ran past --tests-timeout (its log names the slowest); rerun with more"
    if rec.get("tests_failed") or any(t.get("rc") for t in rec.get("train", {}).values()):
        return f"{path.name}: {rec.get('tests_failed')} GPU test(s) failed or a training run failed"
    return None


def newest(paths: list[Path]) -> Path | None:
    """The result taken last, by the date it records (file names sort by GPU within a day)."""
    return max(paths, key=lambda p: (json.loads(p.read_text()).get("date", ""), p.name), default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", default=os.environ.get("SONIC_COMMIT"), help="the commit tested (default: git HEAD)")
    ap.add_argument("--backends", default="cute,triton")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    # a cold kernel cache compiles every tile config the GPU tests run: on a fresh H200 that ran past 360 s on
    # 2026-11-26 (past 300 s before the up/dW1/dW2 direct stores), so a cold smoke may need more than this default;
    # a machine whose cache an earlier call warmed takes much less
    ap.add_argument("--tests-timeout", type=float, default=420)
    ap.add_argument("--train-timeout", type=float, default=240)
    ap.add_argument("--json", help="output file (default bench/results/<date>-<gpu>-smoke.json)")
    ap.add_argument("--verify", nargs="?", const="newest", help="check a smoke result against HEAD and exit")
    args = ap.parse_args()

    from bench.common import RESULTS, git_commit, gpu_name, result_path, table, write_json  # noqa: PLC0415

    if args.verify:
        found = newest(list(RESULTS.glob("*smoke*.json")))
        path = found if args.verify == "newest" and found else Path(args.verify)
        problem = verify(path) if path.exists() else f"no smoke result at {path}"
        print(problem or f"{path.name} proves HEAD's sonic/ tree")
        raise SystemExit(1 if problem else 0)

    import torch  # noqa: PLC0415

    sonic_tree = git_tree_hash(REPO / "sonic")  # before anything runs (and writes bytecode)
    commit = args.commit or git_commit()  # not the HEAD of a stale .git around a copy of the tree
    if commit == "unknown":
        raise SystemExit("no git here: pass --commit SHA (or SONIC_COMMIT) naming the commit this tree is")
    if not torch.cuda.is_available():
        raise SystemExit("bench.smoke needs a CUDA GPU (it proves the GPU path)")
    logs = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    tests = run_gpu_tests(args.tests_timeout, logs / "smoke_tests.log")
    print(f"GPU tests: {tests['tests_passed']} passed, {tests['tests_failed']} failed, "
          f"{tests['tests_skipped']} skipped", flush=True)
    train = {b: run_trainer(b, args.layers, args.steps, args.train_timeout, logs / f"smoke_train_{b}.log")
             for b in args.backends.split(",")}
    payload = {"commit": commit, "sonic_tree": sonic_tree, "gpu": gpu_name(), **tests,
               "train_config": {"model": "sonic_7b", "layers": args.layers, "steps": args.steps, "data": "embedded",
                                "micro_batch_size": 4, "seq_len": 4096},
               "train": train}
    path = write_json(result_path("smoke", args.json), payload)
    rows = [[b, r["rc"], f"{r.get('tokens_per_s', 0):.0f}", f"{r.get('peak_gib', 0):.1f}", r.get("worst_load")]
            for b, r in train.items()]
    print(table(rows, ["backend", "rc", "tokens/s", "peak GiB", "worst max/mean"]))
    print(f"wrote {path}")
    if tests["tests_failed"] or any(r["rc"] for r in train.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
