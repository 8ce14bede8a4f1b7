"""Helpers shared by the repro scripts: result discovery, markdown tables, figures, commands.

Why a module: every script writes the same kind of report (a table, a PNG, where the numbers
came from), and the tests in tests/scripts exercise these writers on synthetic JSON.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Sequence

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
DOCS = REPO / "docs" / "repro"
RUNS = REPO / "runs"  # default --runs-dir: where scripts that train put their run directories


def rel(path: Path | str) -> str:
    """A path relative to the repository root where possible (for reports and links)."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def newest(pattern: str, folder: Path = RESULTS) -> Path:
    """The last file matching pattern by name (result files start with their ISO date)."""
    found = sorted(folder.glob(pattern))
    if not found:
        raise SystemExit(f"no {pattern} in {rel(folder)}: run the benchmark first or pass the JSON path")
    return found[-1]


def load_json(path: Path | str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_jsonl(path: Path | str) -> list[dict]:
    """metrics.jsonl rows; a resumed run appends, so a repeated step keeps its last record."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def fmt(value, digits: int = 0, missing: str = "–") -> str:
    """A number for a table cell; ranges (lo, hi) as 'lo–hi'; None as a dash."""
    if value is None:
        return missing
    if isinstance(value, (tuple, list)):
        return "–".join(fmt(v, digits) for v in value)
    return f"{value:.{digits}f}"


def mid(value):
    """The midpoint of a (lo, hi) range, or the value itself."""
    return sum(value) / len(value) if isinstance(value, (tuple, list)) else value


def md_table(rows: Iterable[Sequence], header: Sequence[str]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def shape_str(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(v) for v in shape) + ")"


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip() + "\n")
    print(f"wrote {rel(path)}")
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display on CI or cluster nodes)."""
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit("the repro plots need matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    print(f"wrote {rel(path)}")
    return path


def run(cmd: list[str], dry_run: bool = False, timeout: float | None = None) -> bool:
    """Run a command from the repository root, echoing it; a failure ends the script. Past `timeout`
    seconds the command is killed and False returned, so a time-boxed sweep keeps what it has."""
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if dry_run:
        return True
    try:
        subprocess.run(cmd, cwd=REPO, check=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"killed after {timeout:.0f} s: {cmd[-1]}", flush=True)
        return False
    return True


def python() -> str:
    return sys.executable


def provenance(path: Path | str, payload: dict) -> str:
    """One line saying which file, command, device and date produced the numbers."""
    bits = [f"source `{rel(path)}`"]
    for key in ("device", "date"):
        if payload.get(key):
            bits.append(f"{key} {payload[key]}")
    line = "; ".join(bits)
    if payload.get("command"):
        line += f"\n\ncommand: `{payload['command']}`"
    return line
