"""bench.triton_gemm_ab on CPU under Triton's interpreter: both paths (pointer, TMA) of each of the triton backend's
expert products run for each tile config, and each matches the torch product of the same operands."""
import json

import pytest

from tests.helpers import run_in_triton_interpreter


def _records(tmp_path, *args: str) -> list[dict]:
    """bench.triton_gemm_ab's records for a small shape, run in the interpreter with these extra arguments."""
    path = tmp_path / "ab.json"
    argv = ["--configs", "", "--shape", "40,64,48,3,2", "--device", "cpu", "--json", str(path), *args]
    call = ("from tests.helpers import patch_triton_interpreter; patch_triton_interpreter(); "
            f"import bench.triton_gemm_ab as b; b.main({argv!r}); print('ab ok')")
    run_in_triton_interpreter(call, "ab ok")
    return json.loads(path.read_text())["records"]


def test_both_paths_match_the_torch_product(tmp_path):
    records = _records(tmp_path, "--tiles", "16x32x16x4x1,32x32x16x4x1")
    assert {(r["kernel"], r["path"], r["tile"]) for r in records} == {
        (k, p, t) for k in ("up", "down", "dxt", "dh", "dw1", "dw2") for p in ("pointer", "tma")
        for t in ("Config(bm=16, bn=32, bk=16, warps=4, stages=1)", "Config(bm=32, bn=32, bk=16, warps=4, stages=1)")
        if (k, p) != ("dh", "tma")}  # dH has one path
    assert all(r["max_err"] < 1e-4 and r["ms"] is None for r in records), records


def test_paths_and_rounds_pick_the_runs(tmp_path):
    records = _records(tmp_path, "--tiles", "16x32x16x4x1,32x32x16x4x1", "--products", "dw1,dh", "--paths", "tma",
                       "--rounds", "2")
    # each round starts one run later; dH has one path
    assert [(r["kernel"], r["path"], r["round"], r["tile"][10:12]) for r in records] == [
        ("dw1", "tma", 0, "16"), ("dw1", "tma", 0, "32"), ("dw1", "tma", 1, "32"), ("dw1", "tma", 1, "16"),
        ("dh", "pointer", 0, "16"), ("dh", "pointer", 0, "32"), ("dh", "pointer", 1, "32"), ("dh", "pointer", 1, "16")]


def test_bad_arguments_are_named():
    import bench.triton_gemm_ab as b
    with pytest.raises(ValueError, match="--paths gpu"):
        b.main(["--paths", "gpu", "--device", "cpu"])
    with pytest.raises(ValueError, match="--rounds 0"):
        b.main(["--rounds", "0", "--device", "cpu"])
