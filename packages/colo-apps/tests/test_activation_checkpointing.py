"""Activation checkpointing applied from outside the model (`colo.apps.apply_activation_checkpointing`): each mode
leaves gradients unchanged and keeps the activation memory the shapes predict, on colo's Llama and on Hugging
Face's ``LlamaForCausalLM``.

How memory is measured: `torch.autograd.graph.saved_tensors_hooks` around the forward see every tensor autograd
saves outside a checkpointed region (a checkpointed block's own hooks take over inside it); the bytes are those of
the distinct storages, without the model's parameters and buffers (they exist with or without checkpointing).
Added to them, for ``"full"`` / ``"selective"``: the blocks' tensor arguments, which the checkpoint keeps for the
recomputation (positional ones as saved tensors, keyword ones in its closure), and for ``"selective"`` the op
outputs its policy caches (counted in the policy, from ``ctx.op_output``); for ``"offload"``, what `save_on_cpu`
packs is counted apart, as host memory (parameters, which it leaves in place, excluded). Without checkpointing,
each saved tensor is also attributed to the block running when it was saved (or to "outside").

Expected figures, for ``L`` blocks, batch ``b``, sequence ``s``, hidden ``h``, intermediate ``I``, head_dim ``d``,
``n_q`` / ``n_kv`` heads, fp32 (4 bytes), ``O`` the bytes saved outside the blocks without checkpointing:

- none: ``O + sum of the blocks' bytes B_i`` (measured).
- full: ``O + L * b*s*h*4`` (each block keeps its input) ``+ shared`` (the arguments every block gets: none for
  colo's Llama, whose rotary tables are buffers; cos and sin ``(1, s, d)`` and ``(1, s)`` int64 position ids for
  Hugging Face's, held once).
- every=2: blocks 1 and 3 as in full, blocks 0 and 2 as without (block 0 already saves HF's cos and sin, so of the
  shared arguments only the position ids are added): half of full's saving.
- selective: full ``+ L * b*s*4 * ((n_q + 2 n_kv) d + h + 2 I + h)`` (the q/k/v, o, gate, up and down matmul
  outputs) ``+`` the attention output and logsumexp: ``b*n_q*s*(d + 1)*4`` (colo's ``torch.ops.colo.flash_attention``
  and Hugging Face's SDPA kernel alike).
- offload: ``O`` stays on the compute device; the blocks' saved activations, ``sum B_i``, go to the host.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colo.apps import checkpointing
from colo.comm.testing import load_beside, run_distributed

selective = load_beside(__file__, "_selective_outputs.py", module_name="colo_apps_test_selective_outputs")

BATCH, SEQ, LAYERS, VOCAB = 2, 32, 4, 128
FP32 = 4


# --- models ----------------------------------------------------------------------------------------------------------


def native_llama() -> nn.Module:
    from colo.apps import Llama, get_preset

    model = Llama(get_preset("tiny", num_hidden_layers=LAYERS))
    model.init_weights(0)
    return model


def hf_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


MODELS = {"native": native_llama, "hf": hf_llama}


def shape_of(model: nn.Module) -> dict[str, int]:
    config = model.config
    return {
        "h": config.hidden_size,
        "I": config.intermediate_size,
        "n_q": config.num_attention_heads,
        "n_kv": config.num_key_value_heads,
        "d": config.hidden_size // config.num_attention_heads,
    }


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from colo.apps import Llama

    if isinstance(model, Llama):
        return model(ids, labels=ids).loss
    return model(input_ids=ids, labels=ids, use_cache=False).loss


# --- measurement -----------------------------------------------------------------------------------------------------


class ActivationBytes:
    """Distinct storage bytes held for backward (model parameters and buffers excluded), by where they are kept."""

    def __init__(self, model: nn.Module) -> None:
        self.model_storages = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.kept: dict[int, int] = {}  # on the compute device ("device"; the CPU here)
        self.host: dict[int, int] = {}  # packed by save_on_cpu
        self.parameters_left = 0  # saved parameters offload leaves in place
        self.by_block: dict[str, int] = {}  # without checkpointing: bytes attributed to the block that saved them
        self.current = "outside"
        self._alive: list[torch.Tensor] = []  # keeps counted storages alive so that no address is reused

    def add(self, table: dict[int, int], tensor: torch.Tensor, attribute: bool = False) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.model_storages or key in self.kept or key in self.host:
            return
        table[key] = storage.nbytes()
        self._alive.append(tensor)
        if attribute:
            self.by_block[self.current] = self.by_block.get(self.current, 0) + storage.nbytes()

    def saved_tensors_hooks(self):
        def pack(tensor):
            self.add(self.kept, tensor, attribute=True)
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def measure(model_name: str, mode: str | None, every: int = 1, monkeypatch=None):
    """One forward and backward; returns ``(bytes, gradients, model)``."""
    model = MODELS[model_name]()
    bytes_ = ActivationBytes(model)
    blocks = checkpointing.find_blocks(model)
    chosen = set()
    if mode is not None:
        chosen = set(checkpointing.apply_activation_checkpointing(model, mode=mode, every=every))
    for name, block in blocks:

        def enter(module, args, kwargs, name=name):
            bytes_.current = name
            if name in chosen and mode != "offload":  # the checkpoint holds the block's arguments for recompute
                for value in (*args, *kwargs.values()):
                    if isinstance(value, torch.Tensor):
                        bytes_.add(bytes_.kept, value)
                    elif isinstance(value, tuple):
                        for item in value:
                            if isinstance(item, torch.Tensor):
                                bytes_.add(bytes_.kept, item)

        def leave(module, args, output):
            bytes_.current = "outside"

        block.register_forward_pre_hook(enter, with_kwargs=True)
        block.register_forward_hook(leave)

    if mode == "selective":
        policy = checkpointing.selective_policy
        kept_outputs: list = []

        def counting_policy(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if decision == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                for output in selective.policy_outputs(ctx, op, args, kwargs, kept_outputs):
                    bytes_.add(bytes_.kept, output)
            return decision

        monkeypatch.setattr(checkpointing, "selective_policy", counting_policy)
    if mode == "offload":

        class CountingOffload(checkpointing._OffloadToHost):
            def __init__(self) -> None:
                super().__init__()
                pack = self.pack_hook

                def counting_pack(tensor):
                    packed = pack(tensor)
                    if packed[1] is None:  # left in place: a parameter
                        bytes_.parameters_left += 1
                    else:
                        bytes_.add(bytes_.host, tensor)
                    return packed

                self.pack_hook = counting_pack

        monkeypatch.setattr(checkpointing, "_OffloadToHost", CountingOffload)

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with bytes_.saved_tensors_hooks():
        loss = loss_of(model, ids)
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    return bytes_, gradients, model


# --- tests -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["native", "hf"])
def test_each_mode_keeps_gradients_and_saves_the_expected_activation_memory(model_name, monkeypatch):
    base, base_grads, model = measure(model_name, None)
    shape = shape_of(model)
    h, d, n_q, n_kv, inter = shape["h"], shape["d"], shape["n_q"], shape["n_kv"], shape["I"]
    outside = base.by_block["outside"]
    per_block = [base.by_block[name] for name, _ in checkpointing.find_blocks(model)]
    none_total = sum(base.kept.values())
    assert none_total == outside + sum(per_block)

    block_input = BATCH * SEQ * h * FP32
    # arguments every block gets, held once: none for colo's Llama (its rotary tables are buffers); for Hugging
    # Face's, cos and sin (1, s, d) fp32 and the (1, s) int64 position ids
    tables, position_ids = (0, 0) if model_name == "native" else (2 * SEQ * d * FP32, SEQ * 8)
    matmul_outputs = BATCH * SEQ * FP32 * ((n_q + 2 * n_kv) * d + h + 2 * inter + h)
    attention_output = BATCH * n_q * SEQ * (d + 1) * FP32  # the fused attention's output and logsumexp

    measured = {}
    for mode, every in [("full", 1), ("full", 2), ("selective", 1), ("offload", 1)]:
        with monkeypatch.context() as patch:
            result, grads, _ = measure(model_name, mode, every, patch)
        measured[(mode, every)] = result
        # full and selective recompute the same ops on the same inputs; offload recomputes nothing: bit-identical
        for name, grad in base_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=f"{mode}, every={every}: {name}")

    full = sum(measured["full", 1].kept.values())
    assert full == outside + LAYERS * block_input + tables + position_ids

    every_2 = sum(measured["full", 2].kept.values())
    # blocks 0 and 2 run as without checkpointing (block 0 saves the rotary tables), blocks 1 and 3 keep inputs
    assert every_2 == outside + per_block[0] + per_block[2] + 2 * block_input + position_ids
    assert none_total - every_2 == pytest.approx((none_total - full) / 2, rel=0.02)  # half the saving

    selective = sum(measured["selective", 1].kept.values())
    assert selective == full + LAYERS * (matmul_outputs + attention_output)
    assert full < selective < none_total

    offload = measured["offload", 1]
    assert sum(offload.kept.values()) == outside  # only what lies outside the blocks stays on the device
    assert sum(offload.host.values()) == sum(per_block)  # the blocks' saved activations go to the host
    assert offload.parameters_left >= LAYERS * 5  # and the weights their matmuls save stay (>= 5 linears a block)


def test_names_and_state_dict_are_unchanged_and_double_application_is_refused():
    model = native_llama()
    keys = list(model.state_dict())
    names = checkpointing.apply_activation_checkpointing(model, mode="selective", every=2)
    assert names == ["layers.1", "layers.3"]
    assert list(model.state_dict()) == keys
    with pytest.raises(ValueError, match=r"block 'layers.1' of Llama is already checkpointed \(mode='selective'\)"):
        checkpointing.apply_activation_checkpointing(model, mode="full")
    with torch.no_grad():  # evaluation runs the blocks as they are
        model(torch.zeros(1, 4, dtype=torch.long))


def test_blocks_found_or_named_and_errors_name_the_model():
    hf = hf_llama()
    assert [name for name, _ in checkpointing.find_blocks(hf)] == [f"model.layers.{i}" for i in range(LAYERS)]
    assert checkpointing.apply_activation_checkpointing(hf, blocks=["model.layers.0", "model.layers.2"]) == [
        "model.layers.0",
        "model.layers.2",
    ]
    model = native_llama()
    picked = checkpointing.apply_activation_checkpointing(model, blocks=lambda m: [m.layers["3"]], mode="offload")
    assert picked == ["layers.3"]

    with pytest.raises(ValueError, match="found no stack of blocks in Sequential"):
        checkpointing.apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="Llama has no module named 'layers.9'"):
        checkpointing.apply_activation_checkpointing(native_llama(), blocks=["layers.9"])
    with pytest.raises(ValueError, match="mode='partial' is unknown"):
        checkpointing.apply_activation_checkpointing(native_llama(), mode="partial")
    with pytest.raises(ValueError, match="every=0 must be a positive integer"):
        checkpointing.apply_activation_checkpointing(native_llama(), every=0)


def test_plugin_fields_are_validated():
    from colo.apps import DDP, Zero

    with pytest.raises(ValueError, match="DDP.activation_checkpointing='yes'"):
        DDP(activation_checkpointing="yes")
    with pytest.raises(ValueError, match="DDP.activation_checkpointing_every=0"):
        DDP(activation_checkpointing="full", activation_checkpointing_every=0)
    with pytest.raises(ValueError, match="Zero.activation_checkpointing='selective' does not work with stage=3"):
        Zero(stage=3, activation_checkpointing="selective")


def _ddp_losses(activation_checkpointing):
    from colo.apps import DDP, Booster

    rank = torch.distributed.get_rank()
    model = native_llama()
    booster = Booster(DDP(activation_checkpointing=activation_checkpointing))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    checkpointed = [getattr(block, "_colo_activation_checkpointing", None) for block in model.layers.values()]
    losses = []
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        losses.append(booster.train_step({"input_ids": tokens, "labels": tokens}).loss)
    return losses, checkpointed


def _ddp_with_and_without():
    return _ddp_losses(None), _ddp_losses("full")


def test_ddp_with_full_checkpointing_gives_the_same_losses():
    for (plain, plain_marks), (checkpointed, marks) in run_distributed(_ddp_with_and_without, world_size=2):
        assert plain_marks == [None] * LAYERS and marks == ["full"] * LAYERS
        assert checkpointed == plain  # recomputation repeats the same ops: bit-identical losses


# --- Hugging Face models with their KV cache on (use_cache=True, the config default) ---------------------------------


def _loss_and_grads(model: nn.Module, ids: torch.Tensor):
    """Loss, gradients and the returned KV cache's length (``None``: no cache) of one training forward called as a
    user would: ``use_cache`` left to the config."""
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    cache = output.past_key_values
    return output.loss.detach(), grads, None if cache is None else cache.get_seq_length()


@pytest.mark.parametrize("mode, every", [("selective", 1), ("full", 1), ("selective", 2)])
def test_hf_llama_with_the_default_use_cache_checkpoints_like_without(mode, every):
    model = hf_llama()
    assert model.config.use_cache  # the default: every forward builds a KV cache the blocks write
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    expected_loss, expected_grads, _ = _loss_and_grads(model, ids)

    model = hf_llama()
    checkpointing.apply_activation_checkpointing(model, mode=mode, every=every)
    loss, grads, cache_length = _loss_and_grads(model, ids)
    assert cache_length is None or cache_length <= SEQ  # no block appended its keys and values twice
    # the recomputation repeats the forward's ops on the same inputs; the only difference is that checkpointed
    # blocks write no KV cache, which the forward's attention reads back unchanged: equal to the last bit in fp32
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=f"{mode}, every={every}: {name}")


def _hf_ddp_losses(activation_checkpointing):
    from colo.apps import DDP, Booster

    rank = torch.distributed.get_rank()
    model = hf_llama()  # use_cache=True, the config default
    booster = Booster(DDP(activation_checkpointing=activation_checkpointing))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(2):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        losses.append(booster.train_step({"input_ids": tokens, "labels": tokens}).loss)
    return losses


def _hf_ddp_with_and_without():
    return _hf_ddp_losses(None), _hf_ddp_losses("selective")


def test_ddp_with_selective_checkpointing_of_a_default_hf_llama_gives_the_same_losses():
    for plain, checkpointed in run_distributed(_hf_ddp_with_and_without, world_size=2):
        # same ops on the same inputs (and DDP's same all-reduce): bit-identical, as for colo's Llama above
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)
