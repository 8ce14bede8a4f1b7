"""bench.centring on the CPU through Triton's interpreter: every shape and swept tile config is run, checked against
the definition and written; bad arguments are refused with what to write instead."""
import json
from pathlib import Path

import pytest
import torch

from bench import centring
from sonic.kernels.triton import centring as sonic_centring
from tests.helpers import run_in_triton_interpreter


def _run_and_check(out: str, baseline: str) -> None:
    """In the interpreter's process: two shapes, the default config, one swept config and a baseline module."""
    from tests.helpers import patch_triton_interpreter

    patch_triton_interpreter()
    centring.main(["--shapes", "128x64x16,64x32x8", "--seq-len", "32", "--sweep", "16,32,4", "--profile", "2",
                   "--baseline", baseline, "--json", out])
    r = json.loads(open(out).read())
    assert [(row["T"], row["D"], row["E"]) for row in r["rows"]] == [(128, 64, 16), (64, 32, 8)]
    for row in r["rows"]:
        assert [c["cfg"] for c in row["configs"]] == ["default", {"BS": 16, "BD": 32, "num_warps": 4}, "baseline"]
        assert row["default"]["backward"]["BE"] >= row["E"]  # the experts, padded to a power of two
        for c in row["configs"]:
            assert c["fwd"] > 0 and c["bwd"] > 0 and 0 < c["err"] < 1e-2  # bf16's rounding of c, not a wrong sum
        for way in ("fwd", "bwd"):  # on the CPU the host ops' times (dW's product among them), on a GPU kernels'
            p = row["profile"][way]
            assert p["kernels_us"] and all(us > 0 for us in p["kernels_us"].values()) and p["idle_us"] >= 0, p
        assert "aten::mm" in row["profile"]["bwd"]["kernels_us"]
    assert r["command"] and r["commit"] and r["baseline"] == baseline
    print("centring bench ok")


def test_the_bench_times_and_checks_every_config_in_the_interpreter(tmp_path):
    out, baseline = str(tmp_path / "c.json"), tmp_path / "old_centring.py"
    baseline.write_text(Path(sonic_centring.__file__).read_text())  # any version of the module would do
    run_in_triton_interpreter(f"import tests.scripts.test_bench_centring as t; t._run_and_check({out!r}, "
                              f"{str(baseline)!r})", "centring bench ok")


def test_bad_arguments_are_refused(monkeypatch):
    for bad in ("64,64", "64,64,4,3,1", "64,64,x"):
        with pytest.raises(SystemExit, match="BS,BD,num_warps"):
            centring._parse_sweep(bad)
    assert centring._parse_sweep("32,64,4/64,64,4,3") == [{"BS": 32, "BD": 64, "num_warps": 4},
                                                           {"BS": 64, "BD": 64, "num_warps": 4, "num_stages": 3}]
    with pytest.raises(SystemExit, match="git show"):
        centring.load_baseline("/nonexistent/centring.py")
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
            centring.main(["--shapes", "64x32x8", "--seq-len", "32"])
