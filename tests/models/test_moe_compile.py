"""torch.compile keeps the whole MoE block in one graph: the experts are one custom op (sonic::experts), the
routing is traceable (token rounding's data-dependent selection is one custom op too, its plan padded to a
bound), so there is no graph break, and a change in how many rows each expert gets (the routing counts)
compiles nothing new. On CPU with the reference experts and the torch routing backend."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from sonic.models import MoEConfig
from sonic.models.moe import MoE
from sonic.routing import RoutingConfig

D, E, K, T = 32, 8, 2, 64


def block(**routing) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, MoEConfig(num_experts=E, top_k=K, expert_dim=16, shared_expert_dim=24, kernel_backend="reference",
                           routing=RoutingConfig(**routing)))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe.train()


def step(moe, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, routed = moe(x_BSD)
    loss = out.square().mean() + routed.loss
    loss.backward()
    return out.detach(), routed.counts_E, moe.router.weight_ED.grad.clone()


@pytest.mark.parametrize("routing", [dict(), dict(order="softmax_topk", renormalize=True, z_loss_coef=0.1),
                                     dict(input_centring="prefix", seq_aux_loss_coef=0.01),
                                     dict(input_centring="prefix", balance="sinkhorn"),
                                     dict(input_centring="prefix", logit_norm="prefix"),
                                     dict(method="token_rounding", tile_size=8),
                                     dict(method="token_rounding", tile_size=8, rounding_mode="nearest_score")])
def test_block_compiles_to_one_graph_and_matches_eager(routing):
    torch._dynamo.reset()
    eager, compiled = block(**routing), block(**routing)
    compiled.resolve_backends(torch.device("cpu"))  # as sonic.parallel.build_model does
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(compiled, backend=counter, fullgraph=True)  # fullgraph: a graph break is an error
    counts = set()
    for i in range(4):
        x = torch.randn(2, T // 2, D, generator=torch.Generator().manual_seed(i))
        x[:, :, i] += 3.0 * i  # skews the routing differently each time
        for m in (eager, compiled):
            m.zero_grad()
        want = step(eager, x)
        got = _step_compiled(fn, compiled, x)
        counts.add(tuple(got[1].tolist()))
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-6)
    assert len(counts) == 4, "the routing counts must change for the test to mean anything"
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: the changing counts recompiled"
    names = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert any("sonic.experts" in n for n in names), names  # the experts are the custom op, in the graph
    torch._dynamo.reset()


def _step_compiled(fn, moe, x):
    out, routed = fn(x)
    (out.square().mean() + routed.loss).backward()
    return out.detach(), routed.counts_E, moe.router.weight_ED.grad.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("routing", [dict(), dict(method="token_rounding", tile_size=16),
                                     dict(input_centring="prefix", seq_aux_loss_coef=0.01),
                                     dict(input_centring="prefix", balance="sinkhorn"),
                                     dict(input_centring="prefix", logit_norm="prefix")])
def test_block_compiles_with_inductor_on_gpu(routing):
    """The trainer's per-block compile (inductor) on the GPU, in one graph. The triton routing backend's ops, token
    rounding's route among them, are the traced ones (sonic/ops.py), whose kernels inductor launches, and match
    eager."""
    torch._dynamo.reset()
    eager = block(**routing).cuda()
    compiled = block(**routing).cuda()
    compiled.resolve_backends(torch.device("cuda", torch.cuda.current_device()))  # triton routing, reference experts
    counter = CompileCounterWithBackend("inductor")
    fn = torch.compile(compiled, backend=counter, fullgraph=True)
    for i in range(3):
        x = torch.randn(2, 256, D, generator=torch.Generator().manual_seed(i)).cuda()
        want, got = step(eager, x), _step_compiled(fn, compiled, x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-5)
    names = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    routing_ops = [n.split(".")[1] for n in names if n.startswith("sonic.") and "experts" not in n]
    assert routing_ops and all("_traced" in n for n in routing_ops), names
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_transformer_block_is_one_graph_with_each_kernel_backend(backend):
    """The trainer compiles each block without fullgraph (sonic/parallel/parallelize.py), so a graph break inside
    an expert backend splits every block silently. The cute backend's check of its own availability on each call
    (importlib's find_spec) did: five graphs per layer, each with its own host overhead, and no fusion across."""
    from sonic.kernels import resolve_backend
    from sonic.models import ModelConfig, Transformer
    from sonic.models.presets import load_preset

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        resolve_backend(backend, device)
    except ValueError as err:
        pytest.skip(str(err))
    # sonic_7b's block (its routing: prefix centring, aux loss, expert bias) at the cute tests' kernel shapes
    cfg = ModelConfig(vocab_size=128, dim=256, num_layers=1, num_heads=4, max_seq_len=256, qk_norm="full",
                      tie_embeddings=True,
                      moe=MoEConfig(num_experts=8, top_k=2, expert_dim=128, shared_expert_dim=64,
                                    kernel_backend=backend, routing=load_preset("sonic_7b").moe.routing))
    torch._dynamo.reset()
    eager, compiled = (Transformer(cfg).to(device) for _ in range(2))
    for model in (eager, compiled):
        model.init_weights(seed=0)
        model.layers[0].ffn.resolve_backends(device)
    counter = CompileCounterWithBackend("inductor")
    compiled.layers[0].compile(backend=counter, fullgraph=True)  # fullgraph: a graph break is an error
    counts = set()
    for i in range(3):
        ids = torch.randint(0, 128, (2, 256), generator=torch.Generator().manual_seed(i)).to(device)
        ids[:, ::2] = i  # skews the routing differently each time
        got, want = [], []
        for model, into in ((eager, want), (compiled, got)):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids, labels_BS=ids)
            (out.loss + out.router_loss).backward()
            into += [out.loss.detach(), model.layers[0].ffn.w1_EFD.grad, out.routed[0].counts_E]
        counts.add(tuple(got[2].tolist()))
        torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=0)
        assert (got[1] - want[1]).norm() <= 5e-2 * want[1].norm()
    assert len(counts) == 3, "the routing counts must change for the test to mean anything"
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: the changing counts recompiled"
    torch._dynamo.reset()
