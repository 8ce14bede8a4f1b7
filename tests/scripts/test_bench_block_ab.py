"""bench.block_ab on the CPU: each tree runs in its own process with its own sonic, the same inputs give the same
checksums from two copies of one tree, and bad trees are refused with what to give instead."""
import json
import shutil
from pathlib import Path

import pytest

from bench import block_ab

REPO = Path(block_ab.__file__).resolve().parents[1]


def test_two_copies_of_a_tree_run_apart_and_agree(tmp_path):
    copy = tmp_path / "copy"
    for part in ("sonic", "configs"):
        shutil.copytree(REPO / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab.json"
    block_ab.main(["--tree", f"here={REPO}", "--tree", f"copy={copy}", "--device", "cpu", "--backend", "reference",
                   "--shape", "64,32,16,4,2", "--seq-len", "32", "--rounds", "1", "--json", str(out)])
    r = json.loads(out.read_text())
    (rnd,) = r["rounds"]
    assert Path(rnd["here"]["sonic"]) == REPO / "sonic" and Path(rnd["copy"]["sonic"]) == copy / "sonic"
    here, there = (rnd[t]["configs"]["64,32,16,4,2"] for t in ("here", "copy"))
    assert here["check"] == there["check"] and here["check"]["out_abs"] > 0
    assert here["fwd_ms"] > 0 and here["fb_ms"] > 0 and here["issue_ms"]["fb"] > 0
    assert r["command"] and r["configs"] == {"64,32,16,4,2": [64, 32, 16, 4, 2]}


@pytest.mark.parametrize("trees", [["a=."], ["a=.", "b=/nonexistent"], ["a", "b=."]])
def test_bad_trees_are_refused(trees, capsys):
    with pytest.raises(SystemExit):
        block_ab.main([f"--tree={t}" for t in trees] + ["--device", "cpu"])
    assert "--tree" in capsys.readouterr().err
