"""Every layout of the Booster saves every tensor of the model: a checkpoint saved after one step at lr=0 holds
exactly the single-process model's parameters (Hugging Face-style names, q, k and v apart), each `torch.equal` to
the seeded model it was built from, plus AdamW's two moments per trainable parameter, and `verify_checkpoint`
accepts it. Bit-equality holds because the weights have not moved (AdamW at lr=0 multiplies by 1 and adds 0):
every rank built the same seeded model and the checkpoint stores the fp32 masters, only cut into pieces.

Layouts: DDP, Zero 1/2/3 and Gemini over dp2; HybridParallel tp2, pp2, pp2 x tp2 (ZeRO 0 and 1), pp2 x dp2,
dp2 x tp2, interleaved pp2 x tp2 with two model chunks per rank, pp2 x tp2 x dp2 (8 ranks); a tied-embedding Llama
under pp2 x tp2; the Hugging Face Llama under pp2 x tp2.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

ROWS, SEQ, VOCAB = 8, 16, 128


def make_model(kind: str):
    torch.manual_seed(0)
    if kind == "hf-llama":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(config)
    from colo.apps import Llama, get_preset

    model = Llama(get_preset("tiny", num_hidden_layers=4, tie_word_embeddings=kind == "llama-tied"))
    model.init_weights(0)
    return model


def expected_tensors(kind: str) -> dict[str, torch.Tensor]:
    """The single-process model's parameters under their checkpoint names (colo's fused q/k/v split in three)."""
    model = make_model(kind)
    expected = {}
    for name, param in model.named_parameters():
        if name.endswith("qkv_proj.weight"):
            config = model.config
            rows = [n * config.head_dim for n in (config.num_attention_heads, *[config.num_key_value_heads] * 2)]
            for part, value in zip("qkv", param.detach().split(rows)):
                expected[name.replace("qkv_proj", f"{part}_proj")] = value.clone()
        else:
            expected[name] = param.detach().clone()
    return expected


def _save_after_boost(kind: str, plugin_name: str, settings: dict, path: str) -> None:
    from colo.apps import DDP, Booster, Gemini, Zero
    from colo.apps.booster import HybridParallel

    plugins = {"ddp": DDP, "zero": Zero, "gemini": Gemini, "hybrid": HybridParallel}
    model = make_model(kind)
    booster = Booster(plugins[plugin_name](**settings))
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=0.0))
    mesh = booster.engine.mesh
    rows = ROWS // mesh.size("dp")
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    local = tokens[mesh.rank("dp") * rows : (mesh.rank("dp") + 1) * rows]
    booster.train_step({"input_ids": local, "labels": local.clone()})  # lr=0: creates AdamW's moments only
    booster.save(path)


LAYOUTS = {
    "ddp-dp2": ("ddp", {}, 2),
    "zero1-dp2": ("zero", {"stage": 1}, 2),
    "zero2-dp2": ("zero", {"stage": 2}, 2),
    "zero3-dp2": ("zero", {"stage": 3}, 2),
    "gemini-dp2": ("gemini", {"chunk_numel": 4096, "device_capacity": "64MiB"}, 2),
    "tp2": ("hybrid", {"tp": 2}, 2),
    "pp2": ("hybrid", {"pp": 2, "num_microbatches": 2}, 2),
    "pp2-tp2-zero0": ("hybrid", {"pp": 2, "tp": 2, "num_microbatches": 2, "zero_stage": 0}, 4),
    "pp2-tp2-zero1": ("hybrid", {"pp": 2, "tp": 2, "num_microbatches": 2, "zero_stage": 1}, 4),
    "pp2-dp2": ("hybrid", {"pp": 2, "num_microbatches": 2}, 4),
    "dp2-tp2": ("hybrid", {"tp": 2}, 4),
    "pp2-tp2-interleaved": (
        "hybrid",
        {"pp": 2, "tp": 2, "num_microbatches": 2, "schedule": "interleaved_1f1b", "num_model_chunks": 2},
        4,
    ),
    "pp2-tp2-dp2": ("hybrid", {"pp": 2, "tp": 2, "num_microbatches": 2}, 8),
}


def _check_complete(kind: str, path: str) -> None:
    from colo.tensor.checkpoint import load_checkpoint, read_index, verify_checkpoint

    expected = expected_tensors(kind)
    index = read_index(path)
    weights = {name for name in index.tensors if not name.startswith("optim/")}
    assert sorted(weights) == sorted(expected), (
        f"missing {sorted(set(expected) - weights)}, unexpected {sorted(weights - set(expected))}"
    )
    moments = {f"optim/{name}/{key}" for name in expected for key in ("exp_avg", "exp_avg_sq")}
    assert {name for name in index.tensors if name.startswith("optim/")} == moments
    stored = {name: torch.empty(entry.shape, dtype=entry.dtype) for name, entry in index.tensors.items()}
    load_checkpoint(path, stored)
    for name, value in expected.items():
        assert torch.equal(stored[name], value), name
    assert index.expected == {name: entry.shape for name, entry in index.tensors.items()}
    assert verify_checkpoint(path).num_tensors == len(index.tensors)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_booster_layout_saves_every_tensor_of_the_native_llama(layout, tmp_path):
    plugin_name, settings, world_size = LAYOUTS[layout]
    path = str(tmp_path / "ckpt")
    run_distributed(_save_after_boost, "llama", plugin_name, settings, path, world_size=world_size, timeout=180)
    _check_complete("llama", path)


@pytest.mark.parametrize(
    "kind, layout", [("llama-tied", "pp2-tp2-zero1"), ("llama-tied", "pp2"), ("hf-llama", "pp2-tp2-zero1")]
)
def test_tied_and_hugging_face_llamas_save_every_tensor_under_pipelines(kind, layout, tmp_path):
    plugin_name, settings, world_size = LAYOUTS[layout]
    path = str(tmp_path / "ckpt")
    run_distributed(_save_after_boost, kind, plugin_name, settings, path, world_size=world_size, timeout=180)
    _check_complete(kind, path)


def test_colo_convert_refuses_a_checkpoint_without_every_layer_of_its_config(tmp_path):
    # as the pp x tp runs before the fix wrote them: stage 0's tensors only, and no `expected` in the index
    import dataclasses

    from colo.apps import get_preset
    from colo.apps.runs import RUN_KEY, export_llama_hf
    from colo.tensor.checkpoint import CheckpointError, save_checkpoint

    config = get_preset("tiny", num_hidden_layers=4)
    stage0 = {
        n: v for n, v in expected_tensors("llama").items() if n.startswith(("embed_tokens", "layers.0.", "layers.1."))
    }
    save_checkpoint(tmp_path / "ckpt", stage0, metadata={RUN_KEY: {"llama_config": dataclasses.asdict(config)}})
    with pytest.raises(CheckpointError, match=r"lacks 20 weights of its Llama config \(4 layers\): layers.2."):
        export_llama_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
