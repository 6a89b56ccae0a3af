"""Streaming pre-training data: PackedDataset's windows, split by rank, resumed exactly, stopped cleanly."""

import gc
import json
import threading

import pytest
import torch

pytest.importorskip("datasets")

from colo.apps.data import ByteTokenizer, PackedDataset, read_documents  # noqa: E402
from colo.apps.data.streaming import StreamingPackedSource, load_streaming_corpus  # noqa: E402

SEQ_LEN, BATCH_SIZE = 16, 3


def _corpus(tmp_path, num_files=3, docs_per_file=9):
    """JSON Lines files of unique documents of varied lengths (some longer than a window, one empty)."""
    files = []
    for f in range(num_files):
        file = tmp_path / f"part{f}.jsonl"
        lines = []
        for d in range(docs_per_file):
            text = "" if (f, d) == (1, 4) else f"file {f} doc {d} " + "é" * ((7 * d + 3 * f) % 23)
            lines.append(json.dumps({"text": text, "id": f"{f}-{d}"}))
        file.write_text("\n".join(lines) + "\n")
        files.append(file)
    return files


def _take(source, count):
    return [next(source) for _ in range(count)]


def _packed_batches(documents):
    """PackedDataset's windows over ``documents``, grouped into batches: what a rank must stream."""
    packed = PackedDataset(documents, ByteTokenizer(), seq_len=SEQ_LEN)
    rows = [packed[i]["input_ids"] for i in range(len(packed))]
    return [torch.stack(rows[i : i + BATCH_SIZE]) for i in range(0, len(rows) - BATCH_SIZE + 1, BATCH_SIZE)]


def _source(files, **options):
    options = {"seq_len": SEQ_LEN, "batch_size": BATCH_SIZE, "prefetch_batches": 2, **options}
    return StreamingPackedSource([str(f) for f in files], ByteTokenizer(), **options)


def test_one_rank_streams_packed_datasets_windows(tmp_path):
    files = _corpus(tmp_path)
    expected = _packed_batches(list(read_documents(files)))
    with _source(files, repeat=False) as source:
        streamed = list(source)
    assert len(streamed) == len(expected) > 5
    for got, want in zip(streamed, expected, strict=True):
        assert got["input_ids"].dtype == torch.int64 and got["input_ids"].shape == (BATCH_SIZE, SEQ_LEN)
        assert torch.equal(got["input_ids"], want) and torch.equal(got["labels"], want)


@pytest.mark.parametrize("num_files", [2, 3], ids=["files-split-by-rank", "records-split-by-rank"])
def test_two_ranks_stream_disjoint_shares(tmp_path, num_files):
    # 2 files: each rank reads one (datasets' "shards" split); 3 files: each rank keeps every other record
    files = _corpus(tmp_path, num_files=num_files)
    documents = list(read_documents(files))
    shares = [documents[rank::2] for rank in range(2)] if num_files == 3 else [read_documents(f) for f in files]
    for rank, share in enumerate(shares):
        expected = _packed_batches(list(share))
        with _source(files, rank=rank, world_size=2, repeat=False) as source:
            streamed = list(source)
        assert len(streamed) == len(expected) > 1
        assert all(torch.equal(got["input_ids"], want) for got, want in zip(streamed, expected, strict=True))


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_after_k_batches_continues_the_uninterrupted_stream(tmp_path, world_size):
    files = _corpus(tmp_path)
    rank = world_size - 1
    with _source(files, rank=rank, world_size=world_size) as source:
        # enough batches to run past the end of the corpus into a second pass (repeat=True)
        reference = [batch["input_ids"] for batch in _take(source, 40 // world_size)]
        assert source.state_dict()["epoch"] >= 1
    for k in range(1, len(reference) - 2, 3):
        with _source(files, rank=rank, world_size=world_size, prefetch_batches=3) as first:
            _take(first, k)  # the thread has read ahead of these k batches
            state = json.loads(json.dumps(first.state_dict()))
        assert state["batches_yielded"] == k
        with _source(files, rank=rank, world_size=world_size) as resumed:
            resumed.load_state_dict(state)
            for expected in reference[k : k + 3]:
                assert torch.equal(next(resumed)["input_ids"], expected), f"resumed after batch {k}"


def test_resume_within_one_source_drops_its_read_ahead(tmp_path):
    files = _corpus(tmp_path)
    with _source(files) as source:
        reference = [batch["input_ids"] for batch in _take(source, 8)]
    with _source(files) as source:
        _take(source, 2)
        state = source.state_dict()
        _take(source, 3)
        source.load_state_dict(state)
        assert all(torch.equal(next(source)["input_ids"], expected) for expected in reference[2:6])


def test_changed_data_parallel_size_is_refused(tmp_path):
    files = _corpus(tmp_path)
    with _source(files) as source:
        next(source)
        state = source.state_dict()
    with _source(files, rank=0, world_size=2) as source, pytest.raises(ValueError, match="colo data prepare"):
        source.load_state_dict(state)
    state["rank"] = 1
    with _source(files) as source, pytest.raises(ValueError, match="rank 1's, loaded on rank 0"):
        source.load_state_dict(state)


def test_worker_errors_reach_the_consumer_with_their_message(tmp_path):
    files = _corpus(tmp_path)
    with _source(files, text_field="body") as source, pytest.raises(ValueError, match="no field 'body'.*text_field="):
        next(source)

    class FailingTokenizer(ByteTokenizer):
        def encode_arrays(self, texts):
            raise RuntimeError("tokenizer broke on purpose")

    source = StreamingPackedSource(load_streaming_corpus(files), FailingTokenizer(), seq_len=SEQ_LEN, batch_size=1)
    with source, pytest.raises(RuntimeError, match="tokenizer broke on purpose"):
        next(source)
    with pytest.raises(RuntimeError, match="closed"):
        next(source)


def _streaming_threads():
    return [thread for thread in threading.enumerate() if thread.name.startswith("colo-streaming")]


def test_close_leaves_no_live_thread(tmp_path):
    files = _corpus(tmp_path)
    source = _source(files, prefetch_batches=1)
    next(source)  # the thread now blocks on its full queue
    assert len(_streaming_threads()) == 1
    source.close()
    source.close()
    assert not _streaming_threads()
    # a source dropped without close() stops its thread when collected (and at interpreter exit: weakref.finalize)
    source = _source(files, prefetch_batches=1)
    next(source)
    del source
    gc.collect()
    assert not _streaming_threads()


def test_settings_and_corpora_are_checked(tmp_path):
    files = _corpus(tmp_path)
    with pytest.raises(ValueError, match="seq_len=0 must be positive"):
        _source(files, seq_len=0)
    with pytest.raises(ValueError, match="rank=2 must lie in 0..world_size-1"):
        _source(files, rank=2, world_size=2)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        _source([tmp_path / "missing-*.jsonl"])
    with _source(files, seq_len=10_000) as source, pytest.raises(ValueError, match="fewer than seq_len=10000"):
        next(source)
