"""Interrupt a multi-rank torchrun training job the ways a cluster does, resume it with
train.resume=auto, and compare its loss curve with an uninterrupted run, step by step, bit for bit.

Scenarios (each against the same uninterrupted run of --steps steps):
  sigkill  SIGKILL to the whole job, launcher and workers at once (a node failure, the OOM
           killer), once two checkpoints exist; then rerun
  corrupt  a copy of the sigkill run with the newest checkpoint's .distcp files truncated to half
           (the issue's measurement): the rerun must set it aside as .corrupt and resume from the
           older one
  sigusr1  SIGUSR1 to torchrun, as Slurm's --signal=B:USR1 sends it: the trainers save at a
           step boundary and exit; then rerun

  python scripts/kill_resume.py --out kill_resume.json                  # 2 CPU ranks, gloo
  python scripts/kill_resume.py --device cuda --out kill_resume.json    # 2 GPUs, nccl
  python scripts/kill_resume.py --device cuda --out r.json -- train.seq_len=128   # Hydra overrides

The interrupted runs are launched with train.steps=1000000 (so they cannot finish before the
interruption) and a constant LR schedule, which makes their first --steps steps those of the
reference run. On a GPU, a curve that differs may come from non-deterministic kernels rather
than the resume: --repeat adds a second uninterrupted run to measure that. Prints a table last,
writes JSON to --out, and exits 1 unless every scenario matches (within --tolerance, default 0).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from sonic.models.loading import complete_checkpoints  # noqa: E402

CURVE = ("loss", "aux_loss", "z_loss", "grad_norm", "lr", "skipped_steps")
FOREVER = 1_000_000  # train.steps of the runs that get interrupted
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
LOG_TAIL = 100  # lines of a failed job's output kept in the JSON and printed (torchrun adds ~40 of its own)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (GPUs with --device cuda)")
    parser.add_argument("--steps", type=int, default=10, help="steps of the reference run and of every resume")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="run directories go here (default: a new temporary one)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="torchrun jobs at once (default: 3 on CPU, 1 on GPUs, which the jobs would share)")
    parser.add_argument("--repeat", action="store_true", help="also compare a second uninterrupted run")
    parser.add_argument("--tolerance", type=float, default=0.0, help="largest |difference| accepted (0: bit-exact)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per torchrun job")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args(argv)
    if args.steps < 2 * args.save_every + 2:
        parser.error(f"--steps={args.steps} leaves no steps after two checkpoints; use at least "
                     f"{2 * args.save_every + 2} (or a smaller --save-every)")
    return args


def overrides(args: argparse.Namespace) -> list[str]:
    """A tiny model, every step logged, frequent checkpoints; the user's overrides last."""
    return ["model.num_layers=2", "train.micro_batch_size=4", "train.seq_len=32", "train.log_every=1",
            f"train.save_every={args.save_every}", "train.keep_last=2", "train.eval_every=0", "train.progress=false",
            "optim.schedule=constant", "optim.warmup_steps=2", f"train.device={args.device}", *args.overrides]


def torchrun(args: argparse.Namespace, run_dir: Path, steps: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "train.py", *overrides(args),
           f"train.steps={steps}", f"train.run_dir={run_dir}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "stdout.log").open("ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _process_tree(pid: int) -> list[int]:
    """pid and its live descendants (Linux /proc). torchrun starts each worker in a session of its
    own, so a process-group kill would miss them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if fields[0] != "Z":  # zombies have exited
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker at once (as a node failure does), then wait for them all."""
    tree = _process_tree(proc.pid)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    while any(_alive(pid) for pid in tree[1:]):  # workers are not our children: poll until gone
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def metrics(run_dir: Path) -> dict[int, dict]:
    """Logged metrics by step; a resumed run's lines replace the interrupted run's."""
    path = run_dir / "metrics.jsonl"
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            m = json.loads(line)
        except json.JSONDecodeError:  # a line being written while we poll
            continue
        out[m["step"]] = m
    return out


def logged_twice(run_dir: Path) -> list[int]:
    """Steps with more than one row in metrics.jsonl (a resume drops the rows past its step first)."""
    path = run_dir / "metrics.jsonl"
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []
    return sorted({s for s in steps if steps.count(s) > 1})


def run_job(args: argparse.Namespace, run_dir: Path, interrupt: str | None = None) -> dict:
    """One torchrun job: to the end (interrupt=None), or interrupted by 'sigkill' / 'sigusr1'."""
    log = run_dir / "stdout.log"
    start = log.stat().st_size if log.exists() else 0  # this job's output starts here (the log is appended to)
    proc = torchrun(args, run_dir, FOREVER if interrupt else args.steps)
    deadline = time.monotonic() + args.timeout
    info: dict = {}
    try:
        while interrupt and proc.poll() is None and time.monotonic() < deadline:
            if interrupt == "sigkill" and len(complete_checkpoints(run_dir / "checkpoints")) >= 2:
                kill_tree(proc)
                info["signalled"] = "SIGKILL to torchrun and its workers"
                break
            if interrupt == "sigusr1" and len(metrics(run_dir)) >= args.save_every + 1:
                proc.send_signal(signal.SIGUSR1)  # torchrun forwards it to the trainers
                info["signalled"] = f"SIGUSR1 to torchrun after step {max(metrics(run_dir))}"
                break
            time.sleep(0.02)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        info["error"] = f"timed out after {args.timeout} s"
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    info["returncode"] = proc.returncode
    if interrupt and "error" not in info and not info.get("signalled"):
        info["error"] = f"the job ended (exit code {proc.returncode}) before it was interrupted"
    if "error" in info or (not interrupt and proc.returncode != 0):  # what a failure printed, to read in the JSON
        with log.open("rb") as f:
            f.seek(start)
            info["log_tail"] = f.read().decode(errors="replace").splitlines()[-LOG_TAIL:]
    return info


def truncate_newest(run_dir: Path) -> str:
    newest = complete_checkpoints(run_dir / "checkpoints")[-1]
    for f in newest.glob("*.distcp"):
        with f.open("r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    return newest.name


def compare(reference: dict[int, dict], got: dict[int, dict], steps: int) -> tuple[int, float]:
    """(steps whose curve values all match exactly, largest |difference| over all steps and keys)."""
    exact, worst = 0, 0.0
    for step in range(1, steps + 1):
        if step not in got or step not in reference:
            worst = math.inf
            continue
        diffs = []
        for key in CURVE:
            a, b = reference[step].get(key), got[step].get(key)
            same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
            diffs.append(0.0 if same else abs(a - b) if None not in (a, b) else math.inf)
        exact += max(diffs) == 0.0
        worst = max(worst, *diffs)
    return exact, worst


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"--device cuda --nproc {args.nproc} needs {args.nproc} GPUs, {torch.cuda.device_count()} "
                         f"visible; use --device cpu for gloo on CPU")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kill_resume_"))
    jobs = args.jobs or (3 if args.device == "cpu" else 1)
    start = time.monotonic()
    dirs = {name: work / name for name in ("reference", "repeat", "sigkill", "corrupt", "sigusr1")}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)

    # phase 1: the reference run and the two interrupted runs
    first = [("reference", None), ("sigkill", "sigkill"), ("sigusr1", "sigusr1")] + [("repeat", None)] * args.repeat
    with ThreadPoolExecutor(jobs) as pool:
        ran = dict(zip([n for n, _ in first], pool.map(lambda s: run_job(args, dirs[s[0]], s[1]), first)))
    at_kill = [p.name for p in complete_checkpoints(dirs["sigkill"] / "checkpoints")]  # all ranks are gone now
    stopped_log = (dirs["sigusr1"] / "stdout.log").read_text()
    if "error" not in ran["sigkill"]:
        shutil.copytree(dirs["sigkill"], dirs["corrupt"])
        (dirs["corrupt"] / "stdout.log").write_text("")  # the copy's log: its resume only
        ran["corrupt"] = {**ran["sigkill"], "corrupted": truncate_newest(dirs["corrupt"])}

    # phase 2: resume each interrupted run with train.resume=auto
    names = [n for n in ("sigkill", "corrupt", "sigusr1") if n in ran and "error" not in ran[n]]
    with ThreadPoolExecutor(jobs) as pool:
        resumed = dict(zip(names, pool.map(lambda n: run_job(args, dirs[n]), names)))

    reference = metrics(dirs["reference"])
    scenarios = {}
    for name in ("sigkill", "corrupt", "sigusr1") + ("repeat",) * args.repeat:
        run, resume = ran.get(name, {"error": "not run: its sigkill run failed"}), resumed.get(name, {})
        log = (dirs[name] / "stdout.log").read_text() if (dirs[name] / "stdout.log").exists() else ""
        found = RESUMED.findall(log)
        set_aside = sorted(p.name for p in (dirs[name] / "checkpoints").glob("*.corrupt*")) \
            if (dirs[name] / "checkpoints").exists() else []
        exact, worst = compare(reference, metrics(dirs[name]), args.steps)
        s = {"interruption": run, "resume": resume, "resumed_from": int(found[-1][1]) if found else None,
             "set_aside": set_aside, "steps_compared": args.steps, "steps_bit_exact": exact,
             "bit_exact": exact == args.steps, "max_abs_diff": worst}
        last = resume if name != "repeat" else run  # the run that wrote the end of the curve
        checks = {"ran": "error" not in run and "error" not in last,
                  "reference exited 0": ran["reference"].get("returncode") == 0,
                  "finished with exit code 0": last.get("returncode") == 0,
                  "curve matches the reference": worst <= args.tolerance,
                  "metrics.jsonl holds each step once": not logged_twice(dirs[name])}
        if name == "sigkill":
            checks["resumed from the newest checkpoint"] = bool(at_kill) and s["resumed_from"] == int(at_kill[-1][5:])
        if name == "sigusr1":
            checks["trainers saved and stopped on the signal"] = "stopped at step" in stopped_log
            checks["resumed mid-run"] = s["resumed_from"] is not None and 0 < s["resumed_from"] < args.steps
        if name == "corrupt":
            s["corrupted"] = run.get("corrupted")
            checks["corrupt newest set aside"] = set_aside == [f"{s['corrupted']}.corrupt"]
            older = int(at_kill[-2][5:]) if len(at_kill) >= 2 else None
            checks["resumed from the older checkpoint"] = older is not None and s["resumed_from"] == older
        s["checks"], s["ok"] = checks, all(checks.values())
        scenarios[name] = s

    result = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "device": args.device, "nproc": args.nproc, "backend": "nccl" if args.device == "cuda" else "gloo",
              "gpus": [torch.cuda.get_device_name(i) for i in range(args.nproc)] if args.device == "cuda" else [],
              "torch": torch.__version__, "steps": args.steps, "save_every": args.save_every,
              "overrides": overrides(args), "workdir": str(work), "tolerance": args.tolerance,
              "wall_s": round(time.monotonic() - start, 1), "reference": ran["reference"], "scenarios": scenarios,
              "ok": all(s["ok"] for s in scenarios.values())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    print(f"\nkill and resume, {args.nproc} ranks ({result['backend']}), {args.steps} steps, {result['wall_s']} s; "
          f"run directories in {work}")
    print(f"{'scenario':<9} {'resumed from':>12} {'set aside':<22} {'bit-exact steps':>15} {'max |diff|':>10}  result")
    for name, s in scenarios.items():
        failed = [c for c, ok in s["checks"].items() if not ok]
        print(f"{name:<9} {str(s['resumed_from']):>12} {','.join(s['set_aside']) or '-':<22} "
              f"{s['steps_bit_exact']:>7}/{s['steps_compared']:<7} {s['max_abs_diff']:>10.3g}  "
              f"{'ok' if s['ok'] else 'FAILED: ' + '; '.join(failed)}")
    failed_jobs = [("reference", ran["reference"])] + [(f"{name} {phase}", s[phase]) for name, s in scenarios.items()
                                                       for phase in ("interruption", "resume")]
    for what, job in failed_jobs:
        if "log_tail" in job:
            print(f"\n{what} failed; the end of its output:\n  " + "\n  ".join(job["log_tail"]))
    print(f"{'all ok' if result['ok'] else 'FAILED'}; JSON in {args.out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
