"""Tokenizers: the offline byte default, local HF tokenizers, and a clear error for unloadable ones."""
from __future__ import annotations

import pytest

from sonic.data import DataConfig, build_tokenizer
from sonic.data.tokenizer import token_dtype


def test_byte_tokenizer_matches_byt5_ids_and_keeps_special_text_literal():
    from transformers import ByT5Tokenizer

    tok = build_tokenizer(DataConfig())
    text = "Grüße, 猫! 3 + 4 = 7"
    ids = tok.encode(text)
    assert ids == ByT5Tokenizer(extra_ids=0).encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and max(ids) < tok.vocab_size == 259
    assert tok.eos_token_id not in tok.encode("a</s>b"), "document text never turns into EOS"


def test_local_hf_tokenizer(word_tokenizer_dir):
    tok = build_tokenizer(DataConfig(tokenizer=word_tokenizer_dir))
    assert tok.encode("w0 w5 a3") == [2, 7, 40_005]
    assert tok.eos_token_id == 0 and tok.vocab_size == 70_002 and token_dtype(tok.vocab_size).name == "uint32"
    assert tok.decode([2, 7]) == "w0 w5"


def test_literal_special_tokens_in_text_stay_text(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(tmp_path)
    tok = build_tokenizer(DataConfig(tokenizer=str(tmp_path)))
    ids = tok.encode("the cat<|endoftext|>sat")
    assert tok.eos_token_id not in ids and tok.decode(ids) == "the cat<|endoftext|>sat"
    assert tok.encode("the cat") == tok.hf("the cat", add_special_tokens=False)["input_ids"]


def test_unloadable_tokenizer_is_one_clear_error(tmp_path):
    missing = str(tmp_path / "no_such_tokenizer")
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*no_such_tokenizer.*tokenizer: byte"):
        build_tokenizer(DataConfig(tokenizer=missing))


def test_dtype_by_vocab_size():
    assert token_dtype(259).name == token_dtype(65_536).name == "uint16"
    assert token_dtype(65_537).name == "uint32"
