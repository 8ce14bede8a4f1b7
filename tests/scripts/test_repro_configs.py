"""The repro experiment configs compose and keep the properties the reproduction relies on."""
from __future__ import annotations

import pytest

from tests.helpers import compose_config


def test_proxy_keeps_the_papers_tile_requirement():
    cfg = compose_config("experiment=repro_tr_proxy")
    moe, t = cfg.model.moe, cfg.train
    assert moe.top_k / moe.num_experts == 8 / 64  # the 0.5B 8/64 ratio
    tokens = t.micro_batch_size * t.seq_len
    assert tokens * moe.top_k / moe.num_experts / moe.routing.tile_size >= 2  # PAPER.md: T̄e / M_tile >= 2


@pytest.mark.parametrize("arm, method, mode", [("repro_tr_0p5b_topk", "topk", "nearest"),
                                               ("repro_tr_0p5b_nrf", "token_rounding", "nearest"),
                                               ("repro_tr_0p5b_drop", "token_rounding", "down")])
def test_table3a_arms_differ_only_in_routing(arm, method, mode):
    base = compose_config("experiment=tr_0p5b")
    cfg = compose_config(f"experiment={arm}")
    assert (cfg.model.moe.routing.method, cfg.model.moe.routing.rounding_mode) == (method, mode)
    assert cfg.train.run_dir == f"runs/tr_0p5b_{method}_{mode}"
    assert (cfg.model.moe.num_experts, cfg.model.moe.top_k, cfg.optim, cfg.train.steps) == \
        (base.model.moe.num_experts, base.model.moe.top_k, base.optim, base.train.steps)
