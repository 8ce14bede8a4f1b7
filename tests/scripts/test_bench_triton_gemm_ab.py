"""bench.triton_gemm_ab on CPU under Triton's interpreter: both paths (pointer, TMA) of each of the triton backend's
expert products run for each tile config, and each matches the torch product of the same operands."""
import json

import pytest

from tests.helpers import run_in_triton_interpreter


def test_both_paths_match_the_torch_product(tmp_path):
    path = tmp_path / "ab.json"
    call = ("from tests.helpers import patch_triton_interpreter; patch_triton_interpreter(); "
            "import bench.triton_gemm_ab as b; "
            f"b.main(['--configs', '', '--shape', '40,64,48,3,2', '--tiles', '16x32x16x4x1,32x32x16x4x1', "
            f"'--device', 'cpu', '--json', {str(path)!r}]); print('ab ok')")
    run_in_triton_interpreter(call, "ab ok")
    records = json.loads(path.read_text())["records"]
    assert {(r["kernel"], r["path"], r["tile"]) for r in records} == {
        (k, p, t) for k in ("up", "down", "dxt", "dh", "dw1", "dw2") for p in ("pointer", "tma")
        for t in ("Config(bm=16, bn=32, bk=16, warps=4, stages=1)", "Config(bm=32, bn=32, bk=16, warps=4, stages=1)")
        if (k, p) != ("dh", "tma")}  # dH has one path
    assert all(r["max_err"] < 1e-4 and r["ms"] is None for r in records), records


def test_paths_picks_the_kernels(tmp_path):
    path = tmp_path / "ab.json"
    call = ("from tests.helpers import patch_triton_interpreter; patch_triton_interpreter(); "
            "import bench.triton_gemm_ab as b; "
            f"b.main(['--configs', '', '--shape', '40,64,48,3,2', '--tiles', '16x32x16x4x1', '--products', 'dw1,dh', "
            f"'--paths', 'tma', '--rounds', '2', '--device', 'cpu', '--json', {str(path)!r}]); print('ab ok')")
    run_in_triton_interpreter(call, "ab ok")
    records = json.loads(path.read_text())["records"]
    assert [(r["kernel"], r["path"], r["round"]) for r in records] == [
        ("dw1", "tma", 0), ("dw1", "tma", 1), ("dh", "pointer", 0), ("dh", "pointer", 1)]  # dH has one path


def test_bad_arguments_are_named():
    import bench.triton_gemm_ab as b
    with pytest.raises(ValueError, match="--paths gpu"):
        b.main(["--paths", "gpu", "--device", "cpu"])
    with pytest.raises(ValueError, match="--rounds 0"):
        b.main(["--rounds", "0", "--device", "cpu"])
