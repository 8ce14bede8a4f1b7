"""DataConfig validation and the configs/data YAML files (merged the way the trainer merges them)."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sonic.data import DataConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"


@pytest.mark.parametrize("name", ["embedded", "fineweb_edu", "shards"])
def test_yaml_merges_into_the_dataclass(name):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(CONFIGS / f"{name}.yaml")))
    assert isinstance(cfg, DataConfig)


def test_fineweb_edu_is_the_papers_data():
    cfg = OmegaConf.load(CONFIGS / "fineweb_edu.yaml")
    assert (cfg.name, cfg.subset, cfg.streaming) == ("HuggingFaceTB/smollm-corpus", "fineweb-edu-dedup", True)


def test_default_is_the_offline_embedded_corpus():
    assert (DataConfig().source, DataConfig().tokenizer) == ("embedded", "byte")


@pytest.mark.parametrize("fields, field", [
    ({"source": "s3"}, "source"),
    ({"source": "hf"}, "name"),
    ({"source": "files"}, "paths"),
    ({"source": "shards"}, "paths"),
    ({"paths": ["x.jsonl"]}, "paths"),
    ({"source": "files", "paths": ["a", "b"], "weights": [1.0]}, "weights"),
    ({"source": "files", "paths": ["a", "b"], "weights": [1.0, 0.0]}, "weights"),
    ({"source": "files", "paths": ["a"], "weights": [1.0], "streaming": True}, "weights"),
    ({"streaming": True}, "streaming"),
    ({"val_split": "validation"}, "val_split"),
    ({"txt_docs": "sentence"}, "txt_docs"),
    ({"text_column": ""}, "text_column"),
    ({"tokenizer": ""}, "tokenizer"),
    ({"tokenizer": "local_bpe:12"}, "tokenizer"),
    ({"source": "local_text", "paths": ["x.jsonl"]}, "paths"),
    ({"source": "local_text", "streaming": True}, "streaming"),
    ({"cache_dir": ""}, "cache_dir"),
    ({"val_docs": 0}, "val_docs"),
    ({"num_workers": -1}, "num_workers"),
])
def test_each_bad_field_is_named(fields, field):
    with pytest.raises(ValueError, match=rf"data\.{field}="):
        DataConfig(**fields)


def test_unknown_yaml_key_fails_the_structured_merge():
    with pytest.raises(Exception, match="shuffle_buffer"):
        OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.create({"shuffle_buffer": 10}))
