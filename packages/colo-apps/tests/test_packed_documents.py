"""A row packed with several documents trains exactly as if each document were its own row.

`TokenBudgetDataset` and packed SFT rows carry ``position_ids`` restarting at every document and ``-100`` labels on
each document's first token; colo's `Llama` derives document ids from the positions (a document starts wherever
they do not go up by one) and attends within each document only, and transformers 5's ``LlamaForCausalLM`` does
the same from ``position_ids``. So the loss of a packed batch is the token-weighted mean of its documents' losses
run one by one, and so are its gradients; under tensor parallelism, Megatron-SP, Ulysses and ring attention
(whose ranks get the whole sequence's document ids, `LlamaPlan.prepare_batch`) the losses of 2 AdamW steps equal
the single process's.

Tolerances (fp32): losses and gradients rtol 1e-5, atol 1e-6: the packed row and the separate documents compute
the same sums, but masked keys add exact zeros to longer reductions and matmuls are blocked differently; the
parallel runs differ as in test_booster_hybrid.py (partial sums over ranks, merged softmax blocks).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

LR = 1e-2
ROWS = [(5, 11, 16), (20, 7)]  # documents of each row of 32 slots; row 1 ends with 5 padding slots
SEQ = 32


def packed_batch(seed: int = 0, vocab: int = 128):
    """Two packed rows as `TokenBudgetDataset` makes them, and every document alone."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(ROWS), SEQ, dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    position_ids = torch.zeros_like(input_ids)
    documents = []
    for row, lengths in enumerate(ROWS):
        cursor = 0
        for length in lengths:
            tokens = torch.randint(0, vocab, (length,), generator=generator)
            input_ids[row, cursor : cursor + length] = tokens
            labels[row, cursor + 1 : cursor + length] = tokens[1:]
            position_ids[row, cursor : cursor + length] = torch.arange(length)
            documents.append(tokens)
            cursor += length
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}, documents


def make_llama(seed: int = 0):
    from colo.apps import Llama, get_preset

    torch.manual_seed(seed)
    model = Llama(get_preset("tiny"))
    model.init_weights(seed)
    return model


def make_hf_llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def _loss_and_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params)


def _packed_equals_documents_one_by_one(model, **extra):
    batch, documents = packed_batch()
    batch.update(extra)
    packed_loss, packed_grads = _loss_and_grads(model, model(**batch).loss)
    targets = [len(tokens) - 1 for tokens in documents]
    total = sum(model(input_ids=t[None], labels=t[None]).loss * n for t, n in zip(documents, targets))
    expected_loss, expected_grads = _loss_and_grads(model, total / sum(targets))
    torch.testing.assert_close(packed_loss, expected_loss, rtol=1e-5, atol=1e-6)
    for actual, expected in zip(packed_grads, expected_grads):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    return packed_loss


def test_llama_loss_and_gradients_on_packed_rows_equal_each_document_alone():
    model = make_llama()
    packed_loss = _packed_equals_documents_one_by_one(model)
    # the mask is what makes it so: attending across documents gives another loss
    model.document_ids_from_positions = False
    batch, _ = packed_batch()
    assert not torch.allclose(model(**batch).loss, packed_loss, rtol=1e-3)


def test_hf_llama_loss_and_gradients_on_packed_rows_equal_each_document_alone():
    # transformers 5 masks packed documents from position_ids only when it builds no KV cache (HFLlamaPlan's
    # prepare_batch passes use_cache=False for such batches; the default model config has use_cache=True)
    _packed_equals_documents_one_by_one(make_hf_llama(), use_cache=False)


def _reference_losses(make, steps=2, **extra):
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = model(**packed_batch(step)[0], **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _parallel_packed_losses(cases):
    from colo.apps import Booster, HybridParallel

    results = {}
    for name, kind, settings in cases:
        model = make_llama() if kind == "llama" else make_hf_llama()
        booster = Booster(HybridParallel(**settings))
        booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
        results[name] = [booster.train_step(packed_batch(step)[0]).loss for step in range(2)]
    return results


def test_packed_rows_under_tp_megatron_sp_ulysses_and_ring_equal_the_single_process():
    cases = [
        ("tp2", "llama", {"tp": 2}),
        ("tp2-megatron-sp", "llama", {"tp": 2, "sp_mode": "megatron"}),
        ("sp2-ulysses", "llama", {"sp": 2, "sp_mode": "ulysses"}),
        ("sp2-ring", "llama", {"sp": 2, "sp_mode": "ring"}),
        ("hf-tp2", "hf", {"tp": 2}),
    ]
    expected = {"llama": _reference_losses(make_llama), "hf": _reference_losses(make_hf_llama, use_cache=False)}
    for results in run_distributed(_parallel_packed_losses, cases, world_size=2):
        for name, kind, _ in cases:
            assert results[name] == pytest.approx(expected[kind], rel=1e-5), name


def test_llama_checks_document_ids_and_computes_block_ranges_once_per_forward_not_per_layer(monkeypatch):
    # a 3-layer Llama on packed rows builds one DocumentMask per forward: the ids are read on the host once (not in
    # each layer), each kind of Triton block range is computed once, and loss and gradients are bit-equal to handing
    # every layer the raw ids (the same kernels over the same ranges)
    from colo.apps import Llama, get_preset
    from colo.apps.models.llama import model as llama_model
    from colo.kernels import document_mask as documents
    from colo.kernels import use_backend

    calls = []
    for name in ("_query_block_ranges", "_key_block_ranges"):
        compute = getattr(documents, name)
        monkeypatch.setattr(documents, name, lambda *args, _c=compute, _n=name: calls.append(_n) or _c(*args))
    check = documents.check_document_ids

    def counting_check(*args, check_values=True, **kwargs):
        calls.extend(["checked values"] if check_values else [])  # the host sync
        return check(*args, check_values=check_values, **kwargs)

    monkeypatch.setattr(documents, "check_document_ids", counting_check)
    model = Llama(get_preset("tiny", num_hidden_layers=3))
    model.init_weights(0)
    batch, _ = packed_batch()

    def loss_and_grads():
        calls.clear()
        with use_backend("triton"):
            return _loss_and_grads(model, model(**batch).loss)

    shared_loss, shared_grads = loss_and_grads()
    assert calls.count("checked values") == 1
    assert sorted(set(calls)) == ["_key_block_ranges", "_query_block_ranges", "checked values"]
    assert len(calls) <= 4  # query ranges of the forward (and of the backward, if its blocks differ), key ranges
    with monkeypatch.context() as per_layer:
        per_layer.setattr(llama_model, "layers_document_mask", lambda document_ids, whole_sequence: document_ids)
        loss, grads = loss_and_grads()
    assert calls.count("checked values") == 3 and calls.count("_key_block_ranges") == 3  # before: every layer
    torch.testing.assert_close(shared_loss, loss, rtol=0, atol=0)
    for shared, expected in zip(shared_grads, grads):
        torch.testing.assert_close(shared, expected, rtol=0, atol=0)
