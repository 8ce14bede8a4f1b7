"""Expert parallelism (parallel.ep) on CPU processes (gloo): `pytest -k expert_parallel`.

Against one process holding the whole batch:
  - the token-rounding plan under an ep group picks exactly the rows one process picks (ties included);
  - forward, loss and every parameter's gradient of the sharded model match, for top-K and token
    rounding, at ep=2 of 2 ranks, ep=2 of 4 (FSDP over efsdp=2), ep=4 of 4 and HSDP x ep=2;
  - the dispatch alone, with a rank that receives no token, matches and keeps only X and H for backward;
  - training steps give the same losses at ep=1 and ep=2, checkpoints load across ep, and a
    compiled ep=2 model compiles no new graphs as the split sizes change.
Bad ep values give a ValueError.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.parallel import DistInfo, ParallelConfig, build_model
from sonic.parallel.distributed import experts_mesh
from sonic.routing import RoutingConfig, select_topk, token_rounding_plan
from sonic.train.optim import clip_grad_norm
from tests.helpers import compose_config, free_port, spawn_ranks

SEED, B, S = 3, 2, 16
CPU = torch.device("cpu")
MODEL = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, max_seq_len=32, first_k_dense=0,
                    moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, shared_expert_dim=8,
                                  kernel_backend="reference", routing=RoutingConfig(aux_loss_coef=0.01)))
TR = replace(MODEL, moe=replace(MODEL.moe, routing=RoutingConfig(method="token_rounding", tile_size=4,
                                                                   aux_loss_coef=0.01)))
# name: (world, dp_replicate, ep, model); token rounding only where the ep group is the whole batch
GRAD_CASES = {"ep2_of_2": (2, 1, 2, MODEL), "ep2_of_2_tr": (2, 1, 2, TR), "ep4_of_4_tr": (4, 1, 4, TR),
              "ep2_of_4": (4, 1, 2, MODEL), "hsdp_ep2_of_4": (4, 2, 2, MODEL), "fsdp_of_2": (2, 1, 1, MODEL)}
PLAN_MODES = ("nearest", "balance", "up", "down")


def batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 64, (world * B, S), generator=g)
    return ids, torch.randint(0, 64, (world * B, S), generator=g)


def reference_grads(cfg: ModelConfig, world: int) -> tuple[float, dict[str, torch.Tensor], float]:
    """Loss, gradients and grad norm of one process on all ranks' batches."""
    model = Transformer(cfg)
    model.init_weights(SEED)
    model.train()
    ids, labels = batch(world)
    out = model(ids, None, labels)
    (out.loss + out.router_loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.item(), grads, torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")


def _sharded_grads(rank: int, world: int, dp_replicate: int, ep: int, cfg: ModelConfig) -> dict:
    mesh = init_device_mesh("cpu", (dp_replicate, world // dp_replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
    info = DistInfo(rank, world, rank, CPU, mesh, experts_mesh=experts_mesh(mesh, ep))
    model = build_model(cfg, ParallelConfig(dp_replicate=dp_replicate, ep=ep), info, seed=SEED)
    model.train()
    ids, labels = batch(world)
    mine = slice(rank * B, (rank + 1) * B)
    out = model(ids[mine], None, labels[mine])
    (out.loss + out.router_loss).backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    norm, _ = clip_grad_norm(model.parameters(), float("inf"))
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() if isinstance(p.grad, DTensor)
             else p.grad for n, p in model.named_parameters()}
    return {"loss": loss.item() / world, "grads": grads, "norm": norm.item(),
            "local_experts": tuple(model.layers[0].ffn.w1_EFD.to_local().shape)}


def _plans(rank: int, world: int, group) -> dict:
    """Per mode: this rank's rows as (token in the group's batch, expert, gate), under `group`."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    T, E, K, tile = 13, 8, 2, 4
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(ranks * T, E, generator=g)
    logits[: T // 2] = 0.0  # identical rows: ties that only the token order breaks
    out = {}
    for mode in PLAN_MODES:
        for k in (1, K):  # K=1 under topk_softmax: every top-K gate is 1, ties between all TC picks
            mine = logits[me * T:(me + 1) * T]
            probs = mine.softmax(-1)
            topk = select_topk(mine, torch.zeros(mine.shape[1]), k, "topk_softmax", False)
            residual = torch.arange(E) % 3 - 1
            plan = token_rounding_plan(probs, topk.expert_idx_TK, topk.gates_TK, tile, mode, residual, group).plan
            rows = torch.stack([plan.token_idx_R.double() + me * T, plan.expert_idx_R.double(), plan.scores_R.double()], 1)
            padded = torch.full((T * E, 3), -1.0, dtype=torch.float64)  # gloo gathers equal sizes
            padded[: rows.shape[0]] = rows
            parts = [torch.empty_like(padded) for _ in range(ranks)]
            dist.all_gather(parts, padded, group=group)
            rows = torch.cat(parts)
            out[(mode, k)] = (rows[rows[:, 0] >= 0], logits)
    return out


def _skewed_dispatch(rank: int, world: int) -> dict:
    """AllToAllDispatch alone, every token routed to rank 0's experts: rank 1 receives no token."""
    from sonic.kernels import reference
    from sonic.models.dispatch import AllToAllDispatch
    from sonic.routing import plan_from_topk

    T, D, N, E = 5, 8, 4, 2 * world
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(world * T, D, generator=g, dtype=torch.float64)
    w1, w2 = torch.randn(E, 2 * N, D, generator=g, dtype=torch.float64), torch.randn(E, D, N, generator=g, dtype=torch.float64)
    scores = torch.rand(world * T, 2, generator=g, dtype=torch.float64)
    experts = torch.tensor([[0, 1]]).expand(world * T, 2)
    dout = torch.randn(world * T, D, generator=g, dtype=torch.float64)
    mine = slice(rank * T, (rank + 1) * T)
    leaves = [t[mine].clone().requires_grad_() for t in (x, scores)] + [
        t[2 * rank:2 * rank + 2].clone().requires_grad_() for t in (w1, w2)]
    plan = plan_from_topk(experts[mine], leaves[1], E)
    saved = []  # what backward keeps: float matrices (the weights are 3-D)

    def pack(t):
        if t.is_floating_point() and t.dim() == 2:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = AllToAllDispatch(dist.group.WORLD, E)(reference.experts, leaves[0], leaves[2], leaves[3], plan,
                                                    None, None)
    out.backward(dout[mine])
    return {"out": out.detach(), "grads": [t.grad for t in leaves], "inputs": (x, w1, w2, scores, experts, dout),
            "saved": sorted(set(saved))}


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    _init(rank, world, port)
    results = {"grads": {}, "plans": {}, "skewed": [None] * world}
    for name, (case_world, dp_replicate, ep, cfg) in GRAD_CASES.items():
        if case_world == world:
            results["grads"][name] = _sharded_grads(rank, world, dp_replicate, ep, cfg)
    results["plans"]["world"] = _plans(rank, world, dist.group.WORLD)
    dist.all_gather_object(results["skewed"], _skewed_dispatch(rank, world))
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def spawned(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"expert_parallel_{world}") / "results.pt"
    spawn_ranks(_worker, (world, free_port(), str(out)), world, 600, "expert-parallel")
    return world, torch.load(out, weights_only=False)


def test_expert_parallel_gradients_match_one_process(spawned):
    world, results = spawned
    cases = {n: c for n, c in GRAD_CASES.items() if c[0] == world}
    assert cases.keys() == results["grads"].keys()
    for name, (_, _, ep, cfg) in cases.items():
        got = results["grads"][name]
        loss, grads, norm = reference_grads(cfg, world)
        assert got["local_experts"][0] == cfg.moe.num_experts // (ep if ep > 1 else world), name  # FSDP: dim 0
        assert got["loss"] == pytest.approx(loss, rel=1e-5), name
        assert got["grads"].keys() == grads.keys(), name
        for n in grads:
            torch.testing.assert_close(got["grads"][n], grads[n], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name, n=n: f"{name}: {n}: {m}")
        assert got["norm"] == pytest.approx(norm, rel=1e-5), name


def test_expert_parallel_token_rounding_plan_matches_one_process(spawned):
    world, results = spawned
    for (mode, k), (rows, logits) in results["plans"]["world"].items():
        probs = logits.softmax(-1)
        topk = select_topk(logits, torch.zeros(logits.shape[1]), k, "topk_softmax", False)
        E = logits.shape[1]
        residual = torch.arange(E) % 3 - 1
        want = token_rounding_plan(probs, topk.expert_idx_TK, topk.gates_TK, 4, mode, residual).plan
        live = want.live_rows()  # one process pads its plan to a bound (sonic/routing/plan.py); the ep path does not
        want_rows = torch.stack([want.token_idx_R.double(), want.expert_idx_R.double(), want.scores_R.double()], 1)[:live]
        order = lambda r: r[torch.argsort(r[:, 1] * 10**6 + r[:, 0])]  # noqa: E731
        torch.testing.assert_close(order(rows), order(want_rows), rtol=0, atol=1e-6, msg=f"{mode}, K={k}")
        assert (torch.bincount(rows[:, 1].long(), minlength=E) % 4 == 0).all() or mode == "up"


TRAIN = ["model=tiny", "model.num_layers=2", "train.micro_batch_size=2", "train.seq_len=32", "train.log_every=1",
         "train.eval_every=0", "train.progress=false", "optim.warmup_steps=0"]


def _train_worker(rank: int, port: int, root: str) -> None:
    """Train at ep=1 and ep=2 (6 steps, saving), then resume each run's checkpoint at the other ep."""
    from sonic.train.trainer import train

    _init(rank, 2, port)
    losses = {}
    for ep, steps, run in ((1, 6, "ep1"), (2, 6, "ep2"), (2, 8, "ep1"), (1, 8, "ep2")):
        cfg = compose_config(*TRAIN, f"parallel.ep={ep}", f"train.steps={steps}", "train.save_every=6",
                             f"train.run_dir={root}/{run}")
        losses[(run, ep, steps)] = [(m["step"], m["loss"], m["grad_norm"]) for m in train(cfg)]
    losses["graphs"] = _compiled_graphs(rank)
    if rank == 0:
        torch.save(losses, f"{root}/losses.pt")
    dist.barrier()
    dist.destroy_process_group()


def _compiled_graphs(rank: int) -> list[int]:
    """Dynamo's graph count after each of 5 forward/backward steps of a compiled ep=2 model on fresh batches."""
    from torch._dynamo.utils import counters

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    info = DistInfo(rank, 2, rank, CPU, mesh, experts_mesh=experts_mesh(mesh, 2))
    model = build_model(MODEL, ParallelConfig(ep=2, compile=True, compile_backend="aot_eager"), info, seed=SEED)
    graphs = []
    for step in range(5):
        ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(rank * 100 + step))
        out = model(ids, None, ids)
        (out.loss + out.router_loss).backward()
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def test_expert_parallel_training_matches_fsdp_and_resumes_across_ep(tmp_path):
    spawn_ranks(_train_worker, (free_port(), str(tmp_path)), 2, 600, "expert-parallel training")
    losses = torch.load(tmp_path / "losses.pt", weights_only=False)
    # a compiled ep=2 model runs and settles: the changing split sizes compile no new graphs
    assert losses["graphs"][0] > 0 and losses["graphs"][2:] == [losses["graphs"][1]] * 3, losses["graphs"]
    fsdp, ep = losses[("ep1", 1, 6)], losses[("ep2", 2, 6)]
    assert [s for s, _, _ in ep] == list(range(1, 7))
    for (_, a, ga), (_, b, gb) in zip(fsdp, ep):
        assert a == pytest.approx(b, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)
    # ep=1's checkpoint resumed at ep=2 and ep=2's at ep=1 continue alike from step 7
    resumed_at_ep2, resumed_at_ep1 = losses[("ep1", 2, 8)], losses[("ep2", 1, 8)]
    assert [s for s, _, _ in resumed_at_ep2] == [s for s, _, _ in resumed_at_ep1] == [7, 8]
    for (_, a, ga), (_, b, gb) in zip(resumed_at_ep2, resumed_at_ep1):
        assert a == pytest.approx(b, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)


def test_expert_parallel_rejects_bad_degrees():
    with pytest.raises(ValueError, match="parallel.ep=3 does not divide model.moe.num_experts=8"):
        compose_config("model=tiny", "parallel.ep=3")
    with pytest.raises(ValueError, match="parallel.ep"):
        compose_config("parallel.ep=0")
    with pytest.raises(ValueError, match="nearest_score is not supported with parallel.ep > 1"):
        compose_config("model=tiny", "parallel.ep=2", "routing=token_rounding",
                       "model.moe.routing.rounding_mode=nearest_score")
    from sonic.parallel import init_distributed

    with pytest.raises(ValueError, match="parallel.ep=2 needs 2 processes"):
        init_distributed(ParallelConfig(ep=2), "cpu")


def _bad_world_worker(rank: int, port: int) -> None:
    from sonic.parallel import init_distributed

    _init(rank, 2, port)
    try:
        with pytest.raises(ValueError, match="parallel.ep=4 does not divide the 2 ranks"):
            init_distributed(ParallelConfig(ep=4), "cpu")
    finally:
        dist.destroy_process_group()


def test_expert_parallel_degree_must_divide_the_ranks():
    spawn_ranks(_bad_world_worker, (free_port(),), 2, 120, "expert-parallel bad degree")


def test_expert_parallel_dispatch_with_a_rank_that_receives_nothing(spawned):
    from sonic.kernels import reference
    from sonic.routing import plan_from_topk

    world, results = spawned
    x, w1, w2, scores, experts, dout = results["skewed"][0]["inputs"]
    leaves = [t.clone().requires_grad_() for t in (x, scores, w1, w2)]
    out = reference.experts(leaves[0], leaves[2], leaves[3], plan_from_topk(experts, leaves[1], w1.shape[0]))
    out.backward(dout)
    T = x.shape[0] // world
    for rank, got in enumerate(results["skewed"]):
        torch.testing.assert_close(got["out"], out.detach()[rank * T:(rank + 1) * T])
        gx, gs, gw1, gw2 = got["grads"]
        torch.testing.assert_close(gx, leaves[0].grad[rank * T:(rank + 1) * T])
        torch.testing.assert_close(gs, leaves[1].grad[rank * T:(rank + 1) * T])
        # backward keeps the received tokens X (U x D) and H (Q x 2N) only: rank 0 receives every token
        # once (U = world * T) with its 2 rows (Q = 2U); no copy sent, partial sum or Y is kept
        U = world * T if rank == 0 else 0
        assert got["saved"] == sorted({(U, x.shape[1]), (2 * U, w1.shape[1])}), got["saved"]
        # an expert's gradient is taken 1/world of (FSDP's average over ranks completes the mean)
        for got_w, ref_w in ((gw1, leaves[2].grad), (gw2, leaves[3].grad)):
            torch.testing.assert_close(got_w * world, ref_w[2 * rank:2 * rank + 2])
