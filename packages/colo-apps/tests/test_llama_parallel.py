"""`parallelize_llama` with tp=2 matches the single-process `Llama`, and pipeline stages run under the executor.

- Training: the "tiny" Llama parallelized eagerly with tp=2 (vocab-parallel embedding, fused QKV by heads,
  row-parallel o/down, column-parallel gate/up, column-parallel lm_head) trains 3 AdamW steps next to the
  unsharded model built from the same seed on the same data: the loss every step, every gradient (each rank's
  against its slice of the reference gradient) and every parameter after each step agree. Variants: the
  vocabulary-parallel loss with untied embeddings, and gathered logits with tied embeddings (which parallelize
  unties for the plan and ties again to one shard).
- Meta device: `Llama` built under ``torch.device("meta")`` and parallelized with ``materialize="cpu"`` gives every
  rank exactly (``torch.equal``) its slice of ``Llama.init_weights(seed)``'s full model, with the kv heads
  sharded (2 kv heads) or replicated (1 kv head), whatever each rank's global generator holds.
- Pipeline: two `LlamaStage` s, each materialized on its own rank from the meta device, run one 1F1B step under
  `colo.pipeline.PipelineExecutor` (tied embeddings across the two stages) and give the single-process loss and
  gradients; and each stage of a tied model, parallelized alone with tp=2 from the meta device, holds its slices of
  the full model (the last stage's ``lm_head`` the embedding's rows) and the two compose to the model's logits.

Tolerances: fp32, rtol=1e-5, atol=1e-6 on losses and gradients (as colo-tensor's test_block.py). Not
bit-identical: the row-parallel projections and the vocabulary-parallel embedding sum partial results over the
ranks, column-parallel input gradients are summed over ranks, and the vocabulary-parallel cross-entropy reduces its
logsumexp in two parts, so fp32 additions run in another order. Parameters after AdamW steps: rtol=1e-5, atol=1e-4
(PARAM_TOLERANCE). AdamW's step moves a weight by about lr * g / (|g| + eps) whatever the size of g, so for the few
gradient entries whose summands nearly cancel (|g| ~ 1e-9), a rounding difference of ~1e-11 changes the step by up
to ~lr * 1e-2; observed: at most 4e-5 on a handful of the 109k weights. Any sharding mistake changes gradients by
O(1) relative and so moves weights by O(lr) = 1e-2, a hundred times the tolerance, besides failing the gradient
check. The pipeline averages two microbatch means (equal token counts) instead of one mean.
"""

from __future__ import annotations

import pytest
import torch

from colo.apps.models.llama import (
    Llama,
    causal_lm_loss,
    check_tp_size,
    get_preset,
    llama_pipeline_stages,
    parallelize_llama,
)
from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.pipeline import PipelineExecutor, one_f_one_b
from colo.tensor import layout_of

SEED, STEPS, LR = 1234, 3, 1e-2
BATCH, SEQ = 4, 16
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}  # AdamW amplifies rounding in near-zero gradients: see the docstring


def _batches(vocab_size: int, *, ignore: bool = True):
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab_size, (BATCH, SEQ), generator=generator)
        labels = ids.clone()
        if ignore:
            labels[0, :5] = -100  # a prompt without loss
        batches.append((ids, labels))
    return batches


def _full_of(reference: Llama, name: str, *, grad: bool = False) -> torch.Tensor:
    """The unsharded value (or gradient) the parallel parameter ``name`` is a piece of.

    ``*.qkv_proj.{q,k,v}_weight`` are the q, k or v rows of the reference's fused ``*.qkv_proj.weight``.
    """
    module_name, _, attr = name.rpartition(".")
    part = None
    if attr in ("q_weight", "k_weight", "v_weight"):
        part, attr = attr[0], "weight"
    param = reference.get_parameter(f"{module_name}.{attr}")
    full = param.grad if grad else param.detach()
    if part is None:
        return full
    config = reference.config
    heads = (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads)
    rows = [n * config.head_dim for n in heads]
    return full.split(rows)["qkv".index(part)]


def _train_tp(loss_parallel: bool, tied: bool):
    mesh = Mesh(tp=2)
    config = get_preset("tiny", tie_word_embeddings=tied)
    reference, model = Llama(config), Llama(config)
    reference.init_weights(SEED)
    model.init_weights(SEED)
    parallelize_llama(model, mesh=mesh, loss_parallel=loss_parallel)
    mismatches = []

    def compare(what, got, expected):
        try:
            torch.testing.assert_close(got, expected, **(PARAM_TOLERANCE if what.startswith("param") else TOLERANCE))
        except AssertionError as error:
            mismatches.append(f"{what}: {error}")

    with torch.no_grad():  # logits (all-gathered over the vocabulary) and the loss returned with them
        ids, labels = _batches(config.vocab_size)[0]
        got, expected = model(ids, labels=labels, return_logits=True), reference(ids, labels=labels, return_logits=True)
        compare("logits", got.logits, expected.logits)
        compare("loss with logits", got.loss, expected.loss)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in (reference, model)]
    for step, (ids, labels) in enumerate(_batches(config.vocab_size)):
        losses = []
        for module in (reference, model):
            loss = module(ids, labels=labels).loss
            loss.backward()
            losses.append(loss.detach())
        compare(f"loss step {step}", losses[1], losses[0])
        for name, param in model.named_parameters():
            expected = layout_of(param).local_slice(_full_of(reference, name, grad=True))
            compare(f"grad {name} step {step}", param.grad, expected)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for name, param in model.named_parameters():
            expected = layout_of(param).local_slice(_full_of(reference, name))
            compare(f"param {name} step {step}", param.detach(), expected)
    attention = model.layers["0"].self_attn
    return {
        "mismatches": mismatches,
        "layers": sorted({type(m).__name__ for m in model.modules()}),
        "local_heads": (attention.num_heads, attention.num_kv_heads),
        "tied": model.lm_head.weight is model.embed_tokens.weight,
        "objective": type(model.objective).__name__,
    }


@pytest.mark.parametrize(
    ("loss_parallel", "tied"), [(True, False), (False, True)], ids=["loss-parallel-untied", "gathered-logits-tied"]
)
def test_tp2_matches_single_process_over_three_adamw_steps(loss_parallel, tied):
    for result in run_distributed(_train_tp, loss_parallel, tied, world_size=2):
        assert result["mismatches"] == [], "\n".join(result["mismatches"][:5])
        assert {"VocabParallelEmbedding", "QKVParallelLinear", "ColumnParallelLinear", "RowParallelLinear"} <= set(
            result["layers"]
        )
        assert result["local_heads"] == (2, 1)  # 4 query heads and 2 kv heads over 2 ranks
        assert result["tied"] == tied
        expected = "VocabParallelCausalLMObjective" if loss_parallel else "CausalLMObjective"
        assert result["objective"] == expected


def _meta_shards(num_kv_heads: int, tied: bool):
    mesh = Mesh(tp=2)
    config = get_preset("tiny", num_key_value_heads=num_kv_heads, tie_word_embeddings=tied)
    full = Llama(config)
    full.init_weights(SEED)
    torch.manual_seed(100 + mesh.rank("tp"))  # ranks' global generators differ: materialization must not use them
    with torch.device("meta"):
        model = Llama(config)
    with pytest.raises(ValueError, match=r"has axes \('tp',\) and no 'sp'"):
        parallelize_llama(model, mesh=mesh, tp_axis="sp")
    parallelize_llama(model, mesh=mesh, materialize="cpu", seed=SEED)
    different = []
    for name, param in model.named_parameters():
        if param.is_meta or not torch.equal(param.detach(), layout_of(param).local_slice(_full_of(full, name))):
            different.append(name)
    for name, buffer in model.named_buffers():
        if not torch.equal(buffer, full.get_buffer(name)):
            different.append(name)
    ids, labels = _batches(config.vocab_size)[0]
    with torch.no_grad():
        loss, expected = model(ids, labels=labels).loss, full(ids, labels=labels).loss
    return {
        "different": different,
        "loss": (loss, expected),
        "up_proj": tuple(model.layers["1"].mlp.up_proj.weight.shape),
        "k_rows": tuple(model.layers["1"].self_attn.qkv_proj.k_weight.shape),
        "tied": model.lm_head.weight is model.embed_tokens.weight,
    }


@pytest.mark.parametrize(
    ("num_kv_heads", "tied"), [(2, False), (1, True)], ids=["kv-sharded-untied", "kv-replicated-tied"]
)
def test_meta_construction_gives_each_rank_exactly_its_shard(num_kv_heads, tied):
    for result in run_distributed(_meta_shards, num_kv_heads, tied, world_size=2):
        assert result["different"] == []
        torch.testing.assert_close(*result["loss"], **TOLERANCE)
        assert result["up_proj"] == (176 // 2, 64)
        # k rows: this rank's kv head when kv heads are sharded, all (replicated) kv heads when there is only one
        assert result["k_rows"] == (16, 64)
        assert result["tied"] == tied


def _parallel_stages():
    """Both stages of a tied model, each cut on the meta device and parallelized alone, on every rank."""
    mesh = Mesh(tp=2)
    config = get_preset("tiny", num_hidden_layers=3, tie_word_embeddings=True)
    full = Llama(config)
    full.init_weights(SEED)
    stages = []
    for index in range(2):
        with torch.device("meta"):
            model = Llama(config)
        stage = llama_pipeline_stages(model, 2)[index]
        stages.append(parallelize_llama(stage, mesh=mesh, materialize="cpu", seed=SEED))
    different = [
        f"stage {index}: {name}"
        for index, stage in enumerate(stages)
        for name, param in stage.named_parameters()
        if not torch.equal(param.detach(), layout_of(param).local_slice(_full_of(full, name)))
    ]
    ids, _ = _batches(config.vocab_size)[0]
    with torch.no_grad():
        logits, expected = stages[1](stages[0](ids)), full(ids).logits
    return {"different": different, "logits": (logits, expected)}


def test_pipeline_stages_parallelize_like_the_model():
    for result in run_distributed(_parallel_stages, world_size=2):
        assert result["different"] == []
        torch.testing.assert_close(*result["logits"], **TOLERANCE)


def test_tp_size_errors_name_the_config_field():
    with pytest.raises(ValueError, match=r"tp=3 cannot shard num_attention_heads=4 .* choose tp in \[1, 2, 4\]"):
        check_tp_size(get_preset("tiny"), 3)
    with pytest.raises(ValueError, match=r"tp=4 does not divide intermediate_size=174; choose tp in \[1, 2\]"):
        check_tp_size(get_preset("tiny", intermediate_size=174), 4)
    with pytest.raises(ValueError, match=r"vocab_size=130; choose tp in \[1, 2\] or make vocab_size a multiple of 4"):
        check_tp_size(get_preset("tiny", vocab_size=130), 4)
    with pytest.raises(TypeError, match="must be a Llama or LlamaStage"):
        parallelize_llama(torch.nn.Linear(2, 2), mesh=None)


def _pipeline_step(tied: bool):
    mesh = Mesh(pp=2)
    config = get_preset("tiny", num_hidden_layers=3, tie_word_embeddings=tied)
    reference = Llama(config)
    reference.init_weights(SEED)
    with torch.device("meta"):
        model = Llama(config)
    stage = llama_pipeline_stages(model, 2)[mesh.rank("pp")]
    stage.to_empty(device="cpu")
    stage.init_weights(SEED)
    executor = PipelineExecutor(
        stage,
        schedule=one_f_one_b(num_ranks=2, num_microbatches=2),
        mesh=mesh,
        loss_fn=causal_lm_loss,
        tied_parameters=stage.tied_parameters(),
    )
    ids, labels = _batches(config.vocab_size, ignore=False)[0]  # equal token counts per microbatch
    result = executor.step(ids, labels)
    loss = reference(ids, labels=labels).loss
    loss.backward()
    mismatches = []
    for name, param in stage.named_parameters():
        try:
            torch.testing.assert_close(param.grad, reference.get_parameter(name).grad, **TOLERANCE)
        except AssertionError as error:
            mismatches.append(f"{name}: {error}")
    return {"loss": (result.loss, loss.detach()), "mismatches": mismatches, "layers": list(stage.layers)}


def test_pipeline_stages_under_the_executor_match_single_process():
    results = run_distributed(_pipeline_step, True, world_size=2)
    assert [r["layers"] for r in results] == [["0", "1"], ["2"]]
    for result in results:
        torch.testing.assert_close(*result["loss"], **TOLERANCE)
        assert result["mismatches"] == [], "\n".join(result["mismatches"][:5])
