"""The repro experiment configs compose and keep the properties the reproduction relies on."""
from __future__ import annotations

import dataclasses

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


def test_reduced_run_keeps_the_papers_model_and_per_gpu_batch():
    paper = compose_config("experiment=tr_0p5b")
    cfg = compose_config("experiment=repro_tr_0p5b_reduced")
    m, pm = cfg.model, paper.model
    assert dataclasses.replace(m.moe, kernel_backend=pm.moe.kernel_backend) == pm.moe  # E, K, n, routing, aux
    assert (m.dim, m.num_layers, m.num_heads) == (pm.dim, pm.num_layers, pm.num_heads)
    assert (cfg.train.micro_batch_size, cfg.train.seq_len) == (paper.train.micro_batch_size, paper.train.seq_len)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.schedule) == \
        (paper.optim.lr, paper.optim.weight_decay, paper.optim.schedule)
    assert cfg.optim.warmup_steps == cfg.train.steps // 10  # the paper's 10% warmup
    assert m.vocab_size >= 259 and cfg.data.tokenizer == "byte"
