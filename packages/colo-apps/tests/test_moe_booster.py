"""The tiny MoE Llama in the Booster with the `ExpertParallel` plugin (ep2, ZeRO-2, 2 microbatches, clipping): its
losses match the single process; a checkpoint saved at ep2 resumes at ep2 bit for bit, loads at ep1 (dp2) with
every tensor (weights and optimizer states) equal, and loads in one process; `HybridParallel` refuses tp / pp with
an MoE model, and `ExpertParallel` refuses bad sizes, before any collective.

Reference: data rank ``r`` gets sequences ``2r, 2r + 1`` of a step's 4, one per microbatch; the Booster's loss is
the mean over ranks and microbatches of the model's loss (next-token loss plus the per-microbatch aux loss), so the
single process takes the mean over the 4 sequences of the loss of each alone. Losses rtol 1e-5: the all-to-all,
the chunked reductions and the flat fp32 masters sum in another order than the single process.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from colo.apps.booster import Booster, ExpertParallel, HybridParallel
from colo.apps.models.moe_llama import MoELlama, get_moe_preset, moe_llama_state_dict_from_hf
from colo.comm.testing import run_distributed
from colo.tensor.checkpoint import load_checkpoint, read_index
from colo.tensor.moe import moe_blocks

STEPS, SAVE_AFTER, LR, MAX_NORM = 4, 3, 1e-2, 1.0
CONFIG = {"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "router_z_loss_coef": 1e-3}


def _model() -> MoELlama:
    model = MoELlama(get_moe_preset("tiny-moe", **CONFIG))
    model.init_weights(seed=7)
    return model


def _sequences(step: int) -> torch.Tensor:
    """The step's 4 sequences: the same every step, so the loss visibly falls."""
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(500))


def _boost(ep: int) -> tuple[Booster, torch.nn.Module]:
    model = _model()
    booster = Booster(ExpertParallel(ep=ep, stage=2, num_microbatches=2, max_grad_norm=MAX_NORM))
    model, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    return booster, model


def _step(booster: Booster, step: int) -> float:
    rank = booster.mesh.rank("dp") * booster.mesh.size("ep") + booster.mesh.rank("ep")
    x = _sequences(step)[2 * rank : 2 * rank + 2]
    return booster.train_step({"input_ids": x, "labels": x}).loss


def _train_and_save(path: str) -> list[float]:
    booster, _ = _boost(ep=2)
    losses = []
    for step in range(STEPS):
        losses.append(_step(booster, step))
        if step == SAVE_AFTER - 1:
            booster.save(path)
    return losses


def _resume(path: str, ep: int, resaved: str) -> float:
    booster, _ = _boost(ep=ep)
    booster.load(path)
    assert booster.step_count == SAVE_AFTER
    booster.save(resaved)
    return _step(booster, SAVE_AFTER)


def _reference_losses() -> list[float]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = sum(model(x[None], labels=x[None]).loss for x in _sequences(step)) / 4
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _read_all(path: str) -> dict[str, torch.Tensor]:
    index = read_index(path)
    tensors = {name: torch.empty(entry.shape, dtype=entry.dtype) for name, entry in index.tensors.items()}
    load_checkpoint(path, tensors, strict=True)
    return tensors


def test_expert_parallel_booster_matches_the_single_process_and_its_checkpoint_loads_at_any_ep(tmp_path):
    saved = os.fspath(tmp_path / "ep2")
    losses = run_distributed(_train_and_save, saved, world_size=2)
    reference = _reference_losses()
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(reference), rtol=1e-5, atol=0)
    assert reference[-1] < reference[0]

    # the same layout resumes bit for bit; ep1 (dp2) reads every tensor equal, then continues within rounding
    resumed_ep2 = run_distributed(_resume, saved, 2, os.fspath(tmp_path / "again-ep2"), world_size=2)
    resumed_ep1 = run_distributed(_resume, saved, 1, os.fspath(tmp_path / "again-ep1"), world_size=2)
    assert resumed_ep2 == [losses[0][SAVE_AFTER]] * 2
    torch.testing.assert_close(torch.tensor(resumed_ep1), torch.tensor([reference[SAVE_AFTER]] * 2), rtol=1e-5, atol=0)
    original = _read_all(saved)
    assert any(name.startswith("optim/") and "experts" in name for name in original)
    for layout in ("again-ep2", "again-ep1"):
        again = _read_all(os.fspath(tmp_path / layout))
        assert set(again) == set(original)
        for name, tensor in original.items():
            assert torch.equal(again[name], tensor), (layout, name)

    # one process: the weights load into an unsharded MoELlama, which computes the step's loss
    model = _model()
    state = moe_llama_state_dict_from_hf(
        {k: v for k, v in original.items() if not k.startswith("optim/")}, model.config
    )
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name.endswith("expert_bias") for name in missing)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), state[name]), name
    with torch.no_grad():
        loss = sum(model(x[None], labels=x[None]).loss for x in _sequences(SAVE_AFTER)) / 4
    torch.testing.assert_close(float(loss), losses[0][SAVE_AFTER], rtol=1e-5, atol=0)


def _boost_hybrid(settings: dict) -> str:
    model = _model()
    try:
        Booster(HybridParallel(**settings)).boost(model, torch.optim.AdamW(model.parameters()))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"sp": 2, "sp_mode": "ulysses"}, "HybridParallel.sp=2 (sp_mode='ulysses'): MoELlama has mixture-of-experts"),
        ({"sp": 2, "sp_mode": "ring"}, "HybridParallel.sp=2 (sp_mode='ring'): MoELlama has mixture-of-experts"),
        ({"ep": 2, "sp": 2, "sp_mode": "ulysses", "pp": 2}, "HybridParallel.ep=2 with sp=2, sp_mode='ulysses', pp=2"),
        ({"ep": 2, "sp": 2, "sp_mode": "ring", "pp": 2}, "HybridParallel.ep=2 with sp=2, sp_mode='ring', pp=2"),
        ({"ep": 4}, "HybridParallel.ep=4 does not divide the 2 data-parallel ranks"),
    ],
)
def test_hybrid_parallel_refuses_sequence_parallelism_with_experts_and_bad_ep(settings, expected):
    # raised by MoELlama's plan check or the mesh shape, before the mesh is built (no rank waits in a collective)
    for message in run_distributed(_boost_hybrid, settings, world_size=2):
        assert expected in message, message


def test_hybrid_parallel_refuses_ep_layouts_it_cannot_run_naming_the_field():
    from colo.apps.booster.moe_plan import MoELlamaPlan
    from colo.apps.booster.parallel_dims import LayoutError

    with pytest.raises(LayoutError, match=r"HybridParallel.ep=3 does not divide num_local_experts=4.*\[1, 2, 4\]"):
        MoELlamaPlan().check(_model(), HybridParallel(ep=3))
    with pytest.raises(LayoutError, match="HybridParallel.ep=2 with sp=1, sp_mode='megatron', pp=1 is not") as error:
        HybridParallel(ep=2, tp=2, sp_mode="megatron")
    assert error.value.field == "ep"
    with pytest.raises(LayoutError, match="HybridParallel.ep=2 with tp_mode='2d'"):
        HybridParallel(ep=2, tp=4, tp_mode="2d")
    with pytest.raises(LayoutError, match="HybridParallel.ep=0 must be a positive integer"):
        HybridParallel(ep=0)
    assert HybridParallel(ep=2, tp=2, pp=2, num_microbatches=2).mesh_shape(16) == {
        "pp": 2, "dp": 2, "ep": 2, "sp": 1, "tp": 2
    }  # fmt: skip


def test_expert_parallel_plugin_refuses_bad_settings():
    with pytest.raises(ValueError, match="ExpertParallel.stage=3"):
        ExpertParallel(ep=2, stage=3)
    with pytest.raises(ValueError, match="ExpertParallel.ep=0"):
        ExpertParallel(ep=0)
    with pytest.raises(ValueError, match="ExpertParallel.ep=3 does not divide the world size 2"):
        ExpertParallel(ep=3).mesh_shape(2)


def _train_bf16_with_expert_bias() -> tuple[list[float], list[torch.Tensor], list[torch.Tensor]]:
    model = MoELlama(get_moe_preset("tiny-moe", expert_bias=True))
    model.init_weights(seed=7)
    booster = Booster(ExpertParallel(ep=2, stage=1, precision="bf16", num_microbatches=2, max_grad_norm=MAX_NORM))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    rank = booster.mesh.rank("ep")
    x = _sequences(0)[2 * rank : 2 * rank + 2]  # each rank its own sequences
    losses = [booster.train_step({"input_ids": x, "labels": x}).loss for _ in range(4)]
    biases = [block.gate.expert_bias.clone() for _, block in moe_blocks(booster.unwrap())]
    routed = [block.stats["tokens_per_expert"].clone() for _, block in moe_blocks(booster.unwrap())]
    return losses, biases, routed


def test_expert_parallel_bf16_with_the_expert_bias_learns_and_keeps_one_bias_on_every_rank():
    """bf16 compute with fp32 masters, ZeRO-1, the aux-loss-free bias: the ranks see different tokens, but the bias
    is updated from counts summed over both, so it stays the same everywhere and moves."""
    (losses, biases, routed), (other_losses, other_biases, other_routed) = run_distributed(
        _train_bf16_with_expert_bias, world_size=2
    )
    assert any(not torch.equal(a, b) for a, b in zip(routed, other_routed))  # the ranks routed differently
    assert losses == other_losses and losses[-1] < losses[0]
    for bias, other in zip(biases, other_biases):
        assert torch.equal(bias, other) and bias.abs().sum() > 0


def _bias_run(path: str) -> tuple[list[float], list[float]]:
    def boost():
        model = MoELlama(get_moe_preset("tiny-moe", **CONFIG, expert_bias=True))
        model.init_weights(seed=7)
        booster = Booster(ExpertParallel(ep=2, stage=1, max_grad_norm=MAX_NORM))
        booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
        return booster

    booster = boost()
    straight = []
    for step in range(STEPS):
        straight.append(_step(booster, step))
        if step == SAVE_AFTER - 1:
            booster.save(path)
    resumed = boost()
    resumed.load(path)
    return straight[SAVE_AFTER:], [_step(resumed, step) for step in range(SAVE_AFTER, STEPS)]


def test_the_expert_bias_is_checkpointed_and_a_resumed_run_routes_as_the_uninterrupted_one(tmp_path):
    # the aux-loss-free bias moves every step outside autograd and the optimizer: without it in the checkpoint a
    # resumed run would route with zero biases and diverge
    for straight, resumed in run_distributed(_bias_run, str(tmp_path / "ckpt"), world_size=2, timeout=120):
        assert resumed == straight
    biases = read_index(str(tmp_path / "ckpt")).metadata["expert_bias"]
    assert biases and all(any(value != 0.0 for value in bias) for bias in biases.values())


# --- expert parallelism composed in HybridParallel (ep x pp, ep x tp, ep x dp ZeRO) --------------------------------

LAYOUT_STEPS = 5
DEEPSEEK = {
    **CONFIG, "num_local_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "score_func": "sigmoid", "expert_bias": True,
    "first_k_dense_replace": 1, "num_hidden_layers": 3,
}  # fmt: skip
LATENT = {
    "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}  # fmt: skip
"""Multi-head latent attention on tiny-moe's 4 heads (as tiny-deepseek: query latent, decoupled rotary key)."""
SHAPES = {"mixtral": CONFIG, "deepseek": DEEPSEEK, "deepseek-mla": {**DEEPSEEK, **LATENT}}


def _shaped_model(shape: str) -> MoELlama:
    model = MoELlama(get_moe_preset("tiny-moe", **SHAPES[shape]))
    model.init_weights(seed=7)
    return model


def _hybrid_run(shape: str, settings: dict, path: str):
    """``LAYOUT_STEPS`` Booster steps of ``HybridParallel(**settings)``: data rank ``d`` of ``n`` takes sequences
    ``d * 4 / n ..`` of the step's 4 (one per microbatch unless ``settings`` say how many microbatches); then a
    checkpoint at ``path``. Returns the losses and the expert biases of this rank's blocks."""
    import torch.distributed as dist

    model = _shaped_model(shape)
    data_ranks = dist.get_world_size() // settings.get("tp", 1) // settings.get("pp", 1) // settings.get("sp", 1)
    per_rank = 4 // data_ranks
    settings = {"num_microbatches": per_rank, **settings}
    booster = Booster(HybridParallel(**settings, max_grad_norm=MAX_NORM))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    mesh = booster.mesh
    rank = mesh.rank("dp") * mesh.size("ep") + mesh.rank("ep") if "ep" in mesh.axis_names else mesh.rank("dp")
    zero = booster.engine.optimizer
    probe = _Stage3Probe(zero) if settings.get("zero_stage") == 3 else None
    losses, norms = [], []
    for step in range(LAYOUT_STEPS):
        x = _sequences(step)[per_rank * rank : per_rank * (rank + 1)]
        result = booster.train_step({"input_ids": x, "labels": x})
        losses.append(result.loss)
        norms.append(result.grad_norm)
    booster.save(path)
    biases = {name: block.gate.expert_bias.clone() for name, block in moe_blocks(booster.engine.model)}
    if probe is not None:
        probe.check(zero, mesh)
    if settings.get("tp", 1) > 1:
        _check_tensor_parallel_experts(booster.engine.model, mesh, split=settings.get("expert_tensor_parallel", False))
    return losses, biases, norms


def _reload(shape: str, settings: dict, path: str, resaved: str) -> None:
    """Boost ``HybridParallel(**settings)``, load the checkpoint at ``path`` (saved in another layout) and save it
    again at ``resaved``."""
    model = _shaped_model(shape)
    booster = Booster(HybridParallel(**settings, max_grad_norm=MAX_NORM))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    booster.load(path)
    booster.save(resaved)


def _hybrid_runs(shape: str, cases: list[tuple[dict, str]]):
    """`_hybrid_run` of each ``(settings, path)`` in turn, in one call of the rank pool."""
    return [_hybrid_run(shape, settings, path) for settings, path in cases]


def _check_tensor_parallel_experts(model, mesh, *, split: bool) -> None:
    """ep x tp: the attention is split over tp; each ep rank's experts (this ep rank's half of the 8) are whole and
    the same on its tp ranks, or with ``split`` (expert tensor parallelism) each tp rank holds its half of every
    expert's intermediate width, its layout saying so; the router and the shared experts are whole either way."""
    from colo.comm import all_gather
    from colo.tensor import Shard, layout_of

    layer = next(layer for layer in model.layers.values() if hasattr(layer.mlp, "experts"))  # this stage's first
    attention = layer.self_attn
    if hasattr(attention, "kv_b_proj"):  # multi-head latent attention: heads split, latents replicated
        assert attention.num_heads == 4 // mesh.size("tp")
        for p in (attention.q_b_proj.weight, attention.kv_b_proj.weight, attention.o_proj.weight):
            assert isinstance(layout_of(p).placements[-1], Shard)
        for p in (attention.q_a_proj.weight, attention.kv_a_proj_with_mqa.weight, attention.kv_a_layernorm.weight):
            copies = all_gather(p.detach().contiguous()[None], group=mesh.group("tp"), dim=0)
            assert torch.equal(copies[0], copies[1])  # equal gradients on both tp ranks kept them equal
    else:
        qkv = attention.qkv_proj
        assert any(isinstance(layout_of(p).placements[-1], Shard) for p in qkv.parameters())  # tp is the last axis
    block = layer.mlp
    assert block.experts.w1.shape[0] == 8 // (mesh.size("ep") if "ep" in mesh.axis_names else 1)
    assert block.experts.w1.shape[1] == 32 // (2 if split else 1)
    assert isinstance(layout_of(block.experts.w2).placements[-1], Shard) == split
    replicated = [block.gate.weight, block.shared_experts.up_proj.weight]
    for p in replicated if split else [*replicated, block.experts.w1, block.experts.w2]:
        copies = all_gather(p.detach().contiguous()[None], group=mesh.group("tp"), dim=0)
        assert torch.equal(copies[0], copies[1])


class _Stage3Probe:
    """ZeRO-3 under ep: counts the dense part's saved-tensor packs (the expert part's hooks are the innermost, so
    without the chain `ExpertParallelZero` installs the dense gatherer never sees a saved weight, and its freed
    chunks stay referenced by autograd until backward)."""

    def __init__(self, zero) -> None:
        from colo.zero.stage3 import SavedChunkView

        self.dense_views = 0
        gatherer = zero.dense.gatherer
        pack = gatherer.pack_saved

        def counting(tensor):
            saved = pack(tensor)
            self.dense_views += isinstance(saved, SavedChunkView)
            return saved

        gatherer.pack_saved = counting

    def check(self, zero, mesh) -> None:
        assert self.dense_views > 0  # the dense weights autograd saved were stored as positions in their chunks
        # dense parameters sharded over dp x ep (4 ranks at dp2 x ep2), experts over dp; between steps nothing is
        # gathered
        assert zero.dense.group.size == mesh.size("dp") * mesh.size("ep") and zero.experts.group.size == mesh.size("dp")
        for part in zero.parts:
            for chunk in part.chunks:
                assert chunk.shard_numel * part.group.size == chunk.numel
                assert not part.gatherer.is_gathered(chunk) or part.gatherer.kept_for_backward == chunk.index


@functools.cache
def _hybrid_reference(shape: str, rows: int = 1):
    """One process: each step the mean over the 4 sequences, ``rows`` at a time (a microbatch's), of the model's loss
    on them (next-token loss plus their aux loss, as one microbatch computes it), clipped, torch's AdamW; the
    next-token part alone too (a pipeline reports that: its stages add their aux losses in backward). Expert biases
    from every sequence's counts. Cached: the layouts of one shape share it (the tests only read it)."""
    from colo.tensor.moe import moe_aux_loss, update_expert_biases

    model = _shaped_model(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    totals, next_token, norms = [], [], []
    for step in range(LAYOUT_STEPS):
        loss, lm = 0.0, 0.0
        for x in _sequences(step).split(rows):
            total = model(x, labels=x).loss
            share = rows / 4
            loss, lm = loss + total * share, lm + float(total.detach() - moe_aux_loss(model).detach()) * share
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        update_expert_biases(model)
        totals.append(float(loss.detach()))
        next_token.append(lm)
    biases = {name: block.gate.expert_bias.clone() for name, block in moe_blocks(model)}
    params = {name: p.detach() for name, p in model.named_parameters()}
    return totals, next_token, params, biases, norms


def _check_layout(
    shape: str,
    settings: dict,
    results,
    path: str,
    *,
    atol: float = 1e-4,
    world: int = 4,
    loss_rtol: float = 1e-5,
    norm_rtol: float | None = None,
) -> None:
    """Every rank's losses equal the single process (rtol 1e-5), and so does every weight of the checkpoint the run
    saved, read whole in one process (rtol 1e-5 / atol 1e-4: the all-to-all, the chunked reductions over other
    groups and, under tp, the split matrix products sum in another order, which Adam's normalization can amplify for
    tiny gradients); the expert biases exactly (sign updates of integer counts), on every rank and in the
    checkpoint."""
    data_ranks = world // settings.get("tp", 1) // settings.get("pp", 1) // settings.get("sp", 1)
    rows = 4 // data_ranks // settings.get("num_microbatches", 4 // data_ranks)
    totals, next_token, ref_params, ref_biases, ref_norms = _hybrid_reference(shape, rows)
    expected = next_token if settings.get("pp", 1) > 1 else totals
    for losses, biases, norms in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected), rtol=loss_rtol, atol=0, msg=str(settings)
        )
        if norm_rtol is not None:  # the gradient norm before clipping: the first step's as close as fp32 sums allow
            torch.testing.assert_close(torch.tensor(norms[0]), torch.tensor(ref_norms[0]), rtol=1e-6, atol=0)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=norm_rtol, atol=0)
        for name, bias in biases.items():
            torch.testing.assert_close(bias, ref_biases[name], rtol=0, atol=0, msg=name)
    saved = _read_all(path)
    state = moe_llama_state_dict_from_hf(
        {k: v for k, v in saved.items() if not k.startswith("optim/")}, _shaped_model(shape).config
    )
    assert set(state) >= set(ref_params), sorted(set(ref_params) - set(state))
    for name, reference in ref_params.items():
        torch.testing.assert_close(state[name], reference, rtol=1e-5, atol=atol, msg=f"{settings} {name}")
    if ref_biases and any(bias.abs().sum() > 0 for bias in ref_biases.values()):
        metadata = read_index(path).metadata["expert_bias"]
        for name, bias in ref_biases.items():
            assert torch.equal(torch.tensor(metadata[name]), bias), name
    assert totals[-1] < totals[0] - 0.1  # it learns: the comparison is not of a model standing still


def test_ep2_x_pp2_matches_the_single_process(tmp_path):
    """ep2 x pp2 on 4 ranks (1F1B, ZeRO-2, 2 microbatches per data rank) with the DeepSeek-style model (3 layers:
    stage 0 holds the dense layer 0 and MoE layer 1, stage 1 MoE layer 2; shared experts, group-limited sigmoid
    routing with the aux-loss-free bias, balance and z-losses): each stage splits its own MoE layers' experts over
    the ep group inside the stage, the stages' aux losses reach backward through their outputs, each stage updates
    its blocks' biases and the checkpoint holds both stages', which another layout loads. Measured: parameters
    within 3.7e-5 of one process (with the aux losses left out of the stages' backward they are 5e-2 off)."""
    settings = {"ep": 2, "pp": 2, "zero_stage": 2}
    path = os.fspath(tmp_path / "ep2-pp2")
    _check_layout("deepseek", settings, run_distributed(_hybrid_run, "deepseek", settings, path, world_size=4), path)
    # the checkpoint loads into another layout (ep2 x tp2 with split experts, ZeRO-1): every tensor it saves again,
    # weights and optimizer states, is equal to the one loaded; the expert biases too
    resaved = os.fspath(tmp_path / "ep2-tp2")
    other = {"ep": 2, "tp": 2, "zero_stage": 1, "expert_tensor_parallel": True}
    run_distributed(_reload, "deepseek", other, path, resaved, world_size=4)
    original, again = _read_all(path), _read_all(resaved)
    assert set(again) == set(original) and any(name.startswith("optim/") for name in original)
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name
    assert read_index(resaved).metadata["expert_bias"] == read_index(path).metadata["expert_bias"]


def test_ep2_x_dp2_zero3_and_ep2_x_pp2_zero3_match_the_single_process(tmp_path):
    """ZeRO-3 with expert parallelism on 4 ranks (the DeepSeek-style model), two layouts in one pool call: ep2 x dp2
    (one sequence per data rank), dense parameters sharded over the 4 data ranks, experts over the 2 holding the
    same experts, each part gathering its own chunks, the weights autograd saves stored as positions in either
    part's chunks; and ep2 x pp2 (each stage's chunks gathered once per step and held until its gradients are
    reduced). Measured: parameters within 5.4e-5 and 3.7e-5 of one process."""
    cases = [
        ({"ep": 2, "zero_stage": 3}, os.fspath(tmp_path / "ep2-dp2-zero3")),
        ({"ep": 2, "pp": 2, "zero_stage": 3}, os.fspath(tmp_path / "ep2-pp2-zero3")),
    ]
    per_rank = run_distributed(_hybrid_runs, "deepseek", cases, world_size=4)
    for index, (settings, path) in enumerate(cases):
        _check_layout("deepseek", settings, [results[index] for results in per_rank], path)


def test_ep2_x_tp2_matches_the_single_process_with_whole_and_split_experts(tmp_path):
    """ep2 x tp2 on 4 ranks (the DeepSeek-style model, ZeRO-1, one microbatch of 2 sequences per data rank):
    attention and the dense first layer's MLP split over tp; each ep rank's experts whole on both its tp ranks (which
    route the same tokens; the ep groups are the ranks of one tp coordinate), then with expert tensor parallelism
    (each expert's FFN split over tp, its partial outputs summed over tp), both in one pool call. Measured: parameters
    within 9.1e-5 of one process with whole experts and with split ones, as close as dp2 x tp2 without expert
    parallelism is (9.1e-5, on the same norm weight: tp's split products summing in another order); with two
    microbatches of one sequence whole experts drift to 1.6e-4 and dp2 x tp2 without ep to 1.7e-4 (on a shared
    expert's up projection): rounding amplified by Adam, alike with and without ep."""
    cases = [
        ({"ep": 2, "tp": 2, "zero_stage": 1, "num_microbatches": 1}, os.fspath(tmp_path / "ep2-tp2")),
        (
            {"ep": 2, "tp": 2, "zero_stage": 1, "num_microbatches": 1, "expert_tensor_parallel": True},
            os.fspath(tmp_path / "ep2-tp2-etp"),
        ),
    ]
    per_rank = run_distributed(_hybrid_runs, "deepseek", cases, world_size=4)
    for index, (settings, path) in enumerate(cases):
        _check_layout("deepseek", settings, [results[index] for results in per_rank], path)


def test_multi_head_latent_attention_under_tp2_matches_the_single_process(tmp_path):
    """The DeepSeek-style model with multi-head latent attention under tp2 on 2 ranks (ZeRO-1, 4 microbatches of one
    sequence): the heads' projections (q_b_proj, kv_b_proj by columns, o_proj by rows) split over tp, the latent
    projections and norms replicated with equal gradients (the rotary key's gradient summed over tp), the MoE blocks
    whole on both ranks; losses, every saved weight and the expert biases equal one process (`_check_layout`).
    Measured: weights within 7.0e-5 of one process (an expert's w3), losses within 4.7e-7 relative."""
    settings = {"tp": 2, "zero_stage": 1}
    path = os.fspath(tmp_path / "mla-tp2")
    results = run_distributed(_hybrid_run, "deepseek-mla", settings, path, world_size=2)
    _check_layout("deepseek-mla", settings, results, path, world=2)


def _train_fp16(overflow_step: int) -> tuple[list[float], list[bool], list[float], bool]:
    """ep2 x ZeRO-2 fp16 (the `_boost` run at fp16): at ``overflow_step`` ep rank 1 alone turns its first expert
    weight's gradient to inf (a tensor hook on the parameter: no dense gradient and no gradient of rank 0 sees it).
    Returns the losses, the skipped flags, the loss scale after each step, and whether the overflow step left every
    weight as it was."""
    model = _model()
    booster = Booster(ExpertParallel(ep=2, stage=2, precision="fp16", num_microbatches=2, max_grad_norm=MAX_NORM))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    zero = booster.engine.optimizer
    zero.loss_scaler.scale = 2.0**8  # no natural overflow at this scale: only the injected inf overflows
    rank = booster.mesh.rank("ep")
    poison = {"on": False}
    if rank == 1:
        w1 = moe_blocks(booster.unwrap())[0][1].experts.w1
        w1.register_hook(lambda grad: grad * float("inf") if poison["on"] else grad)
    losses, skipped, _, scales, unchanged = _steps_with_an_overflow(booster, poison, rank, overflow_step, STEPS)
    return losses, skipped, scales, unchanged


def _steps_with_an_overflow(booster, poison: dict, rank: int, overflow_step: int, num_steps: int):
    """``num_steps`` fp16 steps on data rank ``rank``'s sequences, ``poison["on"]`` (the injected inf) only at
    ``overflow_step``: the losses, the skipped flags, the grad norms, the loss scale after each step, and whether the
    overflow step left every weight of the rank as it was."""
    zero = booster.engine.optimizer
    losses, skipped, norms, scales, unchanged = [], [], [], [], False
    for step in range(num_steps):
        poison["on"] = step == overflow_step
        before = zero.full_params()
        x = _sequences(step)[2 * rank : 2 * rank + 2]
        result = booster.train_step({"input_ids": x, "labels": x})
        losses.append(result.loss)
        skipped.append(result.skipped)
        norms.append(result.grad_norm)
        scales.append(zero.loss_scaler.scale)
        if step == overflow_step:
            after = zero.full_params()
            unchanged = all(torch.equal(after[name], value) for name, value in before.items())
    return losses, skipped, norms, scales, unchanged


def test_expert_parallel_fp16_scales_the_loss_over_both_parts_and_skips_an_expert_overflow_everywhere():
    """fp16 with ep2 (ZeRO-2, 2 microbatches): one loss scaler serves the dense and the expert chunks and checks for
    inf / nan over every rank. An inf in ep rank 1's expert gradient only (rank 0's experts, and every dense
    gradient, stay finite) skips the step on both ranks, leaves every weight as it was and halves the scale; the
    other steps track the fp32 single process (fp16 compute: rtol 2e-2)."""
    reference = _reference_losses()
    for losses, skipped, scales, unchanged in run_distributed(_train_fp16, 1, world_size=2):
        assert skipped == [False, True, False, False] and unchanged
        assert scales == [2.0**8, 2.0**7, 2.0**7, 2.0**7]
        # each loss is computed before its step's update: the skipped step 1 did not move the weights, so step 2
        # sees what step 1 saw and the run is one update behind from there
        expected = [reference[0], reference[1], reference[1], reference[2]]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-2, atol=0)


DENSE_FIRST_STAGE = {**DEEPSEEK, "num_hidden_layers": 2}
"""The DeepSeek-style model in 2 layers: under pp2 stage 0 holds the dense layer 0 only (no expert part), stage 1
the MoE layer 1."""
SHAPES["deepseek-dense-stage"] = DENSE_FIRST_STAGE


def _train_ep_pp_fp16(overflow_step: int):
    """ep2 x pp2 fp16 (ZeRO-2, 1F1B, 2 microbatches of one sequence per data rank) of the 2-layer DeepSeek-style
    model: at ``overflow_step`` the rank at pp 1 / ep 1 alone turns its first expert weight's gradient to inf (stage 0
    has no experts and every dense gradient stays finite). Returns the losses, the skipped flags, the grad norms, the
    loss scale after each step and whether the overflow step left every weight of the rank as it was."""
    model = _shaped_model("deepseek-dense-stage")
    plugin = HybridParallel(ep=2, pp=2, zero_stage=2, precision="fp16", num_microbatches=2, max_grad_norm=MAX_NORM)
    booster = Booster(plugin)
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    zero = booster.engine.optimizer
    zero.loss_scaler.scale = 2.0**8  # no natural overflow at this scale: only the injected inf overflows
    mesh = booster.mesh
    poison = {"on": False}
    blocks = moe_blocks(booster.engine.model)
    assert bool(blocks) == (mesh.rank("pp") == 1) and (zero.experts is None) == (mesh.rank("pp") == 0)
    if mesh.rank("pp") == 1 and mesh.rank("ep") == 1:
        blocks[0][1].experts.w1.register_hook(lambda grad: grad * float("inf") if poison["on"] else grad)
    return _steps_with_an_overflow(booster, poison, mesh.rank("ep"), overflow_step, 4)


def test_ep2_x_pp2_fp16_makes_one_loss_scaler_decision_over_every_stage():
    """fp16 with ep2 x pp2 on 4 ranks, stage 0 without MoE blocks: one loss scaler over every rank (both stages, dense
    and expert parts) scales the loss and the stages' aux losses alike. An inf in one rank's expert gradient on stage
    1 skips the step on all 4 ranks, leaves every weight as it was and halves the scale; the other steps track the
    fp32 single process: next-token losses rtol 2e-3 and gradient norms before clipping rtol 1e-2 (fp16 compute).
    Measured: losses within 3.4e-4, norms within 2.0e-3; with the schedule's backward not loss-scaled the norms are
    0.047 for 1.93 (the gradients divided by a scale never applied), with the aux losses not loss-scaled 5.30 for
    5.11 (3.8%)."""
    _, next_token, _, _, ref_norms = _hybrid_reference("deepseek-dense-stage", 1)
    for losses, skipped, norms, scales, unchanged in run_distributed(_train_ep_pp_fp16, 1, world_size=4):
        assert skipped == [False, True, False, False] and unchanged
        assert scales == [2.0**8, 2.0**7, 2.0**7, 2.0**7]
        assert norms[1] == float("inf")
        # the skipped step 1 did not move the weights: step 2 sees what step 1 saw, one update behind from there
        expected = [next_token[0], next_token[1], next_token[1], next_token[2]]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-3, atol=0)
        expected_norms = [ref_norms[0], ref_norms[1], ref_norms[2]]
        torch.testing.assert_close(
            torch.tensor([norms[0], norms[2], norms[3]]), torch.tensor(expected_norms), rtol=1e-2, atol=0
        )


def _sequence_parallel_runs(cases: list[tuple[str, dict, str]]):
    """`_hybrid_run` of each ``(shape, settings, path)`` in turn, in one call of the rank pool."""
    return [_hybrid_run(shape, settings, path) for shape, settings, path in cases]


def test_ep2_x_ulysses_and_ring_sp2_match_the_single_process(tmp_path):
    """ep2 x Ulysses sp2 and ep2 x ring sp2 on 4 ranks (ZeRO-1, 2 microbatches of one sequence per data rank, each
    sequence's 16 tokens split 8 + 8 over sp: contiguous under Ulysses, ring attention's zigzag chunks 0 + 3 and 1 + 2
    under ring), the DeepSeek-style model (sigmoid routing with the aux-loss-free bias, per-sequence balance
    loss, shared experts, a dense first layer) and the Mixtral-shaped one (softmax routing, per-microbatch balance
    loss, z-loss), both in one pool call: the sp ranks are data ranks of both gradient groups (dense over ep x sp,
    experts over sp), the balance loss counts each whole sequence's assignments, the aux losses escape the shard's
    next-token weight, and the bias counts are summed over sp. Losses (next-token plus aux), the gradient norm before
    clipping, every parameter after 5 AdamW steps and the expert biases (exactly) equal one process.

    Measured: DeepSeek-style losses within 9.6e-7 relative, grad norms 4.4e-6, parameters 2.9e-4 (21 of the 2048
    elements of a shared expert's up projection above 1e-5, the median 9e-8: rounding Adam amplifies for tiny
    gradients, as under ep2 x tp2); Mixtral-shaped: first step's loss and grad norm within 4.8e-8, over 5 steps losses
    1.4e-5, grad norms 1.1e-4, parameters 6.6e-4 (median 2.5e-6; ep2 x dp2 without sp drifts to 5.7e-5 on the same
    model: Ulysses' attention sums in another order and Adam amplifies it). With the balance loss counting only each
    rank's piece the first step is already off (losses 5.6e-5 / 1.6e-4 relative, grad norms 1.1e-4 / 5.7e-5) and
    after 5 steps 1.3e-3 / 1.9e-2 (grad norms 3.5e-2 / 0.23); with the aux losses weighted by the shard's next-token
    weight (16/15 and 14/15 here), first-step grad norms 7.4e-6 / 2.2e-5 and after 5 steps 5.2e-2 / 8.8e-2.

    Ring (routing is per token, so the zigzag pieces need nothing the contiguous ones do not), measured: DeepSeek-style
    losses 1.0e-6, grad norms 4.9e-6, parameters 3.1e-4 (median 1.0e-7); Mixtral-shaped losses 2.1e-5, grad norms
    1.7e-4, parameters 1.2e-3 (median 3.6e-6), first step's loss and grad norm within 2.4e-8. Under ring too the
    ablations fail: the balance loss counting each rank's piece only, after 5 steps losses 4.4e-3 / 2.5e-3, grad norms
    4.1e-2 / 1.8e-2, DeepSeek's biases differ; the aux losses weighted by the shard's weight, losses 4.8e-3 / 1.5e-3,
    grad norms 1.9e-2 / 4.6e-2."""
    cases = [
        (shape, {"ep": 2, "sp": 2, "sp_mode": mode, "zero_stage": 1, "num_microbatches": 2}, f"{mode}-{shape}")
        for mode in ("ulysses", "ring")
        for shape in ("deepseek", "mixtral")
    ]
    cases = [(shape, settings, os.fspath(tmp_path / name)) for shape, settings, name in cases]
    per_rank = run_distributed(_sequence_parallel_runs, cases, world_size=4)
    tolerances = {  # (loss rtol, grad norm rtol, parameter atol): see the docstring's measurements
        "deepseek": (1e-5, 1e-5, 5e-4),
        "mixtral": (3e-5, 3e-4, 1.5e-3),
    }
    for index, (shape, settings, path) in enumerate(cases):
        loss_rtol, norm_rtol, atol = tolerances[shape]
        results = [rank_results[index] for rank_results in per_rank]
        _check_layout(shape, settings, results, path, atol=atol, loss_rtol=loss_rtol, norm_rtol=norm_rtol)
