"""The one table of benchmark shapes: the names users pass to --configs, and how a run picks its configs."""
import pytest

from bench import moe_configs
from scripts.repro import paper


def test_table_9b_names_and_shapes():
    assert moe_configs.TABLE_9B_NAMES == ["1.4B", "1.4B-E64", "1.4B-E32", "7B", "7B-E64", "7B-E32", "30B-E256",
                                          "30B", "30B-E64", "120B-E256", "120B", "120B-E64"]
    assert [moe_configs.CONFIGS[c] for c in moe_configs.TABLE_9B_NAMES] == \
        [shape for shapes in paper.TABLE_9B.values() for shape in shapes]
    assert paper.TABLE_9B is moe_configs.TABLE_9B and paper.OFFICIAL_H100 is moe_configs.OFFICIAL_H100
    for shape, numbers in moe_configs.OFFICIAL_H100.items():  # cited by shape, named as --configs names it
        assert moe_configs.CONFIGS[numbers["name"]] == shape


def test_select_configs_takes_names_then_shapes_and_leaves_the_table_alone():
    before = dict(moe_configs.CONFIGS)
    assert moe_configs.select_configs(None, [], ["7B", "30B"]) == {"7B": (24576, 1536, 256, 128, 8),
                                                                  "30B": (32768, 4096, 512, 128, 8)}
    assert moe_configs.select_configs(None, ["64,32,16,4,2"], ["7B"]) == {"64,32,16,4,2": (64, 32, 16, 4, 2)}
    assert list(moe_configs.select_configs("OLMoE", ["64,32,16,4,2"], [])) == ["OLMoE", "64,32,16,4,2"]
    assert moe_configs.CONFIGS == before


@pytest.mark.parametrize("names,shapes,message", [
    ("7b", [], "unknown config '7b'; choose from 1.4B"),
    (None, ["64,32,16,4"], "five positive integers"),
    (None, ["64,32,x,4,2"], "five positive integers"),
])
def test_select_configs_rejects_unknown_names_and_malformed_shapes(names, shapes, message):
    with pytest.raises(ValueError, match=message):
        moe_configs.select_configs(names, shapes, [])
