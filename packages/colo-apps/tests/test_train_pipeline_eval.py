"""Held-out evaluation under a pipeline (``plugin.pp=2``): the trainer's eval loss equals the loss of the same
checkpoint's weights on the same held-out sequences computed in one process (mean over batches of the mean over
microbatches), to fp32 rounding (1e-5: the stages and the single process sum in the same order, the kernels may
not)."""

from __future__ import annotations

import torch

from colo.comm.testing import run_distributed

STEPS, MICROBATCHES, EVAL_BATCH = 3, 2, 4


def write_corpus(root) -> str:
    corpus = root / "corpus"
    corpus.mkdir()
    for index in range(4):
        lines = [f"def evaluate_{index}_{n}(z):\n    return z ** {n} - {index}  # {n}\n" for n in range(60)]
        (corpus / f"doc{index}.py").write_text("".join(lines))
    return str(corpus)


def run_config(corpus: str, output_dir: str) -> dict:
    return {
        "name": "pp-eval",
        "output_dir": output_dir,
        "seed": 2,
        "model": {"preset": "tiny"},
        "plugin": {"name": "hybrid", "pp": 2, "zero_stage": 0, "precision": "fp32"},
        "schedule": {"total_steps": STEPS, "warmup_steps": 1, "num_microbatches": MICROBATCHES},
        "data": {"paths": [corpus], "seq_len": 32, "global_batch_size": 4},
        "checkpoint": {"every_steps": STEPS, "resume": "none"},
        "logging": {"every_steps": STEPS, "progress_bar": False, "tensorboard": False, "jsonl": False},
        "eval": {"every_steps": STEPS, "num_sequences": 8, "batch_size": EVAL_BATCH},
        "sample": {"max_new_tokens": 0},
    }


def _train(config: dict):
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return result.eval_losses, result.checkpoints


def test_pipeline_eval_matches_the_single_process_loss_of_the_checkpoint(tmp_path):
    from colo.apps.data import collate, load_tokenizer
    from colo.apps.runs import load_llama
    from colo.apps.train import validate_config
    from colo.apps.train.data_setup import build_data

    config = run_config(write_corpus(tmp_path), str(tmp_path / "run"))
    eval_losses, checkpoints = run_distributed(_train, config, world_size=2)[0]
    assert list(eval_losses) == [STEPS]

    model, _ = load_llama(checkpoints[-1])
    held_out = build_data(validate_config(config), load_tokenizer(None), num_replicas=1, rank=0).eval
    batch_losses = []
    with torch.no_grad():
        for first in range(0, len(held_out), EVAL_BATCH):
            batch = collate([held_out[i] for i in range(first, first + EVAL_BATCH)])
            half = EVAL_BATCH // MICROBATCHES
            micro_losses = [
                model(**{k: v[i * half : (i + 1) * half] for k, v in batch.items()}).loss for i in range(MICROBATCHES)
            ]
            batch_losses.append(torch.stack(micro_losses).mean())
    expected = torch.stack(batch_losses).mean().item()
    assert abs(eval_losses[STEPS] - expected) <= 1e-5 * abs(expected), (eval_losses[STEPS], expected)
