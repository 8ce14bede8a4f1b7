"""bench.cute_cache: fills a cache folder on the CPU with the kernels a config takes, names them back from the
files (its --from), and loads what is already there instead of compiling it again."""
import os

import pytest

from bench import cute_cache

SHAPE = (256, 64, 32, 4, 2)  # T, d, n, E, K: a small class (each kernel compiles in a second or two)


def _dsl_reason():
    from sonic.kernels import cute
    return cute._cutlass_reason()


needs_dsl = pytest.mark.skipif(_dsl_reason() is not None, reason=f"{_dsl_reason()}; pip install -e '.[dev]' has it")


@needs_dsl
def test_fills_a_config_and_names_every_file_back(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cache"
    assert cute_cache.main(["--out", str(out), "--shape", ",".join(map(str, SHAPE)), "--jobs", "2"]) == 0
    assert "(8 compiled, 0 already there)" in capsys.readouterr().out  # six GEMMs and two gather-sums, 2 processes
    files = sorted(p.name for p in out.iterdir() if p.suffix == ".o")
    assert len(files) == 8
    # every file names its kernel back (--from), as the config's own list has it
    assert sorted(map(cute_cache.kernels_of_object, files), key=str) == sorted(
        cute_cache.kernels_of_config(SHAPE, 132), key=str)
    # a second fill from those files loads them all and compiles none, and leaves this process's cache setting
    monkeypatch.setenv("SONIC_CUTE_CACHE_DIR", "off")
    assert cute_cache.main(["--out", str(out), "--from", str(out)]) == 0
    assert os.environ["SONIC_CUTE_CACHE_DIR"] == "off"
    assert "(0 compiled, 8 already there)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".o") == files


def test_object_names_parse_to_kernels_and_other_files_to_none():
    assert cute_cache.kernels_of_object("sonic_dw1_bfloat16_D1536_N256_E128_co128m256_sm132_6bf0aa532dce98a2.o") == (
        "gemm", "dw1", "bfloat16", 1536, 256, 128, "co128m256", 132)
    assert cute_cache.kernels_of_object("sonic_down_float16_D64_N32_E4_pp192c2s_sm132_0123456789abcdef.o") == (
        "gemm", "down", "float16", 64, 32, 4, "pp192c2s", 132)
    assert cute_cache.kernels_of_object("sonic_gather_sum_bfloat16_D4096_w1_l4_6bf0aa532dce98a2.o") == (
        "gather_sum", "bfloat16", 4096, True, 4)
    for other in (".sonic_up_bfloat16_D64_N32_E4_pp128_sm132_6bf0aa532dce98a2.123.o",  # an export in progress
                  "sonic_up_bfloat16_D64_N32_E4_pp128_sm132.o", "notes.txt"):
        assert cute_cache.kernels_of_object(other) is None


@needs_dsl
def test_bad_input_names_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cute_cache.main(["--out", str(tmp_path / "c"), "--from", str(tmp_path / "missing")])
    assert "not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cute_cache.main(["--out", str(tmp_path / "c"), "--configs", "9B"])
    assert "unknown config '9B'" in capsys.readouterr().err
