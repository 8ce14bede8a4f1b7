"""Checkpointer integrity on one process: checksums in meta.json, corrupt checkpoints set aside
by resume=auto (or a clear error for a path), a full disk mid-save, non-finite weights, an
unwritable run directory, and loading that runs no code from the files."""
import errno
import hashlib
import io
import json
import logging
import pathlib
import pickle
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from sonic.models import ModelConfig, MoEConfig, Transformer
from sonic.models.loading import SafePlanner, file_entry, load_model
from sonic.train.checkpoint import Checkpointer, check_run_dir, plain, rng_state, set_rng_state, verify
from sonic.train.optim import OptimConfig, build_optimizer


def tiny():
    cfg = ModelConfig(vocab_size=32, dim=16, num_layers=1, num_heads=2, moe=MoEConfig(num_experts=4, top_k=2,
                                                                                        expert_dim=8))
    model = Transformer(cfg)
    model.init_weights(seed=0)
    optimizer = build_optimizer(model, OptimConfig())
    out = model(torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0)))
    (out.logits_BSV.square().mean() + out.router_loss).backward()
    optimizer.step()  # some optimizer state to save
    return model, optimizer


@pytest.fixture
def saved(tmp_path):
    """Checkpoints of steps 1 and 2 (the model moved in between)."""
    model, optimizer = tiny()
    ckpt = Checkpointer(tmp_path / "checkpoints", keep_last=3)
    ckpt.save(1, model, optimizer, {"marker": 1}, "model: {}\n")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    ckpt.save(2, model, optimizer, {"marker": 2}, "model: {}\n")
    return ckpt, model, optimizer


def step_dir(ckpt, step):
    return ckpt.root / f"step_{step:08d}"


def test_meta_json_holds_size_and_sha256_of_every_other_file(saved):
    ckpt, _, _ = saved
    path = step_dir(ckpt, 2)
    files = json.loads((path / "meta.json").read_text())["files"]
    on_disk = {f.name for f in path.iterdir()} - {"meta.json"}
    assert set(files) == on_disk and {".metadata", "extra_rank0.pt", "config.yaml"} <= on_disk
    for name, entry in files.items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert verify(path) is None


def truncate_distcp(path):
    for f in path.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def flip_a_byte(path):
    f = next(path.glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x01
    f.write_bytes(bytes(data))


CORRUPTIONS = {
    "distcp truncated to half": (truncate_distcp, "has .* bytes, meta.json says"),
    "one bit flipped": (flip_a_byte, "does not match its SHA-256"),
    "a file missing": (lambda p: (p / "extra_rank0.pt").unlink(), "extra_rank0.pt is missing"),
    "meta.json garbled": (lambda p: (p / "meta.json").write_text('{"step": 2, "fi'), "meta.json is unreadable"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_resume_auto_sets_a_corrupt_checkpoint_aside_and_takes_the_older_one(saved, corruption, caplog):
    ckpt, model, optimizer = saved
    corrupt, problem = CORRUPTIONS[corruption]
    corrupt(step_dir(ckpt, 2))
    with caplog.at_level(logging.WARNING, logger="sonic"):
        assert ckpt.find("auto") == step_dir(ckpt, 1)
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_00000001", "step_00000002.corrupt"]
    assert caplog.records[0].getMessage().startswith(f"checkpoint {step_dir(ckpt, 2)} is corrupt")
    assert "step_00000002.corrupt" in caplog.text
    assert re.search(problem, caplog.text), caplog.text
    assert ckpt.load(step_dir(ckpt, 1), model, optimizer)["marker"] == 1
    assert ckpt.find("auto") == step_dir(ckpt, 1)  # nothing else to set aside


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_an_explicit_corrupt_checkpoint_is_a_clear_error(saved, corruption):
    ckpt, _, _ = saved
    corrupt, problem = CORRUPTIONS[corruption]
    corrupt(step_dir(ckpt, 2))
    with pytest.raises(ValueError, match=rf"checkpoint .*step_00000002 is corrupt \(.*{problem}.*train.resume"):
        ckpt.find(str(step_dir(ckpt, 2)))
    assert step_dir(ckpt, 2).is_dir()  # an explicit path is never renamed


def test_with_every_checkpoint_corrupt_auto_starts_afresh_and_says_so(saved, caplog):
    ckpt, _, _ = saved
    truncate_distcp(step_dir(ckpt, 1))
    truncate_distcp(step_dir(ckpt, 2))
    with caplog.at_level(logging.WARNING, logger="sonic"):
        assert ckpt.find("auto") is None
    assert "no intact checkpoint left" in caplog.text
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_00000001.corrupt", "step_00000002.corrupt"]


def test_a_checkpoint_from_before_checksums_still_resumes(saved, caplog):
    ckpt, model, optimizer = saved
    (step_dir(ckpt, 2) / "meta.json").write_text(json.dumps({"step": 2, "world_size": 1}))
    with caplog.at_level(logging.WARNING, logger="sonic"):
        assert ckpt.find("auto") == step_dir(ckpt, 2)
    assert "not verified" in caplog.text
    assert ckpt.load(step_dir(ckpt, 2), model, optimizer)["step"] == 2


def disk_full_in_dcp(monkeypatch):
    def write_half_then_fail(transforms, stream, data, *args, **kwargs):
        stream.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", write_half_then_fail)


def disk_full_at_meta_json(monkeypatch):
    real = pathlib.Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == "meta.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)


@pytest.mark.parametrize("fail", [disk_full_in_dcp, disk_full_at_meta_json])
def test_a_full_disk_mid_save_is_a_clear_error_and_leaves_older_checkpoints_intact(saved, fail, monkeypatch):
    ckpt, model, optimizer = saved
    with monkeypatch.context() as m:
        fail(m)
        with pytest.raises(OSError, match=r"no space left on device while saving checkpoint step_00000003 .*"
                                          r"step_00000003.tmp was removed.*intact.*train.run_dir") as info:
            ckpt.save(3, model, optimizer, {}, "model: {}\n")
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_00000001", "step_00000002"]
    assert all(verify(step_dir(ckpt, s)) is None for s in (1, 2))
    assert ckpt.find("auto") == step_dir(ckpt, 2)


def test_non_finite_weights_are_never_saved(saved):
    ckpt, model, optimizer = saved
    with torch.no_grad():
        next(model.parameters()).view(-1)[5] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite values at step 3.*optim.lr"):
        ckpt.save(3, model, optimizer, {}, "model: {}\n")
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_00000001", "step_00000002"]


def test_an_unwritable_run_dir_is_a_clear_error(tmp_path):
    check_run_dir(tmp_path / "new" / "run")  # created
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"train.run_dir='.*a_file/run' cannot be written \(.*NotADirectoryError"
                                         r".*set train.run_dir to a writable directory"):
        check_run_dir(tmp_path / "a_file" / "run")


def test_ranks_checking_one_run_dir_before_init_process_group_do_not_collide(tmp_path, monkeypatch):
    """Hydra's callback checks the run directory on every rank before init_process_group, when each
    rank calls itself rank 0: another rank's whole check, run between this one's probe write and
    unlink, must not delete this one's probe (it did: a resumed torchrun job failed to start)."""
    other = [sys.executable, "-c", f"from pathlib import Path; from sonic.train.checkpoint import check_run_dir; "
                                   f"check_run_dir(Path({str(tmp_path)!r}))"]
    unlink = pathlib.Path.unlink

    def other_rank_checks_first(self, *args, **kwargs):
        subprocess.run(other, check=True, cwd=pathlib.Path(__file__).parents[2])
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "unlink", other_rank_checks_first)
    check_run_dir(tmp_path)
    assert not list(tmp_path.iterdir())  # both probes gone


class RunsCode:
    """Unpickling this runs code: it writes `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def plant(step_dir, name, obj):
    """Replace file `name` with a pickle of `obj` and record its new hash in meta.json, as someone
    who rewrites a checkpoint would: the checksums pass."""
    torch.save(obj, step_dir / name) if name.endswith(".pt") else (step_dir / name).write_bytes(pickle.dumps(obj))
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["files"][name] = file_entry(step_dir / name)
    (step_dir / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("name", ["extra_rank0.pt", ".metadata"])
def test_loading_a_checkpoint_runs_no_code_from_it(saved, tmp_path, name):
    """The issue: a pickle planted in extra_rank0.pt (with meta.json's hash updated) ran on resume.
    DCP's .metadata is a pickle too. Both are refused before anything in them runs."""
    ckpt, model, optimizer = saved
    marker = tmp_path / "marker"
    plant(step_dir(ckpt, 2), name, {"rng": RunsCode(marker)} if name.endswith(".pt") else RunsCode(marker))
    assert ckpt.find("auto") == step_dir(ckpt, 2)  # the checksums match
    untrusted = r"holds more than tensors and plain values, so it was not loaded: loading it could run code. Load " \
                r"checkpoints only from places you trust \((builtins.exec is not part of a checkpoint's metadata|" \
                r"Weights only load failed)"
    with pytest.raises(ValueError, match=untrusted):
        ckpt.load(step_dir(ckpt, 2), model, optimizer)
    if name == ".metadata":  # eval and export read the model's weights from it
        with pytest.raises(ValueError, match=untrusted):
            load_model(step_dir(ckpt, 2))
    assert not marker.exists()
    assert ckpt.load(step_dir(ckpt, 1), model, optimizer)["marker"] == 1  # an intact one loads as before


def test_dcp_byte_items_load_without_running_code(tmp_path):
    """DCP loads a checkpoint's non-tensor items (the optimizer's hyperparameters) with
    torch.load(weights_only=False); Sonic's planner refuses anything but tensors and plain values."""
    marker, item = tmp_path / "marker", io.BytesIO()
    torch.save(RunsCode(marker), item)
    item.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        SafePlanner().load_bytes(None, item)
    assert not marker.exists()


def test_the_resume_state_is_tensors_and_plain_values(saved):
    ckpt, model, optimizer = saved
    extra = torch.load(step_dir(ckpt, 2) / "extra_rank0.pt", weights_only=True)  # raises on anything else
    assert isinstance(extra["rng"]["numpy"]["keys"], torch.Tensor)
    state = rng_state()
    expected = random.random(), np.random.rand(), torch.rand(1).item()
    set_rng_state(torch.load(io.BytesIO(_saved(state)), weights_only=True))  # saved and loaded as a resume does
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    with pytest.raises(TypeError, match=r"extra\['loader'\]\['x'\] is a RunsCode"):
        ckpt.save(3, model, optimizer, {"loader": {"x": RunsCode("nowhere")}}, "model: {}\n")
    assert plain({"a": np.int64(3), "b": (np.float32(0.5), np.arange(2))})["b"][1].tolist() == [0, 1]


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_checkpoint_of_an_older_sonic_still_resumes(saved):
    """Older checkpoints held numpy's RNG state as a numpy array and the LR scheduler's state:
    both still load (numpy arrays without running code), and the scheduler's is ignored."""
    ckpt, model, optimizer = saved
    path = step_dir(ckpt, 2)
    extra = torch.load(path / "extra_rank0.pt", weights_only=True)
    extra["rng"]["numpy"] = np.random.get_state()
    extra["scheduler"] = {"base_lrs": [3e-3], "last_epoch": 2}
    torch.save(extra, path / "extra_rank0.pt")
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["extra_rank0.pt"] = file_entry(path / "extra_rank0.pt")
    (path / "meta.json").write_text(json.dumps(meta))
    expected = np.random.rand()
    np.random.rand()
    assert ckpt.load(path, model, optimizer)["marker"] == 2
    assert np.random.rand() == expected
