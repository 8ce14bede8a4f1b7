"""bench/cute_gemm.py's sweep order (the script itself needs a Hopper GPU and CuTe DSL)."""
from bench.cute_gemm import sweep_rounds


def test_sweep_rounds_rotate_which_candidate_runs_first():
    """Each round times every candidate once, starting one later than the round before, so a candidate is not
    always first (when clocks are still settling): a sweep that timed them in a fixed order favoured the last."""
    calls = []
    out = sweep_rounds(["a", "b", "c"], 4, lambda c: calls.append(c) or float(len(calls)))
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert out == {"a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0], "c": [3.0, 5.0, 7.0, 12.0]}
    assert sweep_rounds(["only"], 1, lambda c: 2.5) == {"only": [2.5]}


def test_official_without_the_package_says_what_is_missing(monkeypatch):
    """--official on a machine without sonic-moe ends with a message naming the package, not a traceback."""
    import sys

    import pytest

    from bench.cute_gemm import official_calls
    monkeypatch.setitem(sys.modules, "sonicmoe", None)
    monkeypatch.setitem(sys.modules, "sonicmoe.functional", None)
    with pytest.raises(SystemExit, match="--official needs the official sonic-moe package"):
        official_calls(*[None] * 7)


def test_rounded_plan_runs_whole_tiles_of_the_same_logits():
    """--plan rounded (and the sparse sweep) routes the same logits with token rounding: every expert's live rows a
    multiple of 128, about as many rows as top-K's; the top-K plan of the same logits has partial tiles (else the
    comparison shows nothing)."""
    import torch

    from bench.moe_layer import sparse_plans
    torch.manual_seed(0)
    plans = sparse_plans(torch.randn(4096, 64), 4)
    topk, rounded = plans["topk"], plans["rounded"]
    assert topk.live_rows() == 4096 * 4
    assert bool((topk.counts_E() % 128 != 0).any())
    assert bool((rounded.counts_E() % 128 == 0).all())
    assert abs(rounded.live_rows() - 4096 * 4) <= 64 * 128
