import pytest

from sonic.parallel import ParallelConfig
from tests.helpers import compose_config


@pytest.mark.parametrize("field, value, fix", [
    ("activation_checkpoint", "some", "none, full, selective"),
    ("param_dtype", "fp16", "bf16, fp32"),
    ("dp_replicate", 0, ">= 1"),
    ("ac_every", 0, ">= 1"),
    ("compile_backend", "tvm", "inductor, aot_eager"),
    ("backend", "mpi", "auto, nccl, gloo"),
])
def test_bad_values_name_the_field_and_the_fix(field, value, fix):
    with pytest.raises(ValueError, match=f"parallel.{field}=.*{fix}"):
        ParallelConfig(**{field: value})


def test_yaml_defaults_match_the_dataclass():
    assert compose_config().parallel == ParallelConfig()
