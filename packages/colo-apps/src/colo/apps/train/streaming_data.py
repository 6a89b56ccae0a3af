"""The run's data when it streams ``data.paths`` (``data.streaming``): `StreamingRunData` and `build_streaming_data`.

Nothing of the training corpus is tokenized at start-up: each data-parallel rank's `StreamingPackedSource` reads its
share of the files (``datasets.distributed.split_dataset_by_node``) and packs it into fixed windows in a background
thread while the model trains, in file order. With ``eval.every_steps`` the first ``eval.num_sequences`` windows of
the unsplit corpus are read at start-up on every rank (`HeldOutHead`) and the training stream starts after the
documents they used. A checkpoint holds every data-parallel rank's stream position; a run resumes exactly at the
same data-parallel size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from colo.comm import all_gather_object

from ..data import check_token_ids, default_corpus
from ..data.streaming import (
    CHECKPOINT_KIND,
    HeldOutHead,
    StreamingPackedSource,
    expand_paths,
    load_streaming_corpus,
)
from .data_setup import RunData

if TYPE_CHECKING:
    from .config import RunConfig

_BUILDERS = {"auto": None, "jsonl": "json", "text": "text"}  # data.format -> load_streaming_corpus's builder
_STATE_VERSION = 1


@dataclass
class StreamingRunData(RunData):
    """`RunData` over a stream: ``train`` and ``sampler`` are ``None``; batches come from ``source``.

    Attributes:
        source: this rank's stream of batches (closed by `close`).
    """

    source: StreamingPackedSource | None = None

    def train_batches(self) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        """This rank's training batches from the stream, each with its number of tokens (every window is full)."""
        for batch in self.source:
            if self.vocab_size is not None:
                check_token_ids(batch, self.vocab_size)
            yield batch, batch["input_ids"].numel()

    def state_dict(self, group) -> dict[str, Any]:
        """Every data-parallel rank's stream position (a collective over ``group``), in rank order."""
        ranks = all_gather_object(self.source.state_dict(), group=group)
        return {"kind": CHECKPOINT_KIND, "version": _STATE_VERSION, "ranks": ranks}

    def load_state_dict(self, state: Mapping[str, Any], group) -> None:
        """Continue this rank's stream at its saved position.

        Raises:
            ValueError: the checkpoint's run read its data another way, or at another data-parallel size.
        """
        kind = state.get("kind")
        if kind != CHECKPOINT_KIND:
            what = (
                "read prepared corpora (data.blend or a prepared corpus in data.paths)"
                if kind is not None
                else "read data.paths tokenized in memory (data.streaming=false)"
            )
            raise ValueError(
                f"cannot resume the data position: the checkpoint's run {what}, this run streams data.paths "
                "(data.streaming); resume with the checkpoint's data settings, or start a fresh run "
                "(checkpoint.resume=none)"
            )
        ranks = state["ranks"]
        if len(ranks) != group.size:
            raise ValueError(
                f"cannot resume the data position: the checkpoint's run streamed over {len(ranks)} data-parallel "
                f"ranks and this run has {group.size}; a streamed corpus splits by rank count, so resume with the "
                "same data-parallel size, or prepare the corpus with `colo data prepare` for exact resume across "
                "data-parallel sizes"
            )
        self.source.load_state_dict(ranks[group.rank])

    def close(self) -> None:
        """Stop the source's background thread."""
        self.source.close()


def build_streaming_data(
    config: RunConfig,
    tokenizer,
    *,
    num_replicas: int,
    rank: int,
    batch_size: int,
    vocab_size: int | None = None,
) -> StreamingRunData:
    """This rank's stream of ``data.paths`` and, with ``eval.every_steps``, the held-out head of the corpus.

    Args:
        config: the run config (``data.streaming`` set; its validation refused what a stream cannot do).
        tokenizer: the run's tokenizer.
        num_replicas: data-parallel ranks that get different samples.
        rank: this rank's index among them.
        batch_size: windows per step on this rank.
        vocab_size: the model's vocabulary, which every batch's ids are checked against.

    Raises:
        ValueError: the corpus holds fewer tokens than the held-out windows (the message names the fields).
    """
    data = config.data
    files = expand_paths(data.paths or [str(path) for path in default_corpus()])
    builder = _BUILDERS[data.format] if data.paths else "text"
    corpus = load_streaming_corpus(files, builder=builder)
    held_out = config.eval.num_sequences if config.eval.every_steps else 0
    head = None
    if held_out:
        try:
            head = HeldOutHead(
                corpus, tokenizer, num_windows=held_out, seq_len=data.seq_len, text_field=data.text_field
            )
        except ValueError as error:
            raise ValueError(f"eval.num_sequences={held_out} with data.streaming: {error}") from None
    source = StreamingPackedSource(
        corpus,
        tokenizer,
        seq_len=data.seq_len,
        batch_size=batch_size,
        rank=rank,
        world_size=num_replicas,
        text_field=data.text_field,
        skip_documents=0 if head is None else head.documents_to_skip(rank, num_replicas),
    )
    return StreamingRunData(
        tokenizer=tokenizer,
        train=None,
        eval=head,
        sampler=None,
        batch_size=batch_size,
        description=_describe(config, files, corpus.num_shards, num_replicas, head),
        vocab_size=vocab_size,
        source=source,
    )


def _describe(config: RunConfig, files: list[str], num_shards: int, num_replicas: int, head: HeldOutHead | None) -> str:
    """The log line: what is streamed, from which files, how the data-parallel ranks split it, what is held out."""
    data = config.data
    shown = ", ".join(files[:3]) + (f", ... ({len(files)} files)" if len(files) > 3 else "")
    if num_replicas == 1:
        split = "on one data-parallel rank"
    elif num_shards % num_replicas == 0:
        split = f"split over {num_replicas} data-parallel ranks by file (rank r reads files r, r + {num_replicas}, ...)"
    else:
        split = (
            f"split over {num_replicas} data-parallel ranks by document (rank r reads documents r, r + "
            f"{num_replicas}, ...: {num_shards} files do not divide over the ranks)"
        )
    text = f"streamed (data.streaming) from {shown}, fixed windows of {data.seq_len} tokens packed while training"
    text += f", {split}"
    text += ", in file order" + (" (data.shuffle=true is ignored: a stream is not shuffled)" if data.shuffle else "")
    if head is not None:
        text += (
            f"; the corpus's first {len(head)} windows ({head.num_documents} documents) held out for eval, the "
            "training stream starts after them"
        )
    return text
