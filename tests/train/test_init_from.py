"""train.init_from=<HF dir>: config.json fields that change the computation must match model.*."""
import pytest

from sonic.models import Transformer
from sonic.models.hf import export_hf
from sonic.train.trainer import train
from tests.helpers import compose_config

pytest.importorskip("transformers")
FAST = ["model.qk_norm=full", "model.num_layers=2", "train.micro_batch_size=2", "train.seq_len=32", "train.steps=1",
        "train.log_every=1", "train.eval_every=0", "train.save_every=0", "train.progress=false"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = compose_config(*FAST).model
    model = Transformer(cfg)
    model.init_weights(0)
    return export_hf(model, cfg, tmp_path_factory.mktemp("hf"))


def test_a_config_json_that_disagrees_with_the_model_stops_before_training(hf_dir, tmp_path):
    assert train(compose_config(*FAST, f"train.init_from={hf_dir}", f"train.run_dir={tmp_path / 'ok'}"))
    cfg = compose_config(*FAST, f"train.init_from={hf_dir}", f"train.run_dir={tmp_path / 'bad'}",
                         "model.rope_theta=500000", "model.moe.top_k=1")
    with pytest.raises(ValueError, match=r"model.rope_theta=500000.0 but config.json \(rope_theta\) gives 10000.0"
                                         r"(.|\n)*model.moe.top_k=1 but config.json \(num_experts_per_tok\) gives 2"):
        train(cfg)
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_init_from_strict_false_loads_with_a_warning(hf_dir, tmp_path, caplog):
    cfg = compose_config(*FAST, f"train.init_from={hf_dir}", f"train.run_dir={tmp_path}", "model.rope_theta=500000",
                         "train.init_from_strict=false")
    with caplog.at_level("WARNING", logger="sonic"):
        history = train(cfg)
    assert [h["step"] for h in history] == [1]
    assert "model.rope_theta=500000.0 but config.json (rope_theta) gives 10000.0" in caplog.text
