"""bench.routing_at_init on CPU: the residual stream's RMS after every block is the forward's own, with the
model's embed_scale applied, and the loads and loss come from the same forward."""
import math

import torch

from bench.routing_at_init import measure
from sonic.models import ModelConfig, MoEConfig, Transformer


def test_residual_rms_is_the_rms_after_each_block_of_the_same_forward():
    cfg = ModelConfig(vocab_size=128, dim=32, num_layers=3, num_heads=2, max_seq_len=16, tie_embeddings=True,
                      embed_scale=4.0, moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16, kernel_backend="naive"))
    model = Transformer(cfg).eval()
    model.init_weights(seed=0)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    rows, loss, rms = measure(model, ids)

    want = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        x = model.embed(ids[:, :-1])
        mask = model.attn_core.mask(None, 16, ids.device)
        for block in model.layers:
            x, _ = block(x, model.rotary, mask)
            want.append(x.float().square().mean().sqrt().item())
    assert rms == want and len(rows) == 3 and math.isfinite(loss)
    assert model.embed(ids).float().std() > 3 * model.embed_tokens(ids).float().std()  # the scale is in it
