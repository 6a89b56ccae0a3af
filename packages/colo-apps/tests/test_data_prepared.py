"""Training from prepared token shards: the rows, the order, blends, the held-out split and exact resumes.

- The keyed permutation is a bijection of [0, n), different per epoch and per seed, computed per index.
- Over a corpus written with `ShardWriter` from `tokenize_documents`, fixed windows are `PackedDataset`'s windows and
  packed documents are `TokenBudgetDataset`'s rows (one packing group), or the same sequences (several groups);
  building them reads no token block, and the documents row index is cached (in the run's folder when the corpus's
  is read-only).
- A blend gives each source its weight's share of the samples (exactly per block, within two samples on any
  prefix), repeats a small source in a new order every epoch, and never trains on the held-out tails.
- The loader's state is one global position: a run on prepared corpora stopped at dp=2 and resumed at dp=1 and at
  dp=4 reads exactly the next samples, each sample once (the trainer, in-process on ranks).
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from colo.apps.data import ByteTokenizer, PackedDataset, TokenBudgetDataset, tokenize_documents
from colo.apps.data import row_index as row_index_module
from colo.apps.data.blend import BLOCK, Blend, BlendPattern, largest_remainder
from colo.apps.data.global_sampler import GlobalPositionSampler
from colo.apps.data.order import KeyedPermutation
from colo.apps.data.prepared import PreparedDocuments, PreparedWindows
from colo.apps.data.sampler import ResumableDistributedSampler
from colo.apps.data.shards import ShardWriter, TokenCorpus, token_dtype, tokenizer_identity, write_manifest
from colo.comm.testing import run_distributed

TOKENIZER = ByteTokenizer()


def documents(count: int, *, salt: str = "") -> list[str]:
    """Documents of 8 to ~200 bytes (some longer than the rows below, so they are cut), numbered throughout, so the
    windows of 24 tokens and more of a corpus (and of corpora of different ``salt``) differ: a row's content names
    its sample (the trainer test asserts it)."""
    return [f"{salt}doc {n}:" + "".join(f" {salt}{n}-{k}" for k in range(n * 7 % 31)) for n in range(count)]


def write_corpus(directory, texts: list[str], *, num_shards: int = 3, identity: dict | None = None) -> str:
    """A prepared corpus of ``texts`` (framed by `tokenize_documents`) over ``num_shards`` shards."""
    directory.mkdir(parents=True)
    pieces = list(tokenize_documents(texts, TOKENIZER))
    per_shard = -(-len(pieces) // num_shards)
    records = []
    for shard in range(num_shards):
        writer = ShardWriter(directory, f"shard-{shard:05d}", token_dtype(TOKENIZER.vocab_size))
        for piece in pieces[shard * per_shard : (shard + 1) * per_shard]:
            writer.add(piece)
        records.append(writer.finish())
    write_manifest(directory, tokenizer=identity or tokenizer_identity(TOKENIZER), shards=records)
    return str(directory)


def untouched(corpus: TokenCorpus, *, index: bool) -> bool:
    """No token block (and, with ``index``, no document-index block) was read yet."""
    arrays = [shard.tokens for shard in corpus.shards] + ([shard.index for shard in corpus.shards] if index else [])
    return not any(array.checked.any() for array in arrays)


def items_equal(first: dict, second: dict) -> bool:
    return list(first) == list(second) and all(bool((first[key] == second[key]).all()) for key in first)


# --- the order ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 7, 1000, 4097])
def test_the_keyed_permutation_is_a_bijection_that_changes_with_epoch_and_seed(size):
    order = KeyedPermutation(size, seed=3, epoch=0)(np.arange(size))
    assert sorted(order.tolist()) == list(range(size))
    # per index: any subset of positions maps as in the whole order
    positions = np.arange(size)[::3]
    assert order[positions].tolist() == KeyedPermutation(size, seed=3, epoch=0)(positions).tolist()
    if size >= 7:
        assert not np.array_equal(order, KeyedPermutation(size, seed=3, epoch=1)(np.arange(size)))
        assert not np.array_equal(order, KeyedPermutation(size, seed=4, epoch=0)(np.arange(size)))
        assert not np.array_equal(order, np.arange(size))


# --- rows over shards ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [None, 3000])
def test_fixed_windows_over_shards_are_packed_datasets_windows(tmp_path, max_tokens):
    texts = documents(120)
    corpus = TokenCorpus(write_corpus(tmp_path / "corpus", texts), tokenizer=TOKENIZER)
    windows = PreparedWindows(corpus, seq_len=40, max_tokens=max_tokens)
    assert untouched(corpus, index=True)  # construction reads no block at all
    reference = PackedDataset(texts, TOKENIZER, seq_len=40, max_tokens=max_tokens)
    assert len(windows) == len(reference) and windows.num_tokens == reference.num_tokens
    for index in range(len(reference)):  # windows cross document and shard boundaries
        assert items_equal(windows[index], reference[index]), index


@pytest.mark.parametrize(("seq_len", "max_tokens"), [(48, None), (100, 4000)])
def test_packed_documents_over_shards_are_token_budget_datasets_rows(tmp_path, seq_len, max_tokens):
    texts = documents(150)
    corpus = TokenCorpus(write_corpus(tmp_path / "corpus", texts), tokenizer=TOKENIZER)
    rows = PreparedDocuments(corpus, seq_len=seq_len, pad_id=TOKENIZER.pad_id, max_tokens=max_tokens)
    assert untouched(corpus, index=False)  # the row index reads the document index, never a token
    reference = TokenBudgetDataset(texts, TOKENIZER, seq_len=seq_len, max_tokens=max_tokens)
    # one packing group: the very rows of TokenBudgetDataset (best fit, longest first), item for item
    assert rows.sequence_rows == reference.sequence_rows
    assert rows.efficiency == reference.efficiency
    for index in range(len(reference)):
        assert items_equal(rows[index], reference[index]), index
    assert rows.row_lengths([0, len(rows) - 1]).tolist() == reference.row_lengths[[0, -1]].tolist()


def test_packed_documents_in_groups_hold_the_same_sequences_and_the_index_is_cached(tmp_path, monkeypatch):
    texts = documents(150)
    path = write_corpus(tmp_path / "corpus", texts)
    reference = TokenBudgetDataset(texts, TOKENIZER, seq_len=64)
    whole = PreparedDocuments(TokenCorpus(path), seq_len=64, pad_id=TOKENIZER.pad_id)  # one group: computed now
    assert whole.sequence_rows == reference.sequence_rows
    small = row_index_module.documents_row_index(TokenCorpus(path), seq_len=64, group=16)  # groups cross shards

    def sequences(row_lists) -> list[tuple[int, int]]:
        return sorted(piece for row in row_lists for piece in row)

    small_rows = [[tuple(piece) for piece in small.row(row).tolist()] for row in range(small.num_rows)]
    assert sequences(small_rows) == sequences(reference.sequence_rows)  # every cut piece once, nothing else
    assert all(sum(length for _, length in row) <= 64 for row in small_rows)
    assert small.num_rows >= len(reference)

    def no_packing(*args, **kwargs):
        raise AssertionError("the cached index was computed again")

    monkeypatch.setattr(row_index_module, "pack_documents", no_packing)
    again = PreparedDocuments(TokenCorpus(path), seq_len=64, pad_id=TOKENIZER.pad_id)  # from <corpus>/cache
    assert again.sequence_rows == reference.sequence_rows
    monkeypatch.undo()

    # a read-only corpus folder: the index goes to the run's folder
    writable = row_index_module._writable
    corpus_cache = tmp_path / "corpus" / row_index_module.CACHE_DIR
    monkeypatch.setattr(row_index_module, "_writable", lambda folder: folder != corpus_cache and writable(folder))
    run_cache = tmp_path / "run" / "data-cache"
    elsewhere = PreparedDocuments(TokenCorpus(path), seq_len=32, pad_id=TOKENIZER.pad_id, fallback_dirs=[run_cache])
    assert sorted(p.name for p in run_cache.glob("*.json")) == [
        f"documents-seq32-tokens{elsewhere.num_tokens}-group65536.json"
    ]
    assert len(elsewhere) == len(TokenBudgetDataset(texts, TOKENIZER, seq_len=32))


# --- blends, the held-out split, the loader's state ---------------------------------------------------------------


def test_a_blend_gives_each_source_its_weights_share(tmp_path):
    weights = [0.5, 0.3, 0.15, 0.05]
    pattern = BlendPattern(weights)
    assert pattern.quotas == largest_remainder(BLOCK, weights) == [5000, 3000, 1500, 500]
    sources, numbers = pattern.locate(np.arange(3 * BLOCK))
    counts = np.stack([np.cumsum(sources == k) for k in range(len(weights))], axis=1)
    expected = np.arange(1, 3 * BLOCK + 1)[:, None] * np.asarray(weights)
    assert np.abs(counts - expected).max() <= 2  # spread out: any prefix is within two samples of its share
    for k in range(len(weights)):  # each source's samples are numbered 0, 1, 2, ... in stream order
        assert numbers[sources == k].tolist() == list(range(int(counts[-1, k])))

    # through a blend of two corpora, the small one repeated: its epochs each cover it once, in new orders
    small = PreparedWindows(TokenCorpus(write_corpus(tmp_path / "a", documents(30), num_shards=1)), seq_len=32)
    large = PreparedWindows(TokenCorpus(write_corpus(tmp_path / "b", documents(300, salt="b"))), seq_len=32)
    blend = Blend([large, small], [0.7, 0.3], seed=1)
    drawn = blend.samples(np.arange(4000))
    from_small = drawn[drawn >= len(large)] - len(large)
    assert abs(from_small.size / 4000 - 0.3) < 1e-3
    epochs = [from_small[e * len(small) : (e + 1) * len(small)] for e in range(3)]
    assert all(sorted(epoch.tolist()) == list(range(len(small))) for epoch in epochs)
    assert not np.array_equal(epochs[0], epochs[1])


def test_held_out_rows_are_each_sources_tail_and_never_trained_on(tmp_path):
    first = PreparedWindows(TokenCorpus(write_corpus(tmp_path / "a", documents(60))), seq_len=24)
    second = PreparedWindows(TokenCorpus(write_corpus(tmp_path / "b", documents(200, salt="b"))), seq_len=24)
    blend = Blend([first, second], [1, 3], seed=0, held_out=12)
    assert blend.held_out == [3, 9]
    assert [len(first) - 3, len(second) - 9] == blend.num_train
    evaluated = {tuple(blend.eval[i]["input_ids"].tolist()) for i in range(len(blend.eval))}
    assert evaluated == {tuple(first[i]["input_ids"].tolist()) for i in range(len(first) - 3, len(first))} | {
        tuple(second[i]["input_ids"].tolist()) for i in range(len(second) - 9, len(second))
    }
    drawn = blend.samples(np.arange(3 * sum(blend.num_train)))  # three epochs' worth: every training row
    assert set(drawn.tolist()) == set(range(len(blend.train)))
    trained = {tuple(blend.train[i]["input_ids"].tolist()) for i in set(drawn.tolist())}
    assert not trained & evaluated


def test_the_loaders_state_resumes_at_the_next_sample_at_any_data_parallel_size(tmp_path):
    corpus = TokenCorpus(write_corpus(tmp_path / "a", documents(100)))
    blend = Blend([PreparedWindows(corpus, seq_len=16)], [1.0], seed=7, held_out=4)
    reference = GlobalPositionSampler(blend, batch_size=8)
    order = np.concatenate([reference.global_batch(8 * step) for step in range(12)]).tolist()

    samplers = [GlobalPositionSampler(blend, num_replicas=2, rank=r, batch_size=4) for r in range(2)]
    ranks = [iter(sampler) for sampler in samplers]
    consumed = [index for _ in range(5) for rank in ranks for index in next(rank)]
    state = json.loads(json.dumps(samplers[0].state_dict()))
    assert state["samples_consumed"] == 40 and state == samplers[1].state_dict()
    for dp in (1, 4):
        resumed = [GlobalPositionSampler(blend, num_replicas=dp, rank=r, batch_size=8 // dp) for r in range(dp)]
        for sampler in resumed:
            sampler.load_state_dict(state)
        iterators = [iter(sampler) for sampler in resumed]
        later = [index for _ in range(7) for rank in iterators for index in next(rank)]
        assert consumed + later == order, dp

    other = GlobalPositionSampler(Blend([PreparedWindows(corpus, seq_len=16)], [1.0], seed=8, held_out=4), batch_size=8)
    with pytest.raises(ValueError, match="seed differs"):
        other.load_state_dict(state)
    shorter = Blend([PreparedWindows(corpus, seq_len=12)], [1.0], seed=7, held_out=4)
    with pytest.raises(ValueError, match="data.seq_len of source 0 differs"):
        GlobalPositionSampler(shorter, batch_size=8).load_state_dict(state)
    raw = ResumableDistributedSampler(50, batch_size=8)
    with pytest.raises(ValueError, match="read prepared corpora"):
        raw.load_state_dict(state)
    with pytest.raises(ValueError, match="read raw files"):
        reference.load_state_dict(raw.state_dict())


# --- the run config -----------------------------------------------------------------------------------------------


def test_the_run_config_reads_prepared_corpora_and_refuses_what_does_not_fit(tmp_path):
    from colo.apps.train import ConfigError, load_config
    from colo.apps.train.data_setup import build_data
    from colo.apps.train.language_model import LanguageModelTask
    from colo.apps.train.preflight import check_before_start

    first = write_corpus(tmp_path / "a", documents(80))
    second = write_corpus(tmp_path / "b", documents(160, salt="b"))
    raw = tmp_path / "raw.txt"
    raw.write_text("some text\n" * 50)
    blend = f"data.blend=[{{path: {first}, weight: 1}}, {{path: {second}, weight: 3}}]"
    settings = ["data.seq_len=32", "data.global_batch_size=4", "eval.every_steps=5", "eval.num_sequences=8"]
    config = load_config(overrides=[blend, *settings])
    check_before_start(config)
    run = build_data(config, TOKENIZER, num_replicas=1, rank=0)
    assert isinstance(run.sampler, GlobalPositionSampler) and len(run.eval) == 8
    assert f"{first} (weight 1: " in run.description and f"{second} (weight 3: " in run.description
    assert "8 rows held out for eval (2 + 6" in run.description
    documents_config = load_config(overrides=[f"data.paths=[{first}]", "data.packing=documents", *settings])
    one = build_data(documents_config, TOKENIZER, num_replicas=1, rank=0)
    batch, num_tokens = next(one.train_batches())
    assert "position_ids" in batch and num_tokens == int((batch["input_ids"] != TOKENIZER.pad_id).sum())

    refused = {
        f"data.paths=[{first}, {raw}]": "data.paths mixes prepared corpora",
        f"data.paths=[{first}, {second}]": "list them in data.blend with their weights",
        f"data.blend=[{{path: {raw}, weight: 1}}]": "is not a prepared corpus (no manifest.json)",
        f"data.blend=[{{path: {first}, weight: 0}}]": "data.blend.0.weight: Input should be greater than 0",
        f"data.blend=[{{path: {first}, weight: 1}}, {{path: {second}, weight: 1e-5}}]": "gets no sample in 10000",
    }
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(overrides=[override])
    with pytest.raises(ConfigError, match="data.blend and data.paths are both set"):
        load_config(overrides=[blend, f"data.paths=[{raw}]"])
    with pytest.raises(ConfigError, match=r"read with data.task in \['pretrain'\]"):
        load_config(overrides=[f"data.paths=[{first}]", "data.task=sft"])

    # a corpus made with another tokenizer: refused before training, naming the field and the fix
    other = write_corpus(tmp_path / "c", documents(20), identity={**tokenizer_identity(TOKENIZER), "sha256": "0" * 64})
    mismatched = load_config(overrides=[f"data.blend=[{{path: {first}, weight: 1}}, {{path: {other}, weight: 1}}]"])
    with pytest.raises(ConfigError, match=r"data.blend\[1\].path=.*set data.tokenizer to the corpus's tokenizer"):
        check_before_start(mismatched)
    with pytest.raises(ValueError, match=r"data.blend\[1\].path="):
        LanguageModelTask(mismatched)


# --- the trainer: stopped at dp=2, resumed at dp=1 and dp=4 -------------------------------------------------------

STOP, TOTAL = 3, 5


def _train_recording(config: dict) -> dict:
    """Train on this rank, recording the input_ids of every batch the loop takes (a wrapper of
    `RunData.train_batches`, restored after)."""
    from colo.apps.train import train, validate_config
    from colo.apps.train.data_setup import RunData

    seen = []
    original = RunData.train_batches

    def recording(self):
        for batch, num_tokens in original(self):
            seen.append(batch["input_ids"].tolist())
            yield batch, num_tokens

    RunData.train_batches = recording
    try:
        result = train(validate_config(config))
    finally:
        RunData.train_batches = original
    return {"batches": seen, "start_step": result.start_step, "last_step": result.last_step}


def trainer_config(blend: list[dict], output_dir: str, plugin: dict | None = None, **schedule) -> dict:
    return {
        "name": "prepared-resume",
        "output_dir": output_dir,
        "seed": 11,
        "model": {"preset": "tiny"},
        "plugin": plugin or {"name": "ddp", "precision": "fp32"},
        "schedule": {"total_steps": TOTAL, "warmup_steps": 1, **schedule},
        "data": {"blend": blend, "seq_len": 32, "global_batch_size": 8},
        "checkpoint": {"every_steps": STOP, "resume": "auto", "async_save": False},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "eval": {"every_steps": STOP, "num_sequences": 8, "batch_size": 2},
        "sample": {"max_new_tokens": 0},
    }


def global_batches(results: list[dict], *, tp: int = 1) -> list[list[list[int]]]:
    """Each step's global batch: the data-parallel ranks' batches in rank order (the ``tp`` ranks of one
    data-parallel rank, neighbours, read the same batch)."""
    for first in range(0, len(results), tp):
        assert all(results[first + n]["batches"] == results[first]["batches"] for n in range(tp))
    data_ranks = results[::tp]
    return [[row for rank in data_ranks for row in rank["batches"][step]] for step in range(len(results[0]["batches"]))]


def test_a_run_stopped_at_dp2_resumes_at_dp1_and_dp4_at_the_exact_next_sample(tmp_path):
    from colo.apps.train import validate_config
    from colo.apps.train.data_setup import build_data

    blend = [
        {"path": write_corpus(tmp_path / "a", documents(200)), "weight": 3},
        {"path": write_corpus(tmp_path / "b", documents(120, salt="b"), num_shards=2), "weight": 1},
    ]
    first = str(tmp_path / "dp2")
    stopped = run_distributed(_train_recording, trainer_config(blend, first, stop_at_step=STOP), world_size=2)
    # dp=1 as tp=2 x dp=1 on the warm pair of ranks (a world of one would start a process for it alone)
    layouts = {1: (2, {"name": "hybrid", "tp": 2, "precision": "fp32"}), 4: (1, None)}  # dp: (tp, plugin)
    resumed = {}
    for dp, (tp, plugin) in layouts.items():
        shutil.copytree(first, tmp_path / f"dp{dp}")
        config = trainer_config(blend, str(tmp_path / f"dp{dp}"), plugin)
        resumed[dp] = run_distributed(_train_recording, config, world_size=dp * tp)

    # the reference order, computed here from the same config; each row's content names its sample
    reference = build_data(validate_config(trainer_config(blend, first)), TOKENIZER, num_replicas=1, rank=0)
    sample_of = {tuple(reference.train[i]["input_ids"].tolist()): i for i in range(len(reference.train))}
    assert len(sample_of) == len(reference.train)  # every training row distinct: content identifies the sample
    expected = [reference.sampler.global_batch(8 * step).tolist() for step in range(TOTAL)]

    def sample_ids(batches) -> list[list[int]]:
        return [[sample_of[tuple(row)] for row in batch] for batch in batches]

    assert [rank["last_step"] for rank in stopped] == [STOP, STOP]
    before = sample_ids(global_batches(stopped))
    assert before == expected[:STOP]
    for dp, results in resumed.items():
        assert {rank["start_step"] for rank in results} == {STOP}, dp
        after = sample_ids(global_batches(results, tp=layouts[dp][0]))
        assert after == expected[STOP:], dp  # neither repeated nor skipped, in the same order
        consumed = [sample for batch in before + after for sample in batch]
        assert len(consumed) == len(set(consumed)) == 8 * TOTAL, dp  # each sample exactly once

    held_out = {tuple(reference.eval[i]["input_ids"].tolist()) for i in range(len(reference.eval))}
    trained = {tuple(row) for rank in stopped + resumed[4] for batch in rank["batches"] for row in batch}
    assert len(held_out) == 8 and not trained & held_out
