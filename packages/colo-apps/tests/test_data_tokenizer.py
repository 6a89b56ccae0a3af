"""Tokenizers: exact byte round trips, a Hugging Face tokenizer.json built here, and load_tokenizer."""

import json

import numpy as np
import pytest
import torch

from colo.apps.data import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

TEXTS = ["hello world", "", "naïve café — 東京 🚀", "tabs\tand\nnewlines\r\n", "Ünïcödé " * 5]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(torch.tensor(ids)) == text
    (array,) = tokenizer.encode_arrays([text])
    assert array.dtype == np.int32 and array.tolist() == ids


def test_byte_tokenizer_specials_and_invalid_utf8():
    tokenizer = ByteTokenizer()
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size) == (256, 257, 258, 259)
    assert isinstance(tokenizer, Tokenizer)
    ids = [tokenizer.bos_id, *b"hi", tokenizer.eos_id, tokenizer.pad_id]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>hi<eos><pad>"
    # A multi-byte character cut in half decodes to the replacement character, not an exception.
    assert tokenizer.decode(list("é".encode())[:1] + list(b"x")) == "\ufffdx"
    with pytest.raises(ValueError, match="outside 0..258"):
        tokenizer.decode([259])
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def _train_tokenizer(directory, specials=("<s>", "</s>", "<pad>")):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        show_progress=False,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["hello world, hello colo", "naïve café 東京"] * 20, trainer=trainer)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_hf_tokenizer_round_trips(tmp_path):
    path = _train_tokenizer(tmp_path)
    tokenizer = HFTokenizer(path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 1, 2)
    assert 259 < tokenizer.vocab_size <= 300  # 3 specials + 256 byte symbols + the merges learned
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids  # encode adds no special tokens
        assert tokenizer.decode(ids) == text
    assert [a.tolist() for a in tokenizer.encode_arrays(TEXTS)] == [tokenizer.encode(t) for t in TEXTS]
    assert len(tokenizer.encode("hello world")) < len("hello world")  # merges were learned
    # a directory works too, and load_tokenizer picks HFTokenizer for a path
    assert load_tokenizer(tmp_path).encode("hello") == tokenizer.encode("hello")


def test_hf_tokenizer_special_tokens_from_config_and_errors(tmp_path):
    path = _train_tokenizer(tmp_path, specials=("<|endoftext|>", "[X]"))
    tokenizer = HFTokenizer(path)  # GPT-2 style: one token ends and begins, and pads
    assert tokenizer.bos_id == tokenizer.eos_id == tokenizer.pad_id == 0
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": {"content": "[X]"}}))
    assert HFTokenizer(tmp_path).pad_id == 1
    with pytest.raises(ValueError, match="eos_token='<nope>' is not in the vocabulary"):
        HFTokenizer(path, eos_token="<nope>")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "bare").mkdir()
    bare = _train_tokenizer(tmp_path / "bare", specials=("[X]",))
    with pytest.raises(ValueError, match="pass eos_token="):
        HFTokenizer(bare)


def test_samples_show_bytes_that_are_not_utf8_escaped():
    from colo.apps.data import ByteTokenizer

    tokenizer = ByteTokenizer()
    broken = [*b"ok ", 0xE2, 0x82, *b"!"]  # a 3-byte character cut after 2 bytes
    assert tokenizer.decode(broken) == "ok \ufffd!"
    assert tokenizer.decode(broken, errors="backslashreplace") == "ok \\xe2\\x82!"
