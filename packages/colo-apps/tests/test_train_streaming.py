"""The trainer reading a streamed corpus (``data.streaming``).

- The held-out head: the first windows of the unsplit corpus are `PackedDataset`'s first windows, and each rank's
  training stream is exactly its share of the documents after the head (split by file and by document), so no
  held-out document is trained on.
- The trainer on 2 ranks: a run stopped at a step and resumed from its checkpoint has the uninterrupted run's losses
  and batches exactly; no held-out document reaches a training batch; the log line says it streams.
- What a stream cannot do is refused when the config validates, naming the field; a checkpoint of another data kind
  is refused when it loads.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("datasets")

from colo.apps.data import ByteTokenizer, PackedDataset  # noqa: E402
from colo.apps.data.sampler import ResumableDistributedSampler  # noqa: E402
from colo.apps.data.streaming import HeldOutHead, StreamingPackedSource, load_streaming_corpus  # noqa: E402
from colo.comm.testing import run_distributed  # noqa: E402

TOKENIZER = ByteTokenizer()
SEQ_LEN, BATCH_SIZE = 16, 2


def marker(file: int, doc: int) -> str:
    return f"<f{file}d{doc}>"


def write_corpus(tmp_path, num_files: int, docs_per_file: int) -> list[str]:
    """JSON Lines files of documents of varied lengths, each naming itself with a unique marker."""
    files = []
    for f in range(num_files):
        path = tmp_path / f"part{f}.jsonl"
        texts = [marker(f, d) + " text" * ((5 * d + 3 * f) % 11) for d in range(docs_per_file)]
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        files.append(str(path))
    return files


def texts_of(files: list[str]) -> list[list[str]]:
    return [[json.loads(line)["text"] for line in open(file)] for file in files]


def windows(documents: list[str]) -> torch.Tensor:
    """`PackedDataset`'s windows of ``documents``, stacked."""
    packed = PackedDataset(documents, TOKENIZER, seq_len=SEQ_LEN)
    return torch.stack([packed[i]["input_ids"] for i in range(len(packed))])


# --- the held-out head --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_files", "world_size"), [(4, 1), (4, 2), (3, 2)], ids=["one-rank", "split-by-file", "split-by-document"]
)
def test_each_rank_streams_its_share_of_the_documents_after_the_held_out_head(tmp_path, num_files, world_size):
    files = write_corpus(tmp_path, num_files, docs_per_file=6)
    corpus = load_streaming_corpus(files)
    head = HeldOutHead(corpus, TOKENIZER, num_windows=16, seq_len=SEQ_LEN)
    per_file = texts_of(files)
    in_order = [text for texts in per_file for text in texts]
    assert 6 < head.num_documents < 12  # the head ends inside the second file: both splits must skip across files
    assert torch.equal(head.windows, windows(in_order)[:16])

    held_out = head.num_documents
    for rank in range(world_size):
        if num_files % world_size == 0:  # files rank, rank + world_size, ... minus their held-out head
            position = [sum(len(texts) for texts in per_file[:f]) for f in range(num_files)]
            share = [
                text
                for f in range(rank, num_files, world_size)
                for d, text in enumerate(per_file[f])
                if position[f] + d >= held_out
            ]
        else:  # every world_size-th document after the head
            share = in_order[held_out:][rank::world_size]
        packed = windows(share)
        expected = packed[: len(packed) // BATCH_SIZE * BATCH_SIZE].view(-1, BATCH_SIZE, SEQ_LEN)
        skip = head.documents_to_skip(rank, world_size)
        options = {"seq_len": SEQ_LEN, "batch_size": BATCH_SIZE, "rank": rank, "world_size": world_size}
        with StreamingPackedSource(corpus, TOKENIZER, repeat=False, skip_documents=skip, **options) as source:
            streamed = torch.stack([batch["input_ids"] for batch in source])
        assert torch.equal(streamed, expected), rank


# --- the trainer: stopped, resumed, equal to the uninterrupted run ------------------------------------------------

STOP, TOTAL = 2, 4


def trainer_config(files: list[str], output_dir: str, **schedule) -> dict:
    return {
        "name": "streaming-resume",
        "output_dir": output_dir,
        "seed": 5,
        "model": {"preset": "tiny"},
        "plugin": {"name": "ddp", "precision": "fp32"},
        "schedule": {"total_steps": TOTAL, "warmup_steps": 1, **schedule},
        "data": {"paths": files, "streaming": True, "seq_len": 32, "global_batch_size": 4},
        "checkpoint": {"every_steps": STOP, "resume": "auto", "async_save": False},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "eval": {"every_steps": STOP, "num_sequences": 4, "batch_size": 2},
        "sample": {"max_new_tokens": 0},
    }


def _train_three_ways(files: list[str], root: str) -> dict:
    """On this rank: the uninterrupted run, then a run stopped at `STOP` and the same run resumed; each run's losses,
    eval losses, the batches it trained on, its data description and eval windows, and the stream threads left."""
    import threading

    from colo.apps.train import train, validate_config
    from colo.apps.train.streaming_data import StreamingRunData

    original = StreamingRunData.train_batches
    runs = {}
    for name, directory, schedule in (
        ("full", f"{root}/full", {}),
        ("stopped", f"{root}/parted", {"stop_at_step": STOP}),
        ("resumed", f"{root}/parted", {}),
    ):
        seen = runs[name] = {"batches": []}

        def recording(self, seen=seen):
            seen["description"], seen["eval"] = self.description, self.eval.windows.tolist()
            for batch, num_tokens in original(self):
                seen["batches"].append(batch["input_ids"].tolist())
                yield batch, num_tokens

        StreamingRunData.train_batches = recording
        try:
            result = train(validate_config(trainer_config(files, directory, **schedule)))
        finally:
            StreamingRunData.train_batches = original
        seen.update(losses=result.losses, eval_losses=result.eval_losses, start=result.start_step)
        seen["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("colo-streaming")]

    def failing(self):  # a run that fails after its first batch: its stream is closed all the same
        batches = original(self)
        yield next(batches)
        raise RuntimeError("a failure inside the loop")

    StreamingRunData.train_batches = failing
    config = {**trainer_config(files, f"{root}/failed"), "checkpoint": {"enabled": False}}
    try:
        train(validate_config(config))
    except RuntimeError as error:
        runs["failed"] = {"error": str(error)}
    finally:
        StreamingRunData.train_batches = original
    runs["failed"]["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("colo-streaming")]
    return runs


def test_a_streamed_run_stopped_and_resumed_equals_the_uninterrupted_run(tmp_path):
    files = write_corpus(tmp_path, num_files=4, docs_per_file=8)
    ranks = run_distributed(_train_three_ways, files, str(tmp_path), world_size=2)

    for rank in ranks:
        full, stopped, resumed = rank["full"], rank["stopped"], rank["resumed"]
        assert sorted(full["losses"]) == list(range(1, TOTAL + 1)) and resumed["start"] == STOP
        # the same batches and bit-identical losses: the resumed stream continues exactly after the saved batch
        assert stopped["batches"] + resumed["batches"] == full["batches"]
        assert {**stopped["losses"], **resumed["losses"]} == full["losses"]
        assert stopped["eval_losses"] == {STOP: full["eval_losses"][STOP]}
        assert full["threads"] == stopped["threads"] == resumed["threads"] == []  # every source closed
        assert rank["failed"] == {"error": "a failure inside the loop", "threads": []}  # also when the run fails
        assert "streamed (data.streaming) from " in full["description"]
        assert "split over 2 data-parallel ranks by file" in full["description"]
        assert "the corpus's first 4 windows" in full["description"]
    assert ranks[0]["full"]["batches"] != ranks[1]["full"]["batches"]  # the ranks read different shares

    # the held-out documents (the head of file 0) are the eval windows, the same on both ranks, and in no batch
    head = HeldOutHead(load_streaming_corpus(files), TOKENIZER, num_windows=4, seq_len=32)
    assert head.documents_per_file[1:] == [0, 0, 0] and 0 < head.num_documents < 8
    assert ranks[0]["full"]["eval"] == ranks[1]["full"]["eval"] == head.windows.tolist()
    trained = [
        TOKENIZER.decode([token for batch in rank["full"]["batches"] for row in batch for token in row])
        for rank in ranks
    ]
    assert not any(marker(0, d) in text for d in range(head.num_documents) for text in trained)
    assert marker(0, head.num_documents) in trained[0]  # rank 0 (files 0 and 2) starts right after the head


# --- refusals -----------------------------------------------------------------------------------------------------


def test_what_a_stream_cannot_do_is_refused_when_the_config_validates(tmp_path):
    from colo.apps.train import ConfigError, load_config

    files = write_corpus(tmp_path, num_files=1, docs_per_file=3)
    streaming = [f"data.paths=[{files[0]}]", "data.streaming=true"]
    load_config(overrides=streaming)  # pretrain, fixed windows, data.shuffle at its default: accepted
    refused = {
        "data.packing=documents": "data.streaming packs the stream into fixed windows, and data.packing='documents'",
        "data.max_tokens=1000": "data.streaming reads the corpus while training, and data.max_tokens=1000",
        "data.format=hf": "data.streaming reads JSON Lines, text or Parquet files, and data.format='hf'",
        "data.task=sft": "data.streaming is read with data.task in ['pretrain'] (data.task='sft')",
    }
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(overrides=[*streaming, override])
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match=re.escape("data.streaming reads raw files, and a prepared corpus")):
        load_config(overrides=[f"data.blend=[{{path: {prepared}, weight: 1}}]", "data.streaming=true"])


class _Group:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def test_a_checkpoint_of_another_data_kind_is_refused_when_it_loads(tmp_path):
    from colo.apps.train import load_config
    from colo.apps.train.data_setup import build_data

    files = write_corpus(tmp_path, num_files=2, docs_per_file=4)
    config = load_config(overrides=[f"data.paths={files}", "data.streaming=true", "data.seq_len=16"])
    streamed = build_data(config, TOKENIZER, num_replicas=2, rank=1)
    in_memory = ResumableDistributedSampler(64, num_replicas=2, rank=1, batch_size=8)
    try:
        assert streamed.train is None and "streamed (data.streaming) from " in streamed.description
        assert "(data.shuffle=true is ignored: a stream is not shuffled)" in streamed.description
        with pytest.raises(ValueError, match=re.escape("the checkpoint's run read data.paths tokenized in memory")):
            streamed.load_state_dict(in_memory.state_dict(), _Group(1, 2))
        with pytest.raises(ValueError, match=re.escape("the checkpoint's run read prepared corpora")):
            streamed.load_state_dict({"kind": "global-position", "samples_consumed": 0}, _Group(1, 2))
        state = {"kind": "streaming", "version": 1, "ranks": [streamed.source.state_dict()] * 2}
        with pytest.raises(ValueError, match="streamed over 2 data-parallel ranks and this run has 4"):
            streamed.load_state_dict(state, _Group(1, 4))
        with pytest.raises(ValueError, match=re.escape("the checkpoint's run streamed data.paths (data.streaming)")):
            in_memory.load_state_dict(state)
    finally:
        streamed.close()
