"""The run config is strict: an unknown key fails the same way whether it is given as
`train.stepz=5` or in Hydra's append form `+train.stepz=5` (which Hydra itself lets through)."""
import re

import pytest
from hydra.errors import ConfigCompositionException

from sonic.train.config import TrainConfig
from tests.helpers import compose_config


@pytest.mark.parametrize("key, node", [("train.stepz", "TrainConfig"), ("model.moe.topk", "MoEConfig"),
                                       ("stepz", "Config")])
def test_an_unknown_key_fails_also_in_the_append_form(key, node):
    name = key.rsplit(".", 1)[-1]
    message = rf"Key '{name}' not in '{node}'\n    full_key: {key}\n"
    with pytest.raises(ConfigCompositionException, match=rf"Could not override '{key}'") as plain:
        compose_config(f"{key}=5")
    assert plain.value.__cause__ is not None and re.search(message, str(plain.value.__cause__))
    for form in ("+", "++"):
        with pytest.raises(ValueError, match=rf"Could not override '{key}'.\n{message}"):
            compose_config(f"{form}{key}=5")


def test_known_keys_still_take_every_form():
    assert compose_config("++model.moe.top_k=4").model.moe.top_k == 4
    assert compose_config("experiment=repro_tr_proxy").model.moe.num_experts == 16


def test_bad_max_update_ratio():
    with pytest.raises(ValueError, match="train.max_update_ratio=-1 must be >= 0"):
        TrainConfig(max_update_ratio=-1)
