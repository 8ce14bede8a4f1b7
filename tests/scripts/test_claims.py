"""scripts/claims.py: README/docs tables rendered from committed result files, and --check's failures."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import claims
from scripts.claims import ABOVE, CausalMfu, ClaimError, Count, Field, Ratio, Row, Table, Text

ROOT = Path(__file__).resolve().parents[2]
GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, env=GIT_ENV, check=True, capture_output=True, text=True).stdout


def commit_all(root: Path, message: str) -> str:
    git(root, "add", "-A")
    git(root, "commit", "-qm", message)
    return git(root, "rev-parse", "--short", "HEAD").strip()


def test_readme_and_docs_agree_with_their_result_files():
    """The repository's own claims: `python -m scripts.claims --check`, as the README's test command runs it."""
    if not (ROOT / ".git").exists() or claims.is_shallow(ROOT):
        pytest.skip("needs a git checkout with its full history (cited commits are looked up in it)")
    proc = subprocess.run([sys.executable, "-m", "scripts.claims", "--check"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(claims.TABLES)} tables agree" in proc.stdout


RESULT = {"command": "python train.py train.micro_batch_size=2 train.micro_batch_size=8", "date": "2026-01-02T03:04:05",
          "device": "NVIDIA H100 80GB HBM3", "model": "sonic_7b", "layers": 8, "batch": [4, 4096],
          "records": [{"run": "base", "tokens_per_s": 1000.0, "mfu": 0.30, "loads": [1.5, 2.5, 1.9]},
                      {"run": "fast", "tokens_per_s": 1500.0, "mfu": 0.45, "mfu_causal": 0.40, "loads": [1.2, 1.3, 4.0]}]}
TABLE = Table("speed", first="run", caption="A caption without figures.", rows=(
    Row("base", "bench/results/r.json", {"run": "base"}), Row("fast", "bench/results/r.json", {"run": "fast"})),
    columns=(Field("k tokens/s", "tokens_per_s", 1e-3, 2), Ratio("× base", "tokens_per_s", "tokens_per_s", {"run": "base"}),
             Ratio("× above", "tokens_per_s", "tokens_per_s", ABOVE), CausalMfu("MFU"),
             Field("MFU, full", "mfu", 100, suffix="%"), Count("≤ 2", "loads", 2),
             Text("micro-batch", args=("train.micro_batch_size",))))
DOC = "# Doc\n\n## Speed\n\nIntro.\n\n<!-- claims:speed -->\n<!-- /claims:speed -->\n\n## Other\n\n5% here is fine.\n"


@pytest.fixture
def repo(tmp_path):
    """A git repository with one committed result file and a doc holding one claims block."""
    git(tmp_path, "init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    write_result(tmp_path, RESULT)
    (tmp_path / "README.md").write_text(DOC)
    commit_all(tmp_path, "results")
    return tmp_path


def write_result(root: Path, payload: dict) -> None:
    (root / "bench" / "results" / "r.json").write_text(json.dumps(payload))


def run_check(root: Path, specs=None) -> list[str]:
    return claims.check(root, specs or {"speed": TABLE}, docs=("README.md",), sections=(("README.md", "## Speed"),))


def render(root: Path, specs=None) -> str:
    text = claims.render_docs(root, specs or {"speed": TABLE}, docs=("README.md",))["README.md"]
    (root / "README.md").write_text(text)
    return text


def test_check_passes_on_rendered_docs_and_names_each_wrong_number(repo):
    text = render(repo)
    added = git(repo, "rev-parse", "--short", "HEAD").strip()
    causal = 0.30 * claims.causal_share("sonic_7b", 8, 4096)  # derived: the file has no mfu_causal for this run
    assert "| run | k tokens/s | × base | × above | MFU | MFU, full | ≤ 2 | micro-batch | GPU | date | commit | note |" \
        in text
    assert (f"| base | 1.00 | 1.00× | 1.00× | {100 * causal:.1f}% | 30.0% | 2 / 3 | 8 | H100 | 2026-01-02 | `{added}` "
            "| 1 |") in text
    assert f"| fast | 1.50 | 1.50× | 1.50× | 40.0% | 45.0% | 2 / 3 | 8 | H100 | 2026-01-02 | `{added}` | 1 |" in text
    assert (f"1. `bench/results/r.json` (run=base; run=fast); commit `{added}` (it added the file; the file records "
            f"no commit); command: `{RESULT['command']}`") in text
    commit_all(repo, "docs")
    assert run_check(repo) == []

    (repo / "README.md").write_text(text.replace("| fast | 1.50 |", "| fast | 1.60 |"))
    assert run_check(repo) == ["README.md claims:speed, row 'fast', column 'k tokens/s': the doc says '1.60', "
                               "its result file gives '1.50'"]
    (repo / "README.md").write_text(text)
    write_result(repo, {**RESULT, "records": [RESULT["records"][0], {**RESULT["records"][1], "tokens_per_s": 1400.0}]})
    problems = run_check(repo)
    assert "README.md claims:speed, row 'fast', column '× base': the doc says '1.50×', its result file gives " \
           "'1.40×'" in problems


def test_a_result_without_a_command_cannot_be_cited(repo):
    write_result(repo, {k: v for k, v in RESULT.items() if k != "command"})
    commit_all(repo, "lose the command")
    specs = {"speed": Table("speed", TABLE.columns[:-1], TABLE.rows)}  # no column reads the command
    with pytest.raises(ClaimError, match="run=base: no command recorded"):
        render(repo, specs)
    assert any("no command recorded" in p for p in run_check(repo, specs))


def test_commits_cite_the_recorded_one_or_the_one_that_added_the_file(repo):
    first = git(repo, "rev-parse", "--short", "HEAD").strip()
    write_result(repo, {**RESULT, "commit": first})
    commit_all(repo, "the file records the commit it measured")
    assert f"commit `{first}`; command" in render(repo)
    write_result(repo, {**RESULT, "commit": "4ac9a09"})  # a commit rewritten away before merging
    commit_all(repo, "a commit not in the history")
    text = render(repo)
    assert f"commit `{first}` (it added the file; its recorded commit 4ac9a09 is not in the history)" in text
    commit_all(repo, "docs")
    assert run_check(repo) == []
    (repo / "README.md").write_text(text.replace(f"`{first}`", "`4ac9a09`"))  # in the rows and the note
    problems = run_check(repo)
    assert "README.md claims:speed: commit 4ac9a09 is not in the git history" in problems
    assert f"README.md claims:speed, row 'base', column 'commit': the doc says '`4ac9a09`', its result file gives " \
           f"'`{first}`'" in problems


def test_an_uncommitted_result_file_is_refused(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    write_result(tmp_path, RESULT)
    (tmp_path / "README.md").write_text(DOC)
    with pytest.raises(ClaimError, match="not committed: commit the result file, then render"):
        render(tmp_path)


def test_prose_figures_and_unplaced_or_unknown_tables_are_reported(repo):
    render(repo)
    text = (repo / "README.md").read_text()
    text = text.replace("Intro.", "Intro: 1.16× faster at 38.3% MFU, 349 TFLOPS, 2.63B tokens/GPU/day and 23.6 GiB; "
                                  "not figures: 2×H200, 4 × 4096, `1.5×` in code, 6 × N.")
    (repo / "README.md").write_text(text)
    figures = [p.split("figure ")[1].split(";")[0] for p in run_check(repo) if "prose types" in p]
    assert figures == ["'1.16×'", "'38.3%'", "'349 TFLOPS'", "'2.63B tokens/GPU/day'", "'23.6 GiB'"]  # not 5% below
    other = Table("other", (Field("x", "tokens_per_s"),), (Row("base", "bench/results/r.json", {"run": "base"}),))
    assert "TABLES['other'] is placed in none of README.md: add its markers or remove it" in run_check(
        repo, {"speed": TABLE, "other": other})
    (repo / "README.md").write_text(text + "<!-- claims:nope -->\n<!-- /claims:nope -->\n")
    assert run_check(repo) == ["README.md: block claims:nope names no table in scripts/claims.py TABLES"]


def test_a_row_must_pick_exactly_one_record(repo):
    bad = Table("speed", TABLE.columns[:1], (Row("x", "bench/results/r.json", {"run": "missing"}),))
    with pytest.raises(ClaimError, match="0 records under 'records' match"):
        render(repo, {"speed": bad})


def test_a_field_with_missing_reads_an_absent_value_as_it_and_without_it_raises():
    rec = claims.Record("bench/results/r.json", {"summary": {"tokens_per_s_per_gpu": None, "loss": 6.5}},
                 {"summary": {"tokens_per_s_per_gpu": None, "loss": 6.5}}, ())
    assert Field("k tokens/s", "summary.tokens_per_s_per_gpu", 1e-3, missing="–").cell(rec, None) == "–"
    assert Field("loss", "summary.loss", digits=2, missing="–").cell(rec, None) == "6.50"
    with pytest.raises(ClaimError, match="tokens_per_s_per_gpu"):
        Field("k tokens/s", "summary.tokens_per_s_per_gpu", 1e-3).cell(rec, None)


def test_ratio_to_the_same_commits_base_and_kernel_groups(tmp_path):
    """den_same picks the base row of the row's own commit (a file holding several pairs); KernelMs sums a
    profiled step's kernels by name, and rest=True is the step less them."""
    (tmp_path / "bench" / "results").mkdir(parents=True)
    kernels = [{"name": "adam multi_tensor_apply_kernel", "ms": 5.0}, {"name": "flash_attn fwd", "ms": 2.5},
               {"name": "nvjet gemm", "ms": 1.0}]
    rows = [{"which": w, "commit": c, "tokens_per_s": t, "step_ms": 20.0, "kernels": kernels}
            for w, c, t in (("titan", "a", 100.0), ("sonic", "a", 120.0), ("titan", "b", 80.0), ("sonic", "b", 120.0))]
    (tmp_path / "bench" / "results" / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ratio = Ratio("×", "tokens_per_s", "tokens_per_s", {"which": "titan"}, den_same=("commit",))
    cells = []
    for commit in ("a", "b"):
        row = Row(commit, "bench/results/p.jsonl", {"which": "sonic", "commit": commit})
        rec = claims.select(tmp_path, row.file, row.records, row.where)
        cells.append(ratio.cell(rec, claims.Where(tmp_path, row, None)))
    assert cells == ["1.20×", "1.50×"]
    without = Ratio("×", "tokens_per_s", "tokens_per_s", {"which": "titan"})  # two titan rows: ambiguous
    with pytest.raises(ClaimError, match="2 records"):
        without.cell(rec, claims.Where(tmp_path, row, None))
    assert claims.KernelMs("opt", "multi_tensor").cell(rec, None) == "5.0"
    assert claims.KernelMs("rest", "multi_tensor|flash_attn", rest=True).cell(rec, None) == "12.5"
