"""The local text corpus: selection, order, cap, caching (sources are tiny files in tmp dirs, never the machine's)."""
from __future__ import annotations

import json

import pytest

from sonic.data import cache, local_text
from tests.data.conftest import write_sources


def test_code_corpus_is_fixed_by_its_seed_and_capped(tmp_path, monkeypatch):
    files = []
    for i in range(20):
        f = tmp_path / "src" / f"m{i}.py"
        f.parent.mkdir(exist_ok=True)
        f.write_text(f"x = {i}\n" * (i + 1))
        files.append(f)
    (tmp_path / "src" / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped
    monkeypatch.setattr(local_text, "python_sources", lambda: sorted((tmp_path / "src").glob("*.py")))
    a = local_text.build_code_corpus(tmp_path / "a.jsonl", max_bytes=100)
    b = local_text.build_code_corpus(tmp_path / "b.jsonl", max_bytes=100)
    c = local_text.build_code_corpus(tmp_path / "c.jsonl", max_bytes=100, seed=1)
    assert a["sha256"] == b["sha256"] != c["sha256"]
    docs = [json.loads(line)["text"] for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(docs) == a["documents"] and 100 <= a["bytes"] < 100 + max(map(len, docs))  # stops past the cap
    assert set(docs) <= {f.read_text() for f in files}
    everything = local_text.build_code_corpus(tmp_path / "all.jsonl", max_bytes=10**9)
    assert everything["documents"] == 20 and everything["files_available"] == 21


def test_the_repro_script_builds_its_corpus_with_the_shared_function():
    from scripts.repro import tr_quality

    assert tr_quality.build_code_corpus is local_text.build_code_corpus


def test_documents_mix_prose_and_code_skip_junk_and_stop_at_the_cap(tmp_path):
    code, prose = write_sources(tmp_path)
    docs = list(local_text.local_documents(code, prose, max_bytes=10**9))
    kinds = [k for k, _ in docs]
    texts = [t for _, t in docs]
    assert kinds.count("code") == 12 and kinds.count("prose") == 6 + 1  # 6 docs + the gunzipped changelog
    assert len(set(texts)) == len(texts), "the duplicate is dropped"
    assert not any(t.startswith("1.0 2.0") or "caf" in t for t in texts), "tables and non-UTF-8 files are dropped"
    assert docs == list(local_text.local_documents(code, prose, max_bytes=10**9))  # deterministic
    assert texts != [t for _, t in local_text.local_documents(code, prose, max_bytes=10**9, seed=1)]
    # While prose lasts, no prefix runs more than one document past prose's third of the bytes.
    sizes = {t: len(t.encode()) for t in texts}
    total = prose_bytes = 0
    for kind, text in docs[:6]:
        prose_bytes += sizes[text] * (kind == "prose")
        total += sizes[text]
        assert prose_bytes <= total / 3 + max(sizes.values())
    capped = list(local_text.local_documents(code, prose, max_bytes=500))
    assert 500 <= sum(len(t.encode()) for _, t in capped) < 500 + max(sizes.values())


def test_corpus_is_built_once_then_reused_and_rebuilt_when_corrupt(tmp_path, sources, monkeypatch, caplog):
    builds = []
    real = local_text.write_jsonl
    monkeypatch.setattr(local_text, "write_jsonl", lambda *a: builds.append(1) or real(*a))
    path, manifest = local_text.ensure_corpus(str(tmp_path / "cache"))
    again, manifest2 = local_text.ensure_corpus(str(tmp_path / "cache"))
    assert (again, manifest2) == (path, manifest) and len(builds) == 1
    assert manifest["sha256"] == cache.file_sha256(path) and manifest["documents"] == 19
    with open(path, "r+b") as f:  # a partial copy
        f.truncate(100)
    rebuilt, manifest3 = local_text.ensure_corpus(str(tmp_path / "cache"))
    assert len(builds) == 2 and "broken" in caplog.text
    assert manifest3["sha256"] == manifest["sha256"] == cache.file_sha256(rebuilt)


def test_changed_sources_make_a_new_corpus(tmp_path, sources):
    path, _ = local_text.ensure_corpus(str(tmp_path / "cache"))
    sources[0][0].write_text("import os\n")
    new_path, _ = local_text.ensure_corpus(str(tmp_path / "cache"))
    assert new_path != path


def test_empty_corpus_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(local_text, "python_sources", lambda: [])
    monkeypatch.setattr(local_text, "prose_sources", lambda: [])
    with pytest.raises(ValueError, match="local text corpus is empty.*data=embedded"):
        local_text.ensure_corpus(str(tmp_path / "cache"))
    assert not any((tmp_path / "cache" / "local_text").glob("*/manifest.json")), "nothing half-built is kept"


def test_the_real_installation_has_sources():
    """What the corpus draws from on this machine: the interpreter's .py files and some prose."""
    assert any(f.name == "os.py" for f in local_text.python_sources())
    assert local_text.prose_sources()[-1].name == "embedded.txt"
