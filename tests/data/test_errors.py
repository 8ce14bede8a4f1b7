"""Bad input gives one ValueError that names the file (or dataset) and says what to fix."""
from __future__ import annotations

import json

import pytest

from sonic.data import DataConfig, build_loaders, build_tokenizer
from tests.data.conftest import write_jsonl


def load(cfg):
    return build_loaders(cfg, tokenizer=build_tokenizer(cfg), seq_len=8, micro_batch_size=2)


def test_missing_file_and_empty_glob(tmp_path):
    with pytest.raises(ValueError, match="nope.jsonl.*matches no file"):
        load(DataConfig(source="files", paths=[str(tmp_path / "nope.jsonl")]))
    with pytest.raises(ValueError, match=r"\*\.parquet.*matches no file"):
        load(DataConfig(source="files", paths=[str(tmp_path / "*.parquet")]))


def test_unsupported_file_type(tmp_path):
    (tmp_path / "a.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="a.csv: unsupported file type"):
        load(DataConfig(source="files", paths=[str(tmp_path / "a.csv")]))


def test_empty_dataset(tmp_path):
    path = write_jsonl(tmp_path / "empty.jsonl", ["", "  ", "\n"])
    with pytest.raises(ValueError, match="empty.jsonl: no non-empty documents"):
        load(DataConfig(source="files", paths=[path]))
    (tmp_path / "blank.txt").write_text("\n\n\n")
    with pytest.raises(ValueError, match="blank.txt: no non-empty documents"):
        load(DataConfig(source="files", paths=[str(tmp_path / "blank.txt")]))


def test_empty_mixture_component_is_named(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [f"doc {i}" for i in range(20)])
    bad = write_jsonl(tmp_path / "hollow.jsonl", [""])
    with pytest.raises(ValueError, match="hollow.jsonl: no non-empty documents"):
        load(DataConfig(source="files", paths=[good, bad], weights=[1.0, 1.0], val_docs=2))


def test_missing_text_column(tmp_path):
    path = write_jsonl(tmp_path / "cols.jsonl", ["hello"], key="content")
    with pytest.raises(ValueError, match=r"cols.jsonl:1: no text column 'text' \(found \['content'\]\)"):
        load(DataConfig(source="files", paths=[path]))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"p.parquet: no text column 'text'.*data.text_column"):
        load(DataConfig(source="files", paths=[str(tmp_path / "p.parquet")]))
    with pytest.raises(ValueError, match=r"cols.jsonl.*no text column 'text'"):
        load(DataConfig(source="files", paths=[path], streaming=True))


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl:2: invalid JSON"):
        load(DataConfig(source="files", paths=[str(path)]))


def test_validation_cannot_take_every_document(tmp_path):
    path = write_jsonl(tmp_path / "few.jsonl", ["one doc", "two docs"])
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"few.jsonl.*data.val_docs=5"):
            load(DataConfig(source="files", paths=[path], streaming=streaming, val_docs=5))
