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


def test_tiles_name_a_tree_and_configs_its_kernels_can_run(capsys):
    """--tiles TAG=KIND=CFG,... is refused before any tree runs when TAG is no --tree, the backend is not cute, or a
    config is one its kernel cannot run (naming why), and parse_tiles reads a good list."""
    pytest.importorskip("cutlass")
    base = ["--tree", "a=.", "--tree", "b=.", "--device", "cpu"]
    for tiles, backend, why in (("c=up=pp128", "cute", "a TAG of --tree"), ("b=up=pp128", "reference", "--backend cute"),
                                ("b=dw2=co256c2", "cute", "share a TMA-loaded"),
                                ("b=upp=pp128", "cute", "KIND one of"), ("b=up=xx12", "cute", "expected co<tile_n>")):
        with pytest.raises(SystemExit):
            block_ab.main([*base, "--backend", backend, "--tiles", tiles])
        err = capsys.readouterr().err
        assert "--tiles" in err and any(w in err for w in why.split("|")), (tiles, err)
    assert block_ab.parse_tiles("up=pp128,dh=co256") == {"up": "pp128", "dh": "co256"}


def test_use_tiles_replaces_the_default_the_kernels_look_up(monkeypatch):
    """A child given --tiles launches its kernels with those configs: ops.default_config answers with them (and
    forgets the answers it cached before), for that kernel only."""
    pytest.importorskip("cutlass")
    from sonic.kernels.cute import ops

    monkeypatch.setattr(ops, "DEFAULTS", dict(ops.DEFAULTS))
    monkeypatch.setattr(ops, "FEW_ROWS_DEFAULTS", dict(ops.FEW_ROWS_DEFAULTS))
    ops.tile_config.cache_clear()
    before = {k: ops.default_config(k, 4096, 512) for k in ("up", "dh")}
    assert str(before["up"]) == "co256"
    assert str(ops.default_config("dx", 4096, 512, 256)) == "co256c2"  # few rows per expert: its own default
    block_ab.use_tiles(block_ab.parse_tiles("up=pp128,dx=pp192c2"))
    assert str(ops.default_config("up", 4096, 512)) == "pp128" and ops.default_config("dh", 4096, 512) == before["dh"]
    assert str(ops.default_config("dx", 4096, 512, 256)) == "pp192c2"  # the A/B's config at every row count
    assert str(ops.default_config("down", 4096, 512, 256)) == "pp128c2"  # kernels not named keep theirs
    ops.tile_config.cache_clear()  # the monkeypatch restores DEFAULTS after this test; its answers must not stay
