"""colo.apps.data: tokenizers, document sources, packed pre-training and SFT datasets, and a resumable sampler.

The pieces a training run chains together::

    from colo.apps.data import (
        PackedDataset, ResumableDistributedSampler, batches, default_corpus, load_tokenizer, read_documents,
    )

    tokenizer = load_tokenizer(None)  # ByteTokenizer; or a path to a Hugging Face tokenizer.json
    dataset = PackedDataset(read_documents(default_corpus()), tokenizer, seq_len=256)
    sampler = ResumableDistributedSampler(len(dataset), num_replicas=dp_size, rank=dp_rank, batch_size=8, seed=0)
    for batch in batches(dataset, sampler, repeat=True):  # {"input_ids": (8, 256), "labels": (8, 256)}
        ...
    state = sampler.state_dict()  # JSON-able; load_state_dict(state) resumes at the next sample

- `tokenizer`: `ByteTokenizer` (UTF-8 bytes + bos/eos/pad, vocabulary 259), `HFTokenizer` (a ``tokenizer.json``),
  `load_tokenizer`.
- `sources`: `read_documents` (text files, globs, directories, JSON Lines of text / chat messages /
  prompt-response pairs, Parquet, Hugging Face datasets saved to disk) and `default_corpus` (the Python standard
  library).
- `packing`: `PackedDataset` (one token stream cut into ``seq_len`` windows) and the opt-in `TokenBudgetDataset`
  (whole documents bin-packed into rows, ``position_ids`` restarting per document; `pack_to_token_budget`).
- `sft`: `ChatTemplate` and `SFTDataset` (labels only on the assistant's replies).
- `sampler`: `ResumableDistributedSampler`, `batches` and `check_token_ids` (ids and labels within the model's
  vocabulary, which the trainer checks on every batch).
- `prepare` / `describe` / `shards`: `prepare_corpus` (``colo data prepare``: inputs tokenized by worker processes
  into a prepared corpus, resumable, the same whatever the number of workers), `describe_corpus` (``colo data
  inspect``), `TokenCorpus` (a prepared corpus, memory-mapped and CRC-checked), `CorpusError`,
  `tokenizer_identity`.
- `prepared` / `row_index`: `PreparedWindows` and `PreparedDocuments`, the rows of `PackedDataset` /
  `TokenBudgetDataset` over a prepared corpus, reading nothing at construction (the documents row index is computed
  once and cached beside the corpus).
- `order` / `blend` / `global_sampler`: `KeyedPermutation` (an epoch's order, per index, in O(1) memory), `Blend`
  (corpora interleaved by weight, each held-out tail split off) and `GlobalPositionSampler` (one global sample
  position as the state: a run resumes at any data-parallel size).
"""

from .blend import Blend, BlendPattern
from .describe import describe_corpus
from .global_sampler import GlobalPositionSampler
from .order import KeyedPermutation
from .packing import IGNORE_INDEX, PackedDataset, TokenBudgetDataset, pack_to_token_budget, tokenize_documents
from .prepare import prepare_corpus
from .prepared import PreparedDocuments, PreparedWindows, is_prepared_corpus
from .sampler import ResumableDistributedSampler, batches, check_token_ids, collate
from .sft import ChatTemplate, SFTDataset, conversation_of
from .shards import CorpusError, TokenCorpus, tokenizer_identity
from .sources import Document, default_corpus, read_documents, validate_messages
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Blend",
    "BlendPattern",
    "ByteTokenizer",
    "ChatTemplate",
    "CorpusError",
    "Document",
    "GlobalPositionSampler",
    "HFTokenizer",
    "KeyedPermutation",
    "PackedDataset",
    "PreparedDocuments",
    "PreparedWindows",
    "ResumableDistributedSampler",
    "SFTDataset",
    "TokenBudgetDataset",
    "TokenCorpus",
    "Tokenizer",
    "batches",
    "check_token_ids",
    "collate",
    "conversation_of",
    "default_corpus",
    "describe_corpus",
    "is_prepared_corpus",
    "load_tokenizer",
    "pack_to_token_budget",
    "prepare_corpus",
    "read_documents",
    "tokenize_documents",
    "tokenizer_identity",
    "validate_messages",
]
