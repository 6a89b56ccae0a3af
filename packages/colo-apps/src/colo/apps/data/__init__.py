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

from .._lazy import lazy_exports

_EXPORTS = {
    "Blend": "blend",
    "BlendPattern": "blend",
    "describe_corpus": "describe",
    "GlobalPositionSampler": "global_sampler",
    "KeyedPermutation": "order",
    "IGNORE_INDEX": "packing",
    "PackedDataset": "packing",
    "TokenBudgetDataset": "packing",
    "pack_to_token_budget": "packing",
    "tokenize_documents": "packing",
    "prepare_corpus": "prepare",
    "PreparedDocuments": "prepared",
    "PreparedWindows": "prepared",
    "is_prepared_corpus": "prepared",
    "ResumableDistributedSampler": "sampler",
    "batches": "sampler",
    "check_token_ids": "sampler",
    "collate": "sampler",
    "ChatTemplate": "sft",
    "SFTDataset": "sft",
    "conversation_of": "sft",
    "CorpusError": "shards",
    "TokenCorpus": "shards",
    "tokenizer_identity": "shards",
    "Document": "sources",
    "default_corpus": "sources",
    "read_documents": "sources",
    "validate_messages": "sources",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}
"""Where each name lives, imported on first use (PEP 562): the tokenizers, sources and shard writers are torch-free,
so ``colo data prepare``'s worker processes import them without torch; the datasets and samplers import it."""


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


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
