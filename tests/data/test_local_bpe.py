"""local_bpe:<V>: a byte-level BPE trained on tiny text in tmp dirs (seconds), its cache, and the data=local_bpe
choice end to end (Hydra -> trainer) with the machine's installation replaced by a few files."""
from __future__ import annotations

import json
import multiprocessing as mp
import time

import pytest

from sonic.data import DataConfig, build_loaders, build_tokenizer, local_bpe, local_text
from tests.helpers import compose_config

TEXTS = [
    "def route(x_TD, w_DE):\n    logits_TE = x_TD @ w_DE\n    return logits_TE.topk(2, dim=-1)\n",
    "The router sends each token to its top experts; a balanced load keeps every expert busy.\n",
    "Grüße aus Zürich! 猫は可愛い. Ünïcödé and emoji 🚀 survive byte-level BPE.\n",
] * 20
SAMPLES = ["    if x is None:\n\treturn {'a': [1, 2.5e-3]}  # ok", "Grüße, 猫! 🚀", "", "  \n\n ", "a<|endoftext|>b<|pad|>"]


@pytest.fixture
def train_count(monkeypatch):
    """How many tokenizers get trained (a cache hit trains none)."""
    calls = []
    real = local_bpe.train_bpe
    monkeypatch.setattr(local_bpe, "train_bpe", lambda *a: calls.append(a[1]) or real(*a))
    return calls


@pytest.mark.parametrize("vocab_size", [300, 1000])  # 300: merges fill it; 1000: unused tokens pad it
def test_trained_tokenizer_loads_with_auto_tokenizer_and_round_trips(tmp_path, vocab_size):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    info = local_bpe.train_bpe(iter(TEXTS), vocab_size, tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert isinstance(hf, PreTrainedTokenizerFast) and len(hf) == vocab_size
    assert (hf.eos_token, hf.eos_token_id, hf.pad_token, hf.pad_token_id) == ("<|endoftext|>", 0, "<|pad|>", 1)
    assert info["trained_tokens"] + info["unused_tokens"] == vocab_size
    assert (info["unused_tokens"] > 0) == (vocab_size == 1000)
    tok = build_tokenizer(DataConfig(tokenizer=str(tmp_path)))
    assert (tok.vocab_size, tok.eos_token_id, tok.pad_token_id) == (vocab_size, 0, 1)
    for text in TEXTS[:3] + SAMPLES:
        ids = tok.encode(text)
        assert tok.decode(ids) == text and all(0 <= i < info["trained_tokens"] for i in ids)
        assert tok.eos_token_id not in ids, "document text never turns into EOS"
    assert len(tok.encode(TEXTS[0])) < 0.8 * len(TEXTS[0].encode()), "merges compress the text it was trained on"


def test_training_is_deterministic(tmp_path):
    local_bpe.train_bpe(iter(TEXTS), 400, tmp_path / "a")
    local_bpe.train_bpe(iter(TEXTS), 400, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_no_text_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no text"):
        local_bpe.train_bpe(iter(["", "  \n"]), 300, tmp_path)


@pytest.mark.parametrize("name, message", [
    ("local_bpe", "local_bpe:<vocab size>"),
    ("local_bpe:", "local_bpe:<vocab size>"),
    ("local_bpe:big", "local_bpe:<vocab size>"),
    ("local_bpe:100", ">= 258"),
])
def test_bad_spec_names_the_field(name, message):
    with pytest.raises(ValueError, match=rf"data\.tokenizer=.*{message}"):
        DataConfig(tokenizer=name)


def test_built_once_reused_and_keyed_by_vocab_size(tmp_path, sources, train_count):
    cache_dir = str(tmp_path / "cache")
    a, manifest = local_bpe.ensure_local_bpe(320, cache_dir)
    assert local_bpe.ensure_local_bpe(320, cache_dir)[0] == a and train_count == [320]
    b, _ = local_bpe.ensure_local_bpe(384, cache_dir)
    assert b != a and train_count == [320, 384]
    corpus_path, corpus = local_text.ensure_corpus(cache_dir)
    assert manifest["corpus_sha256"] == corpus["sha256"] and len(manifest["tokenizer_sha256"]) == 64
    tok = build_tokenizer(DataConfig(tokenizer="local_bpe:320", cache_dir=cache_dir))
    assert tok.vocab_size == 320 and train_count == [320, 384]


def test_corrupt_tokenizer_is_rebuilt(tmp_path, sources, train_count, caplog):
    cache_dir = str(tmp_path / "cache")
    directory, manifest = local_bpe.ensure_local_bpe(320, cache_dir)
    data = bytearray((directory / "tokenizer.json").read_bytes())
    data[len(data) // 2] ^= 1  # a flipped bit: same size, wrong content
    (directory / "tokenizer.json").write_bytes(bytes(data))
    again, manifest2 = local_bpe.ensure_local_bpe(320, cache_dir)
    assert again == directory and train_count == [320, 320] and "does not match its sha256" in caplog.text
    assert manifest2["tokenizer_sha256"] == manifest["tokenizer_sha256"]
    (directory / "manifest.json").unlink()  # as a build that died before publishing would leave it
    local_bpe.ensure_local_bpe(320, cache_dir)
    assert train_count == [320, 320, 320]


def _ensure_in_child(cache_dir, queue):
    queue.put(str(local_bpe.ensure_local_bpe(320, cache_dir)[0]))


def test_concurrent_ranks_build_once(tmp_path, sources, monkeypatch):
    """Processes that start together (torchrun's ranks) train the tokenizer once and share it."""
    cache_dir = str(tmp_path / "cache")
    log = tmp_path / "builds.log"
    real = local_bpe.train_bpe

    def counted(texts, vocab_size, out_dir):
        with open(log, "a") as f:  # a file, as the builds happen in the children
            f.write("build\n")
        time.sleep(0.5)  # long enough that the other processes arrive while it builds
        return real(texts, vocab_size, out_dir)

    monkeypatch.setattr(local_bpe, "train_bpe", counted)
    ctx = mp.get_context("fork")  # the children inherit the patched sources and counter
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(cache_dir, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    dirs = {queue.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs) and len(dirs) == 1
    assert log.read_text().count("build") == 1


def test_data_choice_sizes_the_vocabulary_to_the_model():
    for model, vocab in (("tiny", 384), ("sonic_7b", 100352), ("olmoe_1b_7b", 50304), ("qwen3_30b_a3b", 151936)):
        cfg = compose_config(f"model={model}", "data=local_bpe")
        assert (cfg.data.source, cfg.data.tokenizer) == ("local_text", f"local_bpe:{vocab}")
    cfg = compose_config("experiment=sonic_7b", "data=local_bpe")
    assert (cfg.model.name, cfg.data.tokenizer, cfg.train.seq_len) == ("sonic_7b", "local_bpe:100352", 4096)
    assert compose_config().data.tokenizer == "byte", "the default run stays on the embedded corpus"


def test_loader_packs_the_local_corpus_with_the_local_tokenizer(tmp_path, sources):
    cfg = DataConfig(source="local_text", tokenizer="local_bpe:320", cache_dir=str(tmp_path / "cache"), val_docs=4)
    tok = build_tokenizer(cfg)
    train, val = build_loaders(cfg, tokenizer=tok, seq_len=32, micro_batch_size=2)
    batch = next(train)
    assert batch["input_ids"].shape == (2, 32) and int(batch["input_ids"].max()) < 320
    assert len(val) >= 1
    shard_dirs = list((tmp_path / "cache" / "local_shards").glob("*/index.json"))
    assert len(shard_dirs) == 1 and json.loads(shard_dirs[0].read_text())["tokenizer"] == "local_bpe:320"
    again, _ = build_loaders(cfg, tokenizer=tok, seq_len=32, micro_batch_size=2)
    assert (next(again)["input_ids"] == batch["input_ids"]).all()
    assert len(list((tmp_path / "cache" / "local_shards").glob("*/index.json"))) == 1, "shards are reused"


def test_train_a_few_steps_of_tiny_on_data_local_bpe(tmp_path, sources):
    from sonic.train.trainer import train

    common = ["model=tiny", "data=local_bpe", f"data.cache_dir={tmp_path / 'cache'}", "data.val_docs=4",
              "model.num_layers=1", "train.seq_len=32", "train.micro_batch_size=2", "train.steps=2",
              "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "train.save_every=0",
              "train.progress=false", "optim.warmup_steps=1"]
    history = train(compose_config(*common, f"train.run_dir={tmp_path / 'run'}"))
    assert [h["step"] for h in history] == [1, 2] and "val_loss" in history[-1]
    assert all(h["loss"] == h["loss"] for h in history), "finite losses"
    assert list((tmp_path / "cache" / "local_bpe").glob("v384-*/tokenizer.json")), "sized to model.vocab_size"
    with pytest.raises(ValueError, match="tokenizer has 512 tokens but model.vocab_size=384"):
        train(compose_config(*common, "data.tokenizer=local_bpe:512", f"train.run_dir={tmp_path / 'big'}"))
