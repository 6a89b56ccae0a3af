"""`Booster.memory_breakdown()` (issue 47): the model state each plugin holds on a rank, by kind, as the formulas
and the chunk optimizers' own buffers say (fp32 AdamW: parameters 4 bytes each, Adam's two moments 8; ZeRO shards
the optimizer part over the data ranks; chunks add padding), and the trainer logs it every logged step."""

from __future__ import annotations

import json
import os

import torch

from colo.comm.testing import run_distributed


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _breakdowns() -> dict:
    """One AdamW step of the same tiny Llama under DDP, ZeRO-2 (fp32, dp2) and the expert plugin on an MoE Llama."""
    from colo.apps.booster import DDP, Booster, Gemini, Zero
    from colo.apps.booster.plugins.expert import ExpertParallel
    from colo.apps.models.llama import Llama, get_preset
    from colo.apps.models.moe_llama import MoELlama, get_moe_preset

    out = {}
    for name in ("ddp", "zero2", "gemini", "expert"):
        torch.manual_seed(0)
        if name == "expert":
            model = MoELlama(get_moe_preset("tiny-moe", vocab_size=64))
            plugin = ExpertParallel(ep=2, stage=2, precision="fp32")
        else:
            model = Llama(get_preset("tiny", vocab_size=64))
            plugin = {
                "ddp": DDP,
                "zero2": lambda: Zero(stage=2, precision="fp32"),
                "gemini": lambda: Gemini(placement="static", optim_fractions={"host": 1.0}, chunk_numel=4096),
            }[name]()
        numel = _numel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        booster = Booster(plugin)
        booster.boost(model, optimizer)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        booster.train_step({"input_ids": ids, "labels": ids})
        breakdown = booster.memory_breakdown()
        engine_optimizer = booster.engine.optimizer
        chunk_optim = None
        if name == "expert":  # the optimizer buffers of both parts' chunks, counted here independently of the report
            chunk_optim = sum(
                buffer.tensor.untyped_storage().nbytes()
                for part in engine_optimizer.parts
                for chunk in part.chunks
                for key, buffer in chunk.buffers.items()
                if key.startswith("optim/") and buffer.aliases is None
            )
        out[name] = {"breakdown": breakdown, "numel": numel, "chunk_optim": chunk_optim}
    return out


def test_model_state_by_kind_follows_the_plugin():
    results = run_distributed(_breakdowns, world_size=2)
    for rank in results:
        ddp, zero, gemini, expert = rank["ddp"], rank["zero2"], rank["gemini"], rank["expert"]
        numel = ddp["numel"]
        # DDP: every parameter and its gradient (the reducer's buckets they are views of), both Adam moments and a
        # 4-byte step per parameter tensor: nothing sharded
        assert ddp["breakdown"]["params"] == 4 * numel
        assert 4 * numel <= ddp["breakdown"]["grads"] <= 4 * numel * 1.05  # buckets: a little padding at most
        assert 8 * numel <= ddp["breakdown"]["optimizer_states"] <= 8 * numel + 4096
        # ZeRO-2 over 2 ranks: whole compute copies (fp32 masters alias them), the moments of this rank's half
        assert zero["breakdown"]["params"] >= 4 * numel
        assert 4 * numel <= zero["breakdown"]["optimizer_states"] * 2 <= 4 * numel * 2 * 1.1 + 8192
        assert zero["breakdown"]["grads"] > 0
        # Gemini (static placement, optimizer state on the host tier): like ZeRO-3, this rank's half of the compute
        # copies on the device tier; its half's fp32 master, gradient shard and both moments (16 bytes an element) on
        # the host; chunks of 4096 elements add padding
        breakdown = gemini["breakdown"]
        assert 2 * numel <= breakdown["params"] <= 2 * numel * 1.2
        assert 8 * numel <= breakdown["optimizer_states"] <= 8 * numel * 1.2
        assert (
            breakdown["tier_device"] == breakdown["params"] and breakdown["tier_host"] == breakdown["optimizer_states"]
        )
        # expert plugin: the parts share one torch optimizer; their moments are counted once
        states = expert["breakdown"]["optimizer_states"]
        assert expert["chunk_optim"] <= states <= expert["chunk_optim"] + 4096, (states, expert["chunk_optim"])


def test_the_trainer_logs_the_breakdown(tmp_path):
    from colo.apps.train import load_config

    config = load_config(
        preset="tiny-llama",
        overrides=[
            f"output_dir={tmp_path}",
            "schedule.total_steps=2",
            "schedule.warmup_steps=1",
            "data.max_tokens=20000",
            "data.global_batch_size=4",
            "logging.every_steps=1",
            "logging.progress_bar=false",
            "eval.every_steps=null",
            "checkpoint.enabled=false",
            "sample.max_new_tokens=0",
        ],
    )
    run_distributed(_train, config, world_size=1)
    records = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert {"memory/params", "memory/grads", "memory/optimizer_states"} <= set(record)
        assert 2 * record["memory/params"] <= record["memory/optimizer_states"] <= 2 * record["memory/params"] + 4096


def _train(config):
    from colo.apps.train import Trainer

    Trainer(config).fit()
