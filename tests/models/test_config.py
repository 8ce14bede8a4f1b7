"""ModelConfig / MoEConfig check every backend name against its family's Registry, at config time."""
import pytest

from sonic.models import ModelConfig, MoEConfig


@pytest.mark.parametrize("build,choices", [
    (lambda: MoEConfig(kernel_backend="cutlass"), "model.moe.kernel_backend='cutlass' is not one of auto, reference"),
    (lambda: ModelConfig(attention_backend="flash"), "model.attention_backend='flash' is not one of auto, sdpa, flex"),
    (lambda: ModelConfig(loss_backend="fused"), "model.loss_backend='fused' is not one of torch, chunked, liger"),
])
def test_unknown_backend_names_the_field_and_the_choices(build, choices):
    with pytest.raises(ValueError, match=choices):
        build()


def test_every_registered_kernel_backend_is_accepted():
    from sonic.kernels import BACKENDS

    for name in ("auto", *BACKENDS):
        assert MoEConfig(kernel_backend=name).kernel_backend == name
