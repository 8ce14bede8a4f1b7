"""RoutingPlan construction: rows sorted by (expert, token), offsets and per-token index consistent."""
import pytest
import torch

from sonic.routing.plan import build_plan, plan_from_topk


def check_plan(plan, token_idx, expert_idx, scores, T, E):
    R = token_idx.numel()
    assert plan.num_rows == R and plan.num_tokens == T and plan.num_experts == E
    key = plan.expert_idx_R.long() * T + plan.token_idx_R.long()
    assert (key[1:] > key[:-1]).all()  # sorted by expert then token, no duplicate pair
    assert plan.counts_E().tolist() == torch.bincount(expert_idx, minlength=E).tolist()
    off = plan.expert_offsets_E1.tolist()
    for e in range(E):
        assert (plan.expert_idx_R[off[e]:off[e + 1]] == e).all()
    # the same (token, expert, score) triples, reordered
    given = sorted(zip(token_idx.tolist(), expert_idx.tolist(), scores.tolist()))
    got = sorted(zip(plan.token_idx_R.tolist(), plan.expert_idx_R.tolist(), plan.scores_R.tolist()))
    assert given == got
    # rows_by_token_R groups each token's rows, delimited by token_offsets_T1
    toff = plan.token_offsets_T1.tolist()
    by_tok = plan.rows_by_token_R.long()
    assert sorted(by_tok.tolist()) == list(range(R))
    for t in range(T):
        assert (plan.token_idx_R[by_tok[toff[t]:toff[t + 1]]] == t).all()
    assert toff[-1] == R
    for t_ in (plan.token_offsets_T1, plan.expert_offsets_E1, plan.token_idx_R, plan.rows_by_token_R):
        assert t_.dtype == torch.int32


@pytest.mark.parametrize("T,E,p", [(50, 8, 0.3), (1, 4, 1.0), (30, 16, 0.05), (20, 4, 0.0)])
def test_build_plan_from_random_pairs(T, E, p):
    gen = torch.Generator().manual_seed(T * E)
    tok, exp = (torch.rand(T, E, generator=gen) < p).nonzero(as_tuple=True)
    scores = torch.rand(tok.numel(), generator=gen)
    check_plan(build_plan(tok, exp, scores, T, E), tok, exp, scores, T, E)


def test_plan_from_topk_keeps_score_gradients():
    T, E, K = 12, 6, 3
    idx = torch.randn(T, E).topk(K, -1).indices
    s = torch.rand(T, K, requires_grad=True)
    plan = plan_from_topk(idx, s, E)
    check_plan(plan, torch.arange(T).repeat_interleave(K), idx.reshape(-1), s.detach().reshape(-1), T, E)
    (plan.scores_R * torch.arange(plan.num_rows)).sum().backward()
    assert s.grad is not None and (s.grad != 0).sum() == T * K - 1  # row 0 has weight 0


def test_nbytes_counts_every_tensor():
    T, E, K = 10, 4, 2
    plan = plan_from_topk(torch.randn(T, E).topk(K, -1).indices, torch.rand(T, K), E)
    R = T * K
    assert plan.nbytes == 4 * R * 4 + 4 * (E + 1) + 4 * (T + 1)  # scores + 3 int32 rows + offsets
