"""Inputs that one layout rejects are rejected in every layout, and ranks that must agree are checked to agree.

- Under tp=2 every rank of the group must see the same tokens: the parallelized Llama (its vocabulary-parallel
  embedding and cross-entropy) and `Booster.train_step` check it on the first step (every step under
  ``COLO_DEBUG_CHECKS=1``) and raise a `ValueError` on every rank naming the group and the fix, where the ranks
  would otherwise train on different data and report a loss no single process computes.
- Token ids >= the vocabulary or negative raise `IndexError` under tp=2 as they do in one process (the
  vocabulary-parallel embedding would give them zero rows), and so do labels out of range; ``-100`` labels stay
  allowed, and after the checks the tp=2 loss equals one process's (rtol 1e-5: the vocabulary-parallel loss sums
  in another order).
- The trainer's batches are checked against the model's vocabulary; a data file that is not text is refused by
  name, and an empty one, in one line from ``colo train`` (exit 2) instead of a traceback or a run on U+FFFD.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from colo.comm.testing import run_distributed

VOCAB, BATCH, SEQ = 128, 2, 16


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _error(call) -> tuple[str, str] | None:
    try:
        call()
    except (ValueError, IndexError) as error:
        return type(error).__name__, str(error)
    return None


def _tp2_inputs():
    from colo.apps.models.llama import Llama, get_preset, parallelize_llama
    from colo.comm import Mesh
    from colo.comm.debug import debug_checks_enabled

    rank = torch.distributed.get_rank()
    with torch.device("meta"):
        model = Llama(get_preset("tiny"))
    parallelize_llama(model, mesh=Mesh(tp=2), materialize="cpu", seed=0)
    ids = _ids(0)
    too_large, negative, bad_labels, ignored = ids.clone(), ids.clone(), ids.clone(), ids.clone()
    too_large[1, 3], negative[0, 5], bad_labels[1, 7], ignored[0, :4] = VOCAB, -1, VOCAB + 5, -100
    errors = {
        "rank-local ids": _error(lambda: model(_ids(100 + rank), labels=_ids(100 + rank))),  # unseeded per rank
        "id >= vocab": _error(lambda: model(too_large, labels=ids)),
        "negative id": _error(lambda: model(negative, labels=ids)),
        "label >= vocab": _error(lambda: model(ids, labels=bad_labels)),
    }
    loss = model(ids, labels=ignored).loss.item()  # -100 allowed
    errors["later step, rank-local ids"] = _error(lambda: model(_ids(200 + rank), labels=ids))  # not checked again
    with debug_checks_enabled():
        errors["debug, rank-local ids"] = _error(lambda: model(_ids(300 + rank), labels=ids))
    return errors, loss


def test_tp2_rejects_what_one_process_rejects_and_ranks_that_disagree():
    from colo.apps.models.llama import Llama, get_preset

    reference = Llama(get_preset("tiny"))
    reference.init_weights(0)
    ids = _ids(0)
    too_large, ignored = ids.clone(), ids.clone()
    too_large[1, 3], ignored[0, :4] = VOCAB, -100
    with pytest.raises(IndexError):  # one process: nn.Embedding's "index out of range in self"
        reference(too_large, labels=ids)
    expected = reference(ids, labels=ignored).loss.item()

    for errors, loss in run_distributed(_tp2_inputs, world_size=2):
        kind, message = errors["rank-local ids"]
        assert kind == "ValueError" and "VocabParallelEmbedding: ids differ between the ranks of group 'tp'" in message
        assert "rank 0 holds one value, rank 1 holds another" in message and "same seed" in message
        kind, message = errors["id >= vocab"]
        assert kind == "IndexError" and f"token id {VOCAB} is out of range for a vocabulary of {VOCAB}" in message
        assert errors["negative id"][0] == "IndexError" and "token id -1 is out of range" in errors["negative id"][1]
        kind, message = errors["label >= vocab"]
        assert kind == "IndexError" and f"target: token id {VOCAB + 5} is out of range" in message
        assert "or ignore_index=-100" in message
        assert loss == pytest.approx(expected, rel=1e-5)
        assert errors["later step, rank-local ids"] is None  # the first step pays for the check, later ones do not
        assert errors["debug, rank-local ids"][0] == "ValueError"


def _booster_batches(same: bool):
    from colo.apps import Booster, HybridParallel, Llama, get_preset

    model = Llama(get_preset("tiny"))
    model.init_weights(0)
    booster = Booster(HybridParallel(tp=2, zero_stage=0))
    booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.0))
    ids = _ids(0) if same else _ids(100 + torch.distributed.get_rank())  # as a loader drawing on each rank would
    error = _error(lambda: booster.train_step({"input_ids": ids, "labels": ids}))
    return error if error is not None else booster.train_step({"input_ids": ids, "labels": ids}).loss


def test_booster_refuses_different_batches_on_the_ranks_of_a_tp_group():
    for kind, message in run_distributed(_booster_batches, False, world_size=2):
        assert kind == "ValueError" and "the ranks of the tp group 'tp' (ranks [0, 1])" in message
        assert "'input_ids': rank 0 holds one value, rank 1 holds another" in message
        assert "same seed on each rank" in message and "broadcast" in message
    losses = run_distributed(_booster_batches, True, world_size=2)
    assert losses[0] == losses[1]


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index].clone()}


def test_the_trainers_batches_are_checked_against_the_models_vocabulary():
    from colo.apps.data import ResumableDistributedSampler
    from colo.apps.train.data_setup import RunData

    rows = [torch.arange(8) for _ in range(4)]
    rows[2][5] = 300  # a tokenizer with more ids than the model's vocabulary
    sampler = ResumableDistributedSampler(4, num_replicas=1, rank=0, batch_size=4, shuffle=False)
    data = RunData(tokenizer=None, train=_Rows(rows), eval=None, sampler=sampler, batch_size=4, vocab_size=259)
    expected = r"input_ids hold token id 300, out of range for the model's vocabulary of 259"
    with pytest.raises(IndexError, match=expected):
        next(data.train_batches())


def test_a_data_file_that_is_not_text_is_refused_by_name(tmp_path):
    from colo.apps.data import read_documents

    binary = tmp_path / "random.bin"
    binary.write_bytes(np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Le café était très chaud à l'aube.\n".encode("latin-1") * 50)  # a few bytes not UTF-8
    with pytest.raises(ValueError, match=r"random\.bin is not a text file: it holds NUL bytes"):
        list(read_documents(binary))
    assert len(list(read_documents(latin1))) == 1  # mostly text: read, undecodable bytes as U+FFFD


def _train_cli(tmp_path, data_file) -> tuple[int, str]:
    from colo.apps.cli import app

    settings = [
        f"output_dir={tmp_path / 'run'}",
        f"data.paths=[{data_file}]",
        "model.preset=tiny",
        "data.seq_len=32",
        "data.global_batch_size=2",
        "schedule.total_steps=1",
        "schedule.warmup_steps=0",
        "eval.every_steps=null",
        "checkpoint.enabled=false",
        "sample.max_new_tokens=0",
    ]
    result = CliRunner().invoke(app, ["train", "--preset", "tiny-llama", *(f"--set={s}" for s in settings)])
    return result.exit_code, result.output


def test_colo_train_reports_a_binary_or_empty_data_file_in_one_line(tmp_path):
    binary = tmp_path / "random.bin"
    binary.write_bytes(np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    code, output = _train_cli(tmp_path, binary)
    assert code == 2 and output.count("\n") == 1, output
    assert output.startswith(f"colo: invalid run config: data.paths: {binary} is not a text file"), output
    code, output = _train_cli(tmp_path, empty)
    assert code == 2 and output.count("\n") == 1, output
    assert output.startswith(f"colo: invalid run config: data.paths: {empty}: empty, no data to train on"), output
