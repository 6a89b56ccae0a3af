"""colo's DPO family equals TRL 1.16 step by step, single process, on a tiny Hugging Face Llama.

``sigmoid`` (DPO) and ``ipo`` against ``trl.DPOTrainer`` (``ref_model=`` a copy of the initial model), ``simpo``
against ``trl.experimental.cpo.CPOTrainer(loss_type="simpo", cpo_alpha=0)``: 5 steps of fused AdamW (constant LR, no
warmup, weight decay 0.01 on matrices only: the Trainer's groups for a Llama), clipping at 1.0, all 4 pairs in every
step, sequences shorter than ``max_length``. colo runs through `Booster(DDP(max_grad_norm=1.0))` on one rank with the
reference log-probs precomputed from the initial weights.

Tolerances (fp32): losses and parameters rtol 1e-5 / atol 1e-5. Not bit-identical: TRL pads the batch as
``[chosen..., rejected...]`` and computes log-probs with its fused LM head, colo as ``[c0, r0, c1, r1, ...]`` with a
log-softmax; the same sums reduced in another order. TRL runs with ``bf16=False`` (its default is bf16 autocast).
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import run_distributed

pytest.importorskip("trl")

STEPS, LR, BETA, EPS = 5, 5e-3, 0.1, 1e-8
RECORDS = [
    {"prompt": "12+35=", "chosen": "47", "rejected": "48"},
    {"prompt": "7+8=", "chosen": "15", "rejected": "16"},
    {"prompt": "60+21=", "chosen": "81", "rejected": "71"},
    {"prompt": "9+90=", "chosen": "99", "rejected": "89"},
]
CHARS = "0123456789+=abcdefghijklmnopqrstuvwxyz "


def write_tokenizer(directory: str) -> None:
    """A character-level Hugging Face tokenizer (no download): one id per character, <eos> and <pad>, no bos."""
    import tokenizers
    import transformers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)


def make_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return transformers.LlamaForCausalLM(config)


def optimizer_for(model):
    """The Trainer's AdamW groups for a Llama: weight decay on matrices, none on the norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, eps=EPS, fused=True)


def colo_run(loss_type: str, tokenizer_dir: str):
    from colo.apps import DDP, Booster
    from colo.apps.data import collate, load_tokenizer
    from colo.apps.rlhf import (
        PreferenceCriterion,
        PreferenceDataset,
        WithReferenceLogps,
        attach_pair_forward,
        precompute_reference_logps,
    )

    tokenizer = load_tokenizer(tokenizer_dir)
    dataset = PreferenceDataset(RECORDS, tokenizer, seq_len=16, add_bos=False)
    model = make_model()
    attach_pair_forward(model, head="logps", pad_id=tokenizer.pad_id)
    criterion = PreferenceCriterion(loss_type, beta=BETA if loss_type != "simpo" else 2.0, simpo_gamma=0.5)
    booster = Booster(DDP(max_grad_norm=1.0))
    booster.boost(model, optimizer_for(model), criterion=criterion)
    if criterion.needs_reference:
        table = precompute_reference_logps(booster.engine.forward, dataset, batch_size=len(dataset))
        dataset = WithReferenceLogps(dataset, table)
    batch = collate([dataset[i] for i in range(len(dataset))])
    losses, params = [], []
    for _ in range(STEPS):
        losses.append(booster.train_step(batch).loss)
        params.append({n.removeprefix("module."): p.detach().clone() for n, p in booster.unwrap().named_parameters()})
    return losses, params


def trl_run(loss_type: str, tokenizer_dir: str, output_dir: str):
    import datasets
    import transformers
    import trl
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = make_model()
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=len(RECORDS),
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=STEPS,
        weight_decay=0.01,
        adam_epsilon=EPS,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast; the comparison is in fp32
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        max_length=64,
        dataloader_drop_last=False,
    )
    recorded_losses, recorded_params = [], []

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            recorded_params.append({n: p.detach().clone() for n, p in model.named_parameters()})

    dataset = datasets.Dataset.from_list(RECORDS)
    if loss_type == "simpo":
        config = CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5, **common)
        base = CPOTrainer
        kwargs = {}
    else:
        config = trl.DPOConfig(loss_type=[loss_type], beta=BETA, **common)
        base = trl.DPOTrainer
        kwargs = {"ref_model": make_model()}

    class Recording(base):
        def compute_loss(self, *args, **kw):
            loss = super().compute_loss(*args, **kw)
            value = loss[0] if isinstance(loss, tuple) else loss
            recorded_losses.append(value.item())
            return loss

    trainer = Recording(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[Record()], **kwargs
    )
    trainer.train()
    return recorded_losses, recorded_params


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_matches_trl_step_by_step(loss_type, tmp_path):
    tokenizer_dir = str(tmp_path / "tokenizer")
    write_tokenizer(tokenizer_dir)
    expected_losses, expected_params = trl_run(loss_type, tokenizer_dir, str(tmp_path / "trl"))
    losses, params = run_distributed(colo_run, loss_type, tokenizer_dir, world_size=1)[0]
    assert len(expected_losses) == STEPS and len(expected_params) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-5)
    if loss_type == "sigmoid":
        assert abs(losses[0] - 0.6931471805599453) < 1e-6  # the policy starts equal to the reference
    for step in range(STEPS):
        for name, value in expected_params[step].items():
            torch.testing.assert_close(params[step][name], value, rtol=1e-5, atol=1e-5, msg=f"step {step + 1}: {name}")
