"""LoRA fine-tuning through the trainer: a pretrained Hugging Face Llama (``model.init_from``) gets adapters
(``lora.enabled``), trains on 2 processes with tp=2 (adapters sharded like their layers), keeps its base weights
bit for bit, resumes exactly, and exports both ways: merged (``colo convert --to hf``: transformers loads it and
gives the run's logits) and as a peft adapter (``--to peft``: ``PeftModel.from_pretrained`` on the base gives the
same logits as the merged model)."""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

pytest.importorskip("peft")
pytest.importorskip("transformers")

TOTAL_STEPS, EVERY, STOP = 6, 3, 4


def write_corpus(root) -> str:
    corpus = root / "corpus"
    corpus.mkdir()
    for index in range(4):
        lines = [f"def lora_{index}_{n}(y):\n    return y - {n} * {index}  # row {n}\n" for n in range(60)]
        (corpus / f"doc{index}.py").write_text("".join(lines))
    return str(corpus)


def write_base_model(root) -> str:
    """A 'pretrained' tiny Llama in Hugging Face format (vocabulary 320 >= the byte tokenizer's 259)."""
    from colo.apps import Llama, get_preset
    from colo.apps.hf.llama_io import save_llama_as_hf

    torch.manual_seed(11)
    model = Llama(get_preset("tiny", vocab_size=320))
    model.init_weights(11)
    directory = root / "base"
    save_llama_as_hf(model, directory)
    return str(directory)


def run_config(corpus: str, base: str, output_dir: str, **schedule) -> dict:
    return {
        "name": "lora-test",
        "output_dir": output_dir,
        "seed": 5,
        "model": {"init_from": base},
        "plugin": {"name": "hybrid", "tp": 2, "zero_stage": 1, "precision": "fp32"},
        "lora": {"enabled": True, "r": 4, "alpha": 8.0},
        "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
        "schedule": {"total_steps": TOTAL_STEPS, "warmup_steps": 1, "min_lr": 1e-3, **schedule},
        "data": {"paths": [corpus], "seq_len": 32, "global_batch_size": 4},
        "checkpoint": {"every_steps": EVERY, "keep_last": 2, "resume": "auto"},
        "logging": {"every_steps": 3, "progress_bar": False, "tensorboard": False, "jsonl": False},
        "sample": {"prompt": "def ", "max_new_tokens": 4},
    }


def _train(config: dict) -> dict:
    from colo.apps.train import train, validate_config

    result = train(validate_config(config))
    return {"losses": result.losses, "checkpoints": result.checkpoints, "sample": result.sample}


def _checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    from colo.tensor.checkpoint import load_checkpoint, read_index

    index = read_index(path)
    tensors = {n: torch.empty(e.shape, dtype=e.dtype) for n, e in index.tensors.items() if not n.startswith("optim/")}
    load_checkpoint(path, tensors, strict=False)
    return tensors


def test_lora_fine_tuning_from_a_pretrained_model_trains_resumes_and_exports(tmp_path):
    import transformers
    from peft import PeftModel

    from colo.apps.hf.llama_io import read_hf_state_dict
    from colo.apps.runs import export_llama_hf, export_lora_adapter

    corpus, base = write_corpus(tmp_path), write_base_model(tmp_path)
    straight = run_distributed(_train, run_config(corpus, base, str(tmp_path / "straight")), world_size=2)[0]
    run_distributed(_train, run_config(corpus, base, str(tmp_path / "resumed"), stop_at_step=STOP), world_size=2)
    resumed = run_distributed(_train, run_config(corpus, base, str(tmp_path / "resumed")), world_size=2)[0]

    assert sorted(straight["losses"]) == list(range(1, TOTAL_STEPS + 1))
    assert straight["losses"][TOTAL_STEPS] < straight["losses"][1]
    # resumed from step 3 (the stop came after step 4): steps 4..6 redone from the checkpoint, exactly
    assert sorted(resumed["losses"]) == list(range(EVERY + 1, TOTAL_STEPS + 1))
    for step, loss in resumed["losses"].items():
        assert loss == straight["losses"][step], step
    assert straight["sample"] is not None and straight["sample"].startswith("def ")

    checkpoint = straight["checkpoints"][-1]
    saved = _checkpoint_tensors(checkpoint)
    base_state = read_hf_state_dict(base)
    frozen = 0
    for name, tensor in saved.items():  # every base weight is exactly the pretrained one
        hf = "model." + name.replace(".base_layer.", ".") if not name.startswith("lm_head") else name
        if ".lora_" not in name:
            assert torch.equal(tensor, base_state[hf]), name
            frozen += 1
    assert frozen == len(base_state)
    lora_b = [t for n, t in saved.items() if ".lora_B." in n]
    assert len(lora_b) == 2 * 7 and all(t.abs().max() > 0 for t in lora_b)  # trained from peft's zero init

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    export_llama_hf(checkpoint, merged_dir)
    export_lora_adapter(checkpoint, adapter_dir)
    tokens = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = transformers.LlamaForCausalLM.from_pretrained(merged_dir).eval()
        merged_logits = merged(tokens).logits
        base_model = transformers.LlamaForCausalLM.from_pretrained(base).eval()
        base_logits = base_model(tokens).logits
        adapted = PeftModel.from_pretrained(base_model, adapter_dir).eval()
        adapted_logits = adapted(tokens).logits
    assert (merged_logits - base_logits).abs().max() > 1e-3  # the adapters changed the model
    # peft computes x W^T + s (x A^T) B^T, the merged model x (W + s B A)^T: equal up to fp32 rounding
    torch.testing.assert_close(adapted_logits, merged_logits, rtol=1e-5, atol=1e-5)
