"""Training FLOPs per token (the MFU numerator): the sonic_7b worked example of docs/performance.md."""
import pytest

from sonic.models import flops_per_token, training_flops
from tests.helpers import compose_config

# sonic_7b (configs/model/sonic_7b.yaml): d 1536, 40 layers, 24 heads of 64, E 128, K 8, n 256,
# shared expert 1024, V 100352, tied embeddings, full-width q/k norms; seq 4096.
D, L, H, HD, E, K, N, SHARED, V, S = 1536, 40, 24, 64, 128, 8, 256, 1024, 100352, 4096


def test_sonic_7b_worked_example():
    attn = 4 * D * H * HD + 2 * H * HD  # q, k, v, o projections + the q/k norms
    per_layer = attn + 2 * D + E * D + K * 3 * D * N + 3 * D * SHARED  # + block norms, router, K experts, shared
    matmul = 6 * (L * per_layer + V * D + D)  # + the tied LM head, the final norm; the lookup is not a matmul
    attention = 12 * L * H * HD * S  # QK^T and PV over the S x S scores, forward (4 S H hd) and backward (x3)
    assert (matmul, attention) == (6_635_824_128, 3_019_898_880)  # the numbers docs/performance.md shows

    flops = training_flops(compose_config("model=sonic_7b").model, S)
    assert (flops.matmul, flops.attention) == (matmul, attention)
    assert flops.full == matmul + attention == 9_655_723_008
    assert flops.causal == matmul + attention // 2 == 8_145_773_568


@pytest.mark.parametrize("seq_len", [128, 4096])
def test_flops_per_token_counts_full_or_causal_attention(seq_len):
    cfg = compose_config("model=sonic_7b").model
    flops = training_flops(cfg, seq_len)
    assert flops_per_token(cfg, seq_len) == flops.full  # the default keeps the `mfu` metric's meaning
    assert flops_per_token(cfg, seq_len, causal=True) == flops.causal
    assert flops.full - flops.causal == 6 * L * H * HD * seq_len
