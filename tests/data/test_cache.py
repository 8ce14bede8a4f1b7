"""Build-once cache entries: reuse, rebuild of broken entries, crashed builds, a race lost to another host."""
from __future__ import annotations

import json
import socket

import pytest

from sonic.data import cache


def writer(calls: list, text: str = "hello"):
    def build(tmp):
        calls.append(tmp)
        (tmp / "a.txt").write_text(text)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"\0" * 10)
        return {"what": text}
    return build


def test_built_once_then_reused(tmp_path):
    calls = []
    first = cache.ensure(tmp_path / "e", writer(calls), "an entry")
    assert cache.ensure(tmp_path / "e", writer(calls), "an entry") == first and len(calls) == 1
    assert first["what"] == "hello" and set(first["files"]) == {"a.txt", "sub/b.bin"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "e.lock"], "no temporary directory is left"


@pytest.mark.parametrize("damage", ["delete", "truncate", "flip", "no_manifest", "bad_manifest"])
def test_a_broken_entry_is_rebuilt(tmp_path, damage, caplog):
    calls = []
    cache.ensure(tmp_path / "e", writer(calls), "an entry")
    a, manifest = tmp_path / "e" / "a.txt", tmp_path / "e" / cache.MANIFEST
    {"delete": a.unlink, "truncate": lambda: a.write_text("hell"), "flip": lambda: a.write_text("jello"),
     "no_manifest": manifest.unlink, "bad_manifest": lambda: manifest.write_text("{")}[damage]()
    assert cache.check(tmp_path / "e")[0] is None
    cache.ensure(tmp_path / "e", writer(calls), "an entry")
    assert len(calls) == 2 and "rebuilding" in caplog.text and a.read_text() == "hello"


def test_a_failed_build_leaves_nothing(tmp_path):
    def fails(tmp):
        (tmp / "half").write_text("x")
        raise ValueError("the corpus is empty")

    with pytest.raises(ValueError, match="empty"):
        cache.ensure(tmp_path / "e", fails, "an entry")
    assert [p.name for p in tmp_path.iterdir()] == ["e.lock"]


def test_dead_builds_of_this_host_are_cleaned_up_others_are_left(tmp_path):
    host = socket.gethostname()
    dead = tmp_path / f"e.tmp-{host}-999999999"  # no such pid
    other_host = tmp_path / "e.tmp-elsewhere-1"
    dead.mkdir(), other_host.mkdir()
    cache.ensure(tmp_path / "e", writer([]), "an entry")
    assert not dead.exists() and other_host.exists()


def test_a_race_lost_to_another_host_keeps_the_winner(tmp_path):
    """Where the flock does not reach across hosts, a host that publishes second keeps the first one's entry."""
    theirs = tmp_path / "theirs"
    cache.ensure(theirs, writer([], "theirs"), "an entry")

    def slow(tmp):
        info = writer([], "mine")(tmp)
        theirs.rename(tmp_path / "e")  # the other host publishes meanwhile
        return info

    manifest = cache.ensure(tmp_path / "e", slow, "an entry")
    assert manifest["what"] == "theirs" == json.loads((tmp_path / "e" / cache.MANIFEST).read_text())["what"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "e.lock", "theirs.lock"]
