"""A mixture-of-experts run through the one trainer on 2 processes (``plugin.name: expert``, ep2, ZeRO-2, fp32): it
logs router statistics, a run resumed from its mid-run checkpoint reproduces its later losses exactly, and ``colo
convert --to hf`` of its checkpoint is a Mixtral that transformers loads with the logits of the run's model. Bad
combinations fail with errors naming the field, before any collective."""

from __future__ import annotations

import json
import os

import pytest
import torch

from colo.comm import RankFailure
from colo.comm.testing import run_distributed

TOTAL_STEPS, EVERY = 6, 3


def write_corpus(root) -> str:
    corpus = root / "corpus"
    corpus.mkdir()
    for index in range(3):
        lines = [f"def function_{index}_{n}(x):\n    return x * {n} + {index}  # line {n}\n" for n in range(40)]
        (corpus / f"doc{index}.py").write_text("".join(lines))
    return str(corpus)


def run_config(corpus: str, output_dir: str, **schedule) -> dict:
    return {
        "name": "moe-test",
        "output_dir": output_dir,
        "seed": 3,
        "model": {"preset": "tiny-moe", "router_z_loss_coef": 1e-3},
        "plugin": {"name": "expert", "ep": 2, "stage": 2, "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.1},
        "schedule": {"total_steps": TOTAL_STEPS, "warmup_steps": 2, "min_lr": 3e-4, **schedule},
        "data": {"paths": [corpus], "seq_len": 32, "global_batch_size": 8},
        "checkpoint": {"every_steps": EVERY, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 2, "progress_bar": False, "tensorboard": False},
        "eval": {"every_steps": TOTAL_STEPS, "num_sequences": 8, "batch_size": 2},
        "sample": {"prompt": "def ", "max_new_tokens": 4},
    }


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return {
        "losses": result.losses,
        "eval_losses": result.eval_losses,
        "start_step": result.start_step,
        "sample": result.sample,
    }


def _metrics(output_dir: str) -> dict[int, dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as file:
        return {record["step"]: record for record in map(json.loads, file) if "loss" in record}


def test_moe_run_logs_router_stats_resumes_exactly_and_converts_to_mixtral(tmp_path):
    corpus = write_corpus(tmp_path)
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")

    straight = run_distributed(_train, run_config(corpus, straight_dir), world_size=2)[0]
    middle = os.path.join(straight_dir, "checkpoints", f"step-{EVERY:08d}")
    config = run_config(corpus, resumed_dir)
    config["checkpoint"] = {**config["checkpoint"], "resume": middle}  # as a run stopped after step EVERY
    resumed = run_distributed(_train, config, world_size=2)[0]

    assert sorted(straight["losses"]) == list(range(1, TOTAL_STEPS + 1))
    assert straight["losses"][TOTAL_STEPS] < straight["losses"][1]
    assert resumed["start_step"] == EVERY and sorted(resumed["losses"]) == list(range(EVERY + 1, TOTAL_STEPS + 1))
    # bit for bit (fp32, the same ep2 layout): == on floats, not a tolerance
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], step
    assert resumed["sample"] == straight["sample"] and straight["sample"].startswith("def ")
    assert resumed["eval_losses"] == straight["eval_losses"]

    # router statistics of the logged steps: finite, dropless, within what top-2 of 4 experts allows; the resumed
    # run logs exactly what the uninterrupted one logged
    logged, again = _metrics(straight_dir), _metrics(resumed_dir)
    assert sorted(logged) == [2, 4, 6]
    for record in logged.values():
        assert record["moe_drop_fraction"] == 0.0
        assert 1 / 4 <= record["moe_max_expert_share"] <= 1 / 2  # an expert gets at most one of a token's 2 picks
        assert record["moe_load_balancing_loss"] > 0 and record["moe_z_loss"] > 0
    moe_keys = ("moe_load_balancing_loss", "moe_z_loss", "moe_drop_fraction", "moe_max_expert_share")
    assert {key: again[6][key] for key in moe_keys} == {key: logged[6][key] for key in moe_keys}

    # colo convert --to hf: a Mixtral directory with the logits of the run's model (loaded whole, every expert)
    transformers = pytest.importorskip("transformers")
    from colo.apps.runs import export_llama_hf, load_llama

    checkpoint = os.path.join(straight_dir, "checkpoints", f"step-{TOTAL_STEPS:08d}")
    model, run = load_llama(checkpoint)
    assert type(model).__name__ == "MoELlama" and run["llama_config"]["num_local_experts"] == 4
    files = export_llama_hf(checkpoint, tmp_path / "hf")
    assert sorted(os.path.basename(path) for path in files) == ["config.json", "model.safetensors"]
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(FileExistsError, match="overwrite"):
        export_llama_hf(checkpoint, tmp_path / "hf")

    # the held-out loss is the next-token loss alone (no router losses): the final model's cross-entropy on the
    # held-out rows in one process, batched as the 2 ranks batch them (rank r: rows r, r + 2, ... in pairs)
    from colo.apps.data import collate, load_tokenizer
    from colo.apps.train import validate_config
    from colo.apps.train.data_setup import build_data

    held_out = build_data(
        validate_config(run_config(corpus, straight_dir)), load_tokenizer(None), num_replicas=1, rank=0
    )
    batches = [[0, 2], [4, 6], [1, 3], [5, 7]]
    losses = []
    for rows in batches:
        batch = collate([held_out.eval[i] for i in rows])
        with torch.no_grad():
            logits = model(batch["input_ids"], return_logits=True).logits
        losses.append(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()))
    assert len(held_out.eval) == 8
    torch.testing.assert_close(
        straight["eval_losses"][TOTAL_STEPS], torch.stack(losses).mean().item(), rtol=1e-5, atol=0
    )


def test_bad_moe_settings_name_the_field(tmp_path):
    from colo.apps.train import ConfigError, validate_config

    corpus = write_corpus(tmp_path)
    config = run_config(corpus, str(tmp_path / "run"))
    cases = [
        ({"model": {"preset": "tiny"}}, "plugin.name='expert' splits the experts"),
        ({"plugin": {"name": "zero", "stage": 2}}, "set plugin.name='expert'"),
        ({"plugin": {"name": "expert", "ep": 3}}, "plugin.ep=3 does not divide model.num_local_experts=4"),
        ({"model": {"preset": "tiny", "num_local_experts": 4}, "plugin": {"name": "ddp"}}, "model.num_local_experts"),
        ({"lora": {"enabled": True}}, "lora.enabled"),
        ({"model": {"preset": "tiny"}, "plugin": {"name": "hybrid", "ep": 2}}, "plugin.ep=2 splits the experts"),
        # ep x Ulysses / ring sp runs (test_moe_booster), but not together with a pipeline
        ({"plugin": {"name": "hybrid", "ep": 2, "sp": 2, "sp_mode": "ring", "pp": 2}}, "HybridParallel.ep=2 with sp=2"),
    ]
    for change, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
            validate_config({**config, **change})
    # ep dividing the experts but not the world: the trainer refuses before the Booster builds any group
    with pytest.raises(RankFailure, match="plugin.ep=4 does not divide the world size 2"):
        run_distributed(_train, {**config, "plugin": {"name": "expert", "ep": 4}}, world_size=2)


def test_a_deepseek_v3_shaped_run_samples_and_converts_to_a_deepseek_v3(tmp_path):
    """The trainer runs tiny-deepseek's shape (MLA, a dense first layer, shared expert, group-limited sigmoid routing
    with the bias) for 2 steps on 2 processes, samples through MLA's KV cache, and ``colo convert --to hf`` of the
    checkpoint (expert biases from its metadata) loads in transformers' DeepseekV3ForCausalLM with the run's logits."""
    transformers = pytest.importorskip("transformers")
    from colo.apps.runs import export_llama_hf, load_llama

    corpus = write_corpus(tmp_path)
    config = run_config(corpus, str(tmp_path / "run"), total_steps=2)
    config["model"] = {"preset": "tiny-deepseek", "num_hidden_layers": 3, "hidden_size": 64}
    config["checkpoint"]["every_steps"] = 2
    result = run_distributed(_train, config, world_size=2)[0]
    assert result["sample"] and len(result["losses"]) == 2
    checkpoint = os.path.join(tmp_path / "run", "checkpoints", "step-00000002")
    model, _ = load_llama(checkpoint)
    assert model.config.kv_lora_rank == 64 and any(
        m.gate.expert_bias.abs().sum() > 0 for m in model.layers["1"].modules() if hasattr(m, "gate")
    )
    export_llama_hf(checkpoint, tmp_path / "hf")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
