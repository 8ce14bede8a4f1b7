"""RoutingConfig rejects user errors with a ValueError that names the field."""
import pytest

from sonic.routing import Router, RoutingConfig


@pytest.mark.parametrize("kwargs,field", [
    (dict(method="top_k"), "routing.method"),
    (dict(order="softmax"), "routing.order"),
    (dict(rounding_mode="nr"), "routing.rounding_mode"),
    (dict(renormalize=True), "routing.renormalize"),  # with the default order=topk_softmax
    (dict(order="softmax_topk", renormalize="yes"), "routing.renormalize"),
    (dict(tile_size=0), "routing.tile_size"),
    (dict(tile_size=64.0), "routing.tile_size"),
    (dict(tile_size=True), "routing.tile_size"),
    (dict(capacity_factor=0.0), "routing.capacity_factor"),
    (dict(capacity_factor=float("nan")), "routing.capacity_factor"),
    (dict(aux_loss_coef=-0.1), "routing.aux_loss_coef"),
    (dict(z_loss_coef=-1e-3), "routing.z_loss_coef"),
    (dict(seq_aux_loss_coef=-1e-3), "routing.seq_aux_loss_coef"),
    (dict(bias_update_rate=-1e-3), "routing.bias_update_rate"),
    (dict(method="expert_choice", bias_update_rate=1e-3), "routing.bias_update_rate"),
    (dict(input_centring="mean"), "routing.input_centring"),
    (dict(logit_norm="batch"), "routing.logit_norm"),
    (dict(balance="sinkorn"), "routing.balance"),
    (dict(balance_iters=0), "routing.balance_iters"),
    (dict(balance_iters=2.0), "routing.balance_iters"),
    (dict(balance_temperature=0.0), "routing.balance_temperature"),
    (dict(balance_temperature=float("nan")), "routing.balance_temperature"),
    (dict(method="expert_choice", balance="sinkhorn"), "routing.balance"),
])
def test_invalid_field_names_itself(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        RoutingConfig(**kwargs)


def test_valid_combinations_pass():
    RoutingConfig(order="softmax_topk", renormalize=True)
    RoutingConfig(method="token_rounding", rounding_mode="balance", tile_size=64, bias_update_rate=1e-3)
    RoutingConfig(method="expert_choice", capacity_factor=1.25)
    RoutingConfig(method="token_rounding", balance="sinkhorn", balance_iters=8, balance_temperature=1.0)


@pytest.mark.parametrize("top_k", [0, 9])
def test_router_rejects_top_k_out_of_range(top_k):
    with pytest.raises(ValueError, match="moe.top_k"):
        Router(16, 8, top_k, RoutingConfig())
