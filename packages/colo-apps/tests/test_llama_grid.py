"""The tiny `Llama` under 2D (4 ranks, `parallelize_llama_2d`), and 3D (`parallelize_llama_3d`), 2.5D with d=2 and
2D x dp2 (8 ranks, one spawn) trains 3 AdamW steps next to the unsharded model built from the same seed on the same
data: the loss every step, every gradient (each rank's block against the matching block of the reference gradient)
and every parameter after each step agree. Bad grid sizes are refused naming the config field.

Tolerances: fp32, rtol=1e-5 and atol=1e-6 on losses and on the first step's gradients. Parameters after AdamW:
rtol=1e-5, atol=2e-4. AdamW moves a weight by about lr * g / (|g| + eps) whatever the size of g, so where the
summands of a gradient entry nearly cancel (|g| ~ 1e-8) a rounding difference changes the step by up to ~lr * 1e-2;
observed under 2D: one of the 1,024 entries of a q projection off by 1.1e-4 after step 0 (every gradient entry
passes atol=1e-6). Later steps' gradients are taken at parameters already that far apart, so atol=5e-6 there
(observed: one of 2,816 entries of an up projection off by 1.2e-6 at step 1 on 8 ranks). A sharding mistake changes
gradients by O(1) relative and moves weights by O(lr) = 1e-2, fifty times the tolerance. Not bit-identical: SUMMA
sums each matmul over q blocks of the reduction dimension, the norms all-reduce partial statistics, weight gradients
are reduce-scattered / all-reduced over the grid, and the vocabulary-parallel cross-entropy reduces its logsumexp in
parts.
"""

from __future__ import annotations

import torch

from colo.apps.booster.grid_plan import parallelize_llama_2d, parallelize_llama_3d
from colo.apps.models.llama import Llama, get_preset
from colo.comm import all_reduce
from colo.comm.testing import run_distributed
from colo.tensor import layout_of
from colo.tensor.tp_grid import grid_mesh

SEED, STEPS, LR = 1234, 3, 1e-2
BATCH, SEQ = 4, 8
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
LATER_GRAD_TOLERANCE = {"rtol": 1e-5, "atol": 5e-6}  # gradients at parameters AdamW already moved apart by rounding
PARAM_TOLERANCE = {"rtol": 1e-5, "atol": 2e-4}  # AdamW amplifies rounding in near-zero gradients


def _batches(vocab_size: int):
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab_size, (BATCH, SEQ), generator=generator)
        batches.append((ids, ids.clone()))
    return batches


def _full_of(reference: Llama, name: str, *, grad: bool = False) -> torch.Tensor:
    """The unsharded value (or gradient) the parameter ``name`` is a block of (``q/k/v_weight``: rows of the
    fused ``qkv_proj.weight``)."""
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
    return full.split([n * config.head_dim for n in heads])["qkv".index(part)]


def train_grid(mode: str, tp: int, depth: int, dp: int):
    mesh = grid_mesh(mode, tp, depth=depth, **({"dp": dp} if dp > 1 else {}))
    config = get_preset("tiny")
    reference, model = Llama(config), Llama(config)
    reference.init_weights(SEED)
    model.init_weights(SEED)
    (parallelize_llama_3d if mode == "3d" else parallelize_llama_2d)(model, mesh=mesh)
    dp_rank = mesh.rank("dp") if dp > 1 else 0
    mismatches = []

    def compare(what, got, expected):
        try:
            tolerance = PARAM_TOLERANCE if what.startswith("param") else TOLERANCE
            if what.startswith("grad") and not what.endswith("step 0"):
                tolerance = LATER_GRAD_TOLERANCE
            torch.testing.assert_close(got, expected, **tolerance)
        except AssertionError as error:
            mismatches.append(f"{what}: {error}")

    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in (reference, model)]
    for step, (ids, labels) in enumerate(_batches(config.vocab_size)):
        expected = reference(ids, labels=labels).loss
        expected.backward()
        mine = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)  # this dp rank's rows (equal counts)
        loss = model(ids[mine], labels=labels[mine]).loss
        loss.backward()
        if dp > 1:  # data parallelism: the mean of equal-sized halves' means is the whole batch's mean
            loss = all_reduce(loss.detach().clone(), "avg", group=mesh.group("dp"))
            for param in model.parameters():
                all_reduce(param.grad, "avg", group=mesh.group("dp"))
        compare(f"loss step {step}", loss.detach(), expected.detach())
        for name, param in model.named_parameters():
            compare(
                f"grad {name} step {step}",
                param.grad,
                layout_of(param).local_slice(_full_of(reference, name, grad=True)),
            )
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for name, param in model.named_parameters():
            compare(
                f"param {name} step {step}", param.detach(), layout_of(param).local_slice(_full_of(reference, name))
            )
    attention = model.layers["0"].self_attn
    return {
        "mismatches": mismatches,
        "local_heads": (attention.num_heads, attention.num_kv_heads),
        "layers": sorted({type(m).__name__ for m in model.modules()}),
    }


def _check(results, q, layers=("Linear2D", "QKVLinear2D", "RMSNorm2D", "Embedding2D")):
    for result in results:
        assert not result["mismatches"], "\n".join(result["mismatches"][:5])
        assert result["local_heads"] == (4 // q, 2 // q)
        assert set(layers) <= set(result["layers"])
        assert "Linear" not in result["layers"]


def test_tiny_llama_2d_matches_single_process_on_4_ranks():
    _check(run_distributed(train_grid, "2d", 4, 1, 1, world_size=4), q=2)


def _eight_rank_cases():
    return {
        "3d": train_grid("3d", 8, 1, 1),
        "2.5d d=2": train_grid("2.5d", 8, 2, 1),
        "2d x dp2": train_grid("2d", 4, 1, 2),
    }


def test_tiny_llama_3d_2p5d_and_2d_x_dp2_match_single_process_on_8_ranks():
    results = run_distributed(_eight_rank_cases, world_size=8)
    cube = ("Linear3D", "QKVLinear3D", "LayerNorm3D", "Embedding3D", "AttentionCore3D")
    _check([result["3d"] for result in results], q=2, layers=cube)
    for case in ("2.5d d=2", "2d x dp2"):
        _check([result[case] for result in results], q=2)


def _bad_grid():
    mesh = grid_mesh("2d", 4)
    errors = {}
    for name, config in {
        "kv": get_preset("tiny", num_key_value_heads=1),
        "intermediate": get_preset("tiny", intermediate_size=175),
    }.items():
        try:
            parallelize_llama_2d(Llama(config), mesh=mesh)
        except ValueError as error:
            errors[name] = str(error)
    return errors


def test_grid_sizes_that_do_not_fit_the_model_name_the_field():
    errors = run_distributed(_bad_grid, world_size=4)[0]
    assert "q=2 does not divide num_key_value_heads=1; choose q in [1]" in errors["kv"]
    assert "q=2 does not divide intermediate_size=175" in errors["intermediate"]
