"""Packing: fixed windows over one token stream, and token-budget rows of whole documents."""

import pytest
import torch

from colo.apps.data import (
    ByteTokenizer,
    PackedDataset,
    TokenBudgetDataset,
    default_corpus,
    pack_to_token_budget,
    read_documents,
)

DOCS = ["alpha", "", "naïve café", "x" * 40, "the end"]


def _stream(docs, tokenizer, *, bos=True, eos=True):
    tokens = []
    for doc in docs:
        tokens += ([tokenizer.bos_id] if bos else []) + tokenizer.encode(doc) + ([tokenizer.eos_id] if eos else [])
    return tokens


def test_windows_concatenate_to_the_token_stream():
    tokenizer = ByteTokenizer()
    dataset = PackedDataset(DOCS, tokenizer, seq_len=8)
    stream = _stream(DOCS, tokenizer)
    assert dataset.tokens.dtype == torch.int32 and dataset.tokens.tolist() == stream
    assert len(dataset) == len(stream) // 8 and dataset.num_documents == len(DOCS)
    windows = [dataset[i] for i in range(len(dataset))]
    for item in windows:
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].shape == (8,)
        assert torch.equal(item["labels"], item["input_ids"])
    assert torch.cat([w["input_ids"] for w in windows]).tolist() == stream[: len(dataset) * 8]
    # bos opens and eos closes every document; the empty one is just the pair
    assert stream[:7] == [256, *b"alpha", 257] and stream[7:9] == [256, 257]
    assert torch.equal(dataset[-1]["input_ids"], windows[-1]["input_ids"])
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_max_tokens_and_separators_off():
    tokenizer = ByteTokenizer()
    capped = PackedDataset(DOCS, tokenizer, seq_len=4, max_tokens=10)
    assert capped.tokens.tolist() == _stream(DOCS, tokenizer)[:10] and len(capped) == 2
    bare = PackedDataset(DOCS, tokenizer, seq_len=4, add_bos=False, add_eos=False)
    assert bare.tokens.tolist() == list("".join(DOCS).encode())
    with pytest.raises(ValueError, match="fewer than seq_len=1000; add data"):
        PackedDataset(DOCS, tokenizer, seq_len=1000)
    with pytest.raises(TypeError, match="document 0 is a list, not text"):
        PackedDataset([[{"role": "user", "content": "hi"}]], tokenizer, seq_len=4)


def test_the_standard_library_packs_into_whole_sequences():
    # (no time limit here: the suite runs on shared, loaded machines; the demo's start-up time is in the README)
    dataset = PackedDataset(read_documents(default_corpus()), ByteTokenizer(), seq_len=256)
    assert dataset.num_tokens > 1_000_000 and len(dataset) == dataset.num_tokens // 256


def test_pack_to_token_budget_fits_every_sequence_once():
    lengths = [7, 3, 8, 1, 5, 2, 2, 6, 4, 8, 1]
    rows = pack_to_token_budget(lengths, seq_len=8)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 8 for row in rows)
    assert len(rows) == -(-sum(lengths) // 8)  # this instance packs perfectly: 47 tokens in 6 rows
    with pytest.raises(ValueError, match="sequence 0 has length 9"):
        pack_to_token_budget([9], seq_len=8)


def test_token_budget_rows_hold_whole_documents_with_restarting_positions():
    tokenizer = ByteTokenizer()
    docs = ["a" * n for n in (3, 10, 1, 6, 13, 2, 4, 0, 30)]
    seq_len = 16
    dataset = TokenBudgetDataset(docs, tokenizer, seq_len=seq_len)
    seen = []
    for index in range(len(dataset)):
        item = dataset[index]
        assert set(item) == {"input_ids", "labels", "position_ids"}
        ids, labels, positions = item["input_ids"], item["labels"], item["position_ids"]
        assert ids.shape == labels.shape == positions.shape == (seq_len,)
        real = int(sum(length for _, length in dataset.sequence_rows[index]))
        assert real <= seq_len  # the budget is never exceeded
        assert (ids[real:] == tokenizer.pad_id).all() and (labels[real:] == -100).all()
        cursor = 0
        for _start, length in dataset.sequence_rows[index]:
            assert positions[cursor : cursor + length].tolist() == list(range(length))  # restart per sequence
            assert labels[cursor] == -100  # nothing predicts across a boundary
            assert torch.equal(labels[cursor + 1 : cursor + length], ids[cursor + 1 : cursor + length])
            seen.append(ids[cursor : cursor + length].tolist())
            cursor += length
    # every document appears exactly once, whole, framed by bos/eos; the 32-token one is cut into two rows
    expected = [[256, *b"a" * n, 257] for n in (3, 10, 1, 6, 13, 2, 4, 0)]
    long = [256, *b"a" * 30, 257]
    expected += [long[:16], long[16:]]
    assert sorted(seen) == sorted(expected)
    assert 0 < dataset.efficiency <= 1
    # a batch of B rows is a budget of B * seq_len token slots
    batch = torch.stack([dataset[i]["input_ids"] for i in range(len(dataset))])
    assert batch.numel() == len(dataset) * seq_len
