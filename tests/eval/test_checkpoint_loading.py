"""sonic.models.loading: every accepted checkpoint form loads the same weights; bad paths are named;
a corrupt checkpoint stops every reader (eval, export, init_from); eval checks where it writes first."""
import json
import pathlib
import shutil
import sys

import pytest
import torch

from sonic.models.loading import file_entry, load_model, save_model_file
from tests.eval.conftest import save_checkpoint, tiny_config, tiny_model


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_run_dir_checkpoints_dir_and_step_dir_resolve_to_the_newest_step(tmp_path):
    old, new = tiny_model(tiny_config(), seed=1), tiny_model(tiny_config(), seed=2)
    save_checkpoint(old, tmp_path, step=5)
    step_dir = save_checkpoint(new, tmp_path, step=10)
    (tmp_path / "checkpoints" / "step_00000020.tmp").mkdir()  # an interrupted save is never picked
    for path in (tmp_path, tmp_path / "checkpoints", step_dir):
        loaded = load_model(path, kernel_backend="reference")
        assert loaded.path == step_dir and loaded.step == 10 and loaded.tokenizer == "byte"
        assert loaded.config == new.cfg and same_weights(loaded.model, new)
        assert not loaded.model.training
    ids = torch.randint(0, 259, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits_BSV, new(ids).logits_BSV)


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_single_file_round_trip(tmp_path, name):
    model = tiny_model(tiny_config(), seed=4)
    path = save_model_file(tmp_path / name, model, tokenizer="byte")
    loaded = load_model(path, kernel_backend="reference")
    assert loaded.config == model.cfg and same_weights(loaded.model, model) and loaded.tokenizer == "byte"


def test_missing_path_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'nope'} does not exist"):
        load_model(tmp_path / "nope")


def test_directory_without_a_checkpoint_is_named(tmp_path):
    (tmp_path / "checkpoints" / "step_00000003").mkdir(parents=True)  # no meta.json: incomplete
    with pytest.raises(ValueError, match=f"checkpoint {tmp_path} is not a checkpoint"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="incomplete save"):
        load_model(tmp_path / "checkpoints" / "step_00000003")


@pytest.fixture
def step_dir(tmp_path):
    return save_checkpoint(tiny_model(tiny_config()), tmp_path)


def test_truncated_shard_is_named_corrupt(step_dir):
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"checkpoint {step_dir} is corrupt"):
        load_model(step_dir, kernel_backend="reference")


def test_missing_dcp_metadata_is_named_corrupt(step_dir):
    (step_dir / ".metadata").unlink()
    with pytest.raises(ValueError, match=f"checkpoint {step_dir} is corrupt"):
        load_model(step_dir, kernel_backend="reference")


def test_missing_config_is_named(step_dir):
    (step_dir / "config.yaml").unlink()
    with pytest.raises(ValueError, match=f"checkpoint {step_dir} is corrupt \\(config.yaml is missing"):
        load_model(step_dir)


def rehash(step_dir, name):
    """Record file `name`'s new size and SHA-256 in meta.json, as someone who edits a checkpoint would."""
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["files"][name] = file_entry(step_dir / name)
    (step_dir / "meta.json").write_text(json.dumps(meta))


def test_config_that_does_not_match_the_weights_is_named(step_dir):
    text = (step_dir / "config.yaml").read_text()
    (step_dir / "config.yaml").write_text(text.replace("num_layers: 2", "num_layers: 3"))
    rehash(step_dir, "config.yaml")
    with pytest.raises(ValueError, match=f"checkpoint {step_dir} is corrupt or does not match its config"):
        load_model(step_dir, kernel_backend="reference")


def test_garbage_single_file_is_named(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=f"checkpoint {bad} is corrupt"):
        load_model(bad)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=".safetensors or .pt"):
        load_model(other)


def test_eval_model_class_reports_a_missing_checkpoint(tmp_path):
    pytest.importorskip("lm_eval")
    from eval.lm import SonicLM

    shutil.rmtree(tmp_path)
    with pytest.raises(ValueError, match=str(tmp_path)):
        SonicLM(checkpoint=str(tmp_path))


def flip_a_bit(step_dir):
    shard = next(step_dir.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside a weight: the file still loads, with a wrong value
    shard.write_bytes(bytes(data))


def test_a_flipped_bit_stops_eval_export_and_init_from(step_dir, tmp_path, monkeypatch):
    """The issue: resume caught a flipped bit, but eval reported acc 0.24 instead of 0.53 from it
    and export wrote the corrupt weights. Every reader checks meta.json's checksums first."""
    from scripts import export_hf
    from sonic.train.trainer import load_weights

    flip_a_bit(step_dir)
    corrupt = rf"checkpoint {step_dir} is corrupt \(__0_0.distcp does not match its SHA-256 in meta.json\)"
    with pytest.raises(ValueError, match=corrupt):
        load_model(step_dir)
    monkeypatch.setattr(sys, "argv", ["export_hf.py", str(step_dir), str(tmp_path / "hf")])
    with pytest.raises(ValueError, match=corrupt):
        export_hf.main()
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match=corrupt):
        load_weights(tiny_model(tiny_config()), str(tmp_path))  # train.init_from=<run dir>
    pytest.importorskip("lm_eval")
    from eval.lm import SonicLM

    with pytest.raises(ValueError, match=corrupt):
        SonicLM(checkpoint=str(step_dir))


def test_eval_checks_its_output_dir_before_evaluating(step_dir, monkeypatch):
    """The issue: with a read-only checkpoint folder, `python -m eval` ran the whole evaluation,
    then crashed writing <checkpoint>/eval, and the results were lost."""
    pytest.importorskip("lm_eval")
    import eval.__main__ as entry
    from eval.config import EvalConfig

    def read_only(real):
        def write(self, *args, **kwargs):
            if step_dir in (self, *self.parents):
                raise PermissionError(13, "Permission denied", str(self))
            return real(self, *args, **kwargs)
        return write

    for method in ("mkdir", "write_bytes", "write_text", "touch"):  # as root, chmod would not stop the writes
        monkeypatch.setattr(pathlib.Path, method, read_only(getattr(pathlib.Path, method)))
    evaluated = []
    monkeypatch.setattr(entry, "evaluate", lambda *args, **kwargs: evaluated.append(1) or {"results": {}})
    with pytest.raises(ValueError, match=rf"output_dir='{step_dir}/eval' cannot be written \(PermissionError.*"
                                         r"set output_dir to a writable directory"):
        entry.run(EvalConfig(checkpoint=str(step_dir), tasks=["sonic_world"], limit=2))
    assert not evaluated
