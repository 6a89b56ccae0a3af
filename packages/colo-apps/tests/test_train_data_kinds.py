"""The trainer on SFT and token-budget data (``data.task: sft``, ``data.packing: documents``).

- Bad combinations fail validation with the field and the fix named.
- SFT on 2 processes: every trained batch is labelled exactly on the assistant's tokens (derived here from the
  rendered bytes, not from the dataset), the first step's loss is the mean of the two ranks' losses of a freshly
  initialized model on those batches, and tokens/s counts only the non-padding tokens.
- Packed documents on 2 processes: ``position_ids`` reach the model (the first loss matches the hand-computed loss
  with them and differs from the loss without them), and a run stopped and resumed reproduces the uninterrupted
  losses exactly (fp32, same layout).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from colo.apps.data import ByteTokenizer
from colo.apps.models.llama import Llama, LlamaConfig
from colo.apps.train import ConfigError, load_config, validate_config
from colo.apps.train.data_setup import build_data
from colo.comm.testing import run_distributed

ASSISTANT_MARKER = list(b"<|assistant|>\n")
EOS, PAD = ByteTokenizer.eos_id, ByteTokenizer.pad_id


def write_chats(path) -> str:
    """JSONL chat records: multi-turn messages (some with a system turn) and prompt/response pairs, some longer
    than a 64-token row."""
    with open(path, "w") as file:
        for n in range(40):
            if n % 3 == 0:
                record = {"prompt": f"add {n} and 1", "response": f"{n + 1}"}
            else:
                messages = [{"role": "system", "content": "Be brief."}] if n % 2 else []
                messages += [
                    {"role": "user", "content": f"double {n}"},
                    {"role": "assistant", "content": f"{2 * n}"},
                    {"role": "user", "content": "and again" + "!" * (n % 5)},
                    {"role": "assistant", "content": f"{4 * n}, done"},
                ]
                record = {"messages": messages}
            file.write(json.dumps(record) + "\n")
    return str(path)


def write_documents(path) -> str:
    """JSONL text records of 26 to 59 bytes: two or three documents per 96-token row."""
    with open(path, "w") as file:
        for n in range(240):
            text = f"def f{n}(x):\n" + "    x += 1\n" * (n % 4) + "    return x\n"
            file.write(json.dumps({"text": text}) + "\n")
    return str(path)


def run_config(data: dict, output_dir: str, **schedule) -> dict:
    return {
        "name": "data-kinds",
        "output_dir": output_dir,
        "seed": 5,
        "model": {"preset": "tiny"},
        "plugin": {"name": "ddp", "precision": "fp32", "max_grad_norm": 1.0},
        "optimizer": {"lr": 3e-3},
        "schedule": {"total_steps": 3, "warmup_steps": 1, **schedule},
        "data": {"global_batch_size": 4, **data},
        "checkpoint": {"enabled": False},
        "logging": {"every_steps": 1, "progress_bar": False, "tensorboard": False},
        "eval": {"every_steps": 3, "num_sequences": 4, "batch_size": 2},
        "sample": {"max_new_tokens": 0},
    }


# --- config validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.task=sft"], "data.task='sft' needs data.paths of chat records"),
        (["data.task=sft", "data.paths=[c.jsonl]", "data.format=text"], "data.format: data.task='sft' reads chat"),
        (["data.task=sft", "data.paths=[c.jsonl]", "data.max_tokens=1000"], "set data.max_tokens=null"),
        (["data.chat_template.turn_end=|"], "read only with data.task in ['dpo', 'rm', 'sft']"),
        (
            ["data.task=sft", "data.paths=[c.jsonl]", "data.chat_template.assistant_role=bot"],
            "data.chat_template: ChatTemplate: assistant_role='bot' has no entry in role_markers",
        ),
        (["data.packing=windows"], "data.packing: Input should be 'fixed' or 'documents'"),
        (["data.task=chat"], "data.task: Input should be 'pretrain', 'sft', 'rm', 'dpo', "),  # then the later tasks
    ],
)
def test_bad_data_combinations_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(overrides=overrides)
    assert message in str(error.value)


def test_defaults_are_unchanged_and_sft_settings_load():
    config = load_config(preset="tiny-llama")
    assert (config.data.task, config.data.packing) == ("pretrain", "fixed")
    sft = load_config(
        overrides=[
            "data.task=sft",
            "data.paths=[chats.jsonl]",
            "data.chat_template.role_markers={user: 'Q: ', assistant: 'A: '}",
            "data.chat_template.turn_end=' '",
        ]
    )
    template = sft.data.chat_template.template()
    assert template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) == (
        "<bos>Q: hi A: yo<eos>"
    )


def test_documents_packing_runs_under_every_hybrid_layout():
    """Every layout passes a batch's positions on: tensor and sequence parallelism (test_packed_documents.py) and
    pipelines, whose stages hand the positions and document ids on with the hidden states (the pipeline test
    below; pp x sp in test_sequence_pipeline.py); a pipeline averages its microbatches, so it keeps
    loss_weighting='microbatch'. SFT packs too."""
    layouts = (
        ["plugin.tp=2"],
        ["plugin.sp=2", "plugin.sp_mode=ulysses"],
        ["plugin.sp=2", "plugin.sp_mode=ring"],
        ["plugin.pp=2", "schedule.num_microbatches=2"],
        ["plugin.pp=2", "plugin.sp=2", "plugin.sp_mode=ring", "schedule.num_microbatches=2"],
    )
    for plugin in layouts:
        config = load_config(overrides=["plugin.name=hybrid", "data.packing=documents", *plugin])
        assert config.plugin.loss_weighting == ("microbatch" if config.plugin.pp > 1 else "token")
    sft = load_config(overrides=["data.task=sft", "data.paths=[c.jsonl]", "data.packing=documents"])
    assert sft.plugin.loss_weighting == "token"


def test_batches_count_their_real_tokens(tmp_path):
    chats, documents = write_chats(tmp_path / "c.jsonl"), write_documents(tmp_path / "d.jsonl")
    kinds = {
        "sft": {"task": "sft", "paths": [chats], "seq_len": 64},
        "sft-packed": {"task": "sft", "packing": "documents", "paths": [chats], "seq_len": 128},
        "documents": {"packing": "documents", "paths": [documents], "seq_len": 96},
        "fixed": {"paths": [documents], "seq_len": 96},
    }
    for kind, data in kinds.items():
        run = build_data(validate_config(run_config(data, str(tmp_path))), ByteTokenizer(), num_replicas=1, rank=0)
        batch, num_tokens = next(run.train_batches())
        assert num_tokens == int((batch["input_ids"] != PAD).sum()), kind  # the byte tokenizer's pad is only padding
        assert (num_tokens < batch["input_ids"].numel()) == (kind != "fixed"), kind
        assert len(run.eval) == 4 and len(run.train) + 4 == len(run.train.dataset), kind
        assert ("position_ids" in batch) == (kind in ("documents", "sft-packed")), kind
        if kind == "sft-packed":  # several conversations a row, each starting with bos at position 0
            bos = batch["input_ids"] == ByteTokenizer.bos_id
            assert bool((batch["position_ids"][bos] == 0).all()) and int(bos.sum()) > len(bos)
    with pytest.raises(ValueError, match="set data.task='sft' to train on chat records"):
        build_data(
            validate_config(run_config({"paths": [chats], "seq_len": 64}, str(tmp_path))),
            ByteTokenizer(),
            num_replicas=1,
            rank=0,
        )


# --- runs on 2 processes ------------------------------------------------------------------------------------------


def _train_recording(config: dict) -> dict:
    """Train, keeping every batch this rank fed the Booster and every tokens-per-second count it logged."""
    from colo.apps.train import Trainer

    trainer = Trainer(validate_config(config))
    batches, token_counts = [], []
    task = trainer.task
    train_step, count_tokens = trainer.booster.train_step, task._tokens_over_sample_ranks

    def recording_step(batch):
        batches.append({name: tensor.clone() for name, tensor in batch.items()})
        return train_step(batch)

    def recording_count(ctx, num_tokens):
        total = count_tokens(ctx, num_tokens)
        token_counts.append((num_tokens, total))
        return total

    trainer.booster.train_step, task._tokens_over_sample_ranks = recording_step, recording_count
    result = trainer.fit()
    return {
        "losses": result.losses,
        "eval_losses": result.eval_losses,
        "batches": batches,
        "token_counts": token_counts,
        "llama_config": dataclasses.asdict(task.llama_config),
    }


def initial_model(llama_config: dict, seed: int) -> Llama:
    """The model every rank starts from (the trainer's init: the run seed)."""
    model = Llama(LlamaConfig(**llama_config))
    model.init_weights(seed)
    return model


def assistant_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The labels SFT should carry, read off the rendered bytes: the tokens after each ``<|assistant|>\\n`` marker up
    to and including the ``eos`` that ends the reply; ``-100`` everywhere else."""
    ids = input_ids.tolist()
    labels, in_reply = [-100] * len(ids), False
    for index, token in enumerate(ids):
        if in_reply:
            labels[index] = token
            in_reply = token != EOS
        elif ids[max(0, index + 1 - len(ASSISTANT_MARKER)) : index + 1] == ASSISTANT_MARKER:
            in_reply = True
    return torch.tensor(labels)


def test_sft_run_trains_on_assistant_tokens_only(tmp_path):
    config = run_config({"task": "sft", "paths": [write_chats(tmp_path / "c.jsonl")], "seq_len": 64}, str(tmp_path))
    ranks = run_distributed(_train_recording, config, world_size=2)

    for rank in ranks:
        assert len(rank["batches"]) == 3 and sorted(rank["eval_losses"]) == [3]
        for batch in rank["batches"]:
            assert set(batch) == {"input_ids", "labels"}
            for input_ids, labels in zip(batch["input_ids"], batch["labels"]):
                torch.testing.assert_close(labels, assistant_labels(input_ids), rtol=0, atol=0)
    assert any((batch["input_ids"] == PAD).any() for batch in ranks[0]["batches"])  # rows are padded

    model = initial_model(ranks[0]["llama_config"], config["seed"])
    with torch.no_grad():
        first = [rank["batches"][0] for rank in ranks]
        # SFT defaults to plugin.loss_weighting='token': the mean over every labelled target of both ranks
        counts = [int((b["labels"][:, 1:] != -100).sum()) for b in first]
        rank_means = [float(model(b["input_ids"], labels=b["labels"]).loss) for b in first]
        by_hand = sum(mean * count for mean, count in zip(rank_means, counts)) / sum(counts)
        unmasked = sum(float(model(b["input_ids"], labels=b["input_ids"]).loss) for b in first) / 2
    assert validate_config(config).plugin.loss_weighting == "token"
    # The same fp32 ops on the same batch and weights; the tolerance only covers summation order differences
    # between the pytest process and the ranks (in practice the losses agree to the last bit).
    assert ranks[0]["losses"][1] == pytest.approx(by_hand, rel=1e-6, abs=1e-6)
    assert abs(unmasked - by_hand) > 1e-2  # the prompt mask matters

    # tokens/s counts the non-padding tokens of both ranks' batches (logging every step: one step per window)
    for step in range(3):
        real = [int((rank["batches"][step]["input_ids"] != PAD).sum()) for rank in ranks]
        assert [rank["token_counts"][step] for rank in ranks] == [(real[0], sum(real)), (real[1], sum(real))]


def test_documents_run_feeds_position_ids_to_the_model(tmp_path):
    data = {"packing": "documents", "paths": [write_documents(tmp_path / "d.jsonl")], "seq_len": 96}
    config = run_config(data, str(tmp_path))
    # Larger initial weights make attention depend visibly on positions already at step 1 (with the default 0.02
    # the scores are near zero, the attention nearly uniform, and positions move the loss by ~1e-5 only).
    config["model"]["initializer_range"] = 0.3
    ranks = run_distributed(_train_recording, config, world_size=2)

    first = [rank["batches"][0] for rank in ranks]
    for batch in first:
        assert set(batch) == {"input_ids", "labels", "position_ids"}
        restarts = (batch["position_ids"][:, 1:] == 0) & (batch["input_ids"][:, 1:] != PAD)
        assert restarts.any()  # several documents in a row, each starting again at position 0
    model = initial_model(ranks[0]["llama_config"], config["seed"])
    with torch.no_grad():
        with_positions = sum(
            float(model(b["input_ids"], labels=b["labels"], position_ids=b["position_ids"]).loss) for b in first
        )
        without_positions = sum(float(model(b["input_ids"], labels=b["labels"]).loss) for b in first)
    # Same fp32 ops on the same batch and weights; the tolerance covers only summation order (see the SFT test),
    # and the loss without the batch's positions is far outside it.
    assert ranks[0]["losses"][1] == pytest.approx(with_positions / 2, rel=1e-6, abs=1e-6)
    assert abs(with_positions - without_positions) / 2 > 1e-3


def test_documents_run_feeds_position_ids_to_every_pipeline_stage(tmp_path):
    data = {"packing": "documents", "paths": [write_documents(tmp_path / "d.jsonl")], "seq_len": 96}
    config = run_config(data, str(tmp_path), total_steps=1)
    config["plugin"] = {"name": "hybrid", "pp": 2, "precision": "fp32", "max_grad_norm": 1.0}
    config["schedule"]["num_microbatches"] = 2
    config["eval"] = {"every_steps": 1, "num_sequences": 2, "batch_size": 2}
    config["model"]["initializer_range"] = 0.3  # attention depends visibly on positions (see the test above)
    ranks = run_distributed(_train_recording, config, world_size=2)

    batch = ranks[0]["batches"][0]  # both stages' ranks are fed the step's whole batch (dp=1)
    assert (batch["position_ids"][:, 1:] == 0).any()  # packed rows: positions restart within a row
    model = initial_model(ranks[0]["llama_config"], config["seed"])
    halves = [{k: v.chunk(2)[i] for k, v in batch.items()} for i in range(2)]
    with torch.no_grad():  # the pipeline's loss: the mean of its microbatches' losses
        with_positions = sum(float(model(**half).loss) for half in halves) / 2
        without_positions = sum(float(model(h["input_ids"], labels=h["labels"]).loss) for h in halves) / 2
    # the last stage computes its loss with colo.kernels' cross-entropy: summation order only
    assert ranks[0]["losses"][1] == pytest.approx(with_positions, rel=1e-5)
    assert abs(with_positions - without_positions) > 1e-3
    assert ranks[0]["eval_losses"][1] == ranks[1]["eval_losses"][1]  # the pipeline's eval ran on both stages


def _train(config: dict) -> dict:
    from colo.apps.train import train

    result = train(validate_config(config))
    return {"losses": result.losses, "eval_losses": result.eval_losses, "start_step": result.start_step}


def test_documents_run_resumes_exactly(tmp_path):
    total, every, stop = 8, 3, 5
    corpus = write_documents(tmp_path / "d.jsonl")

    def config(output_dir: str, **schedule) -> dict:
        base = run_config({"packing": "documents", "paths": [corpus], "seq_len": 96}, output_dir)
        base["schedule"] = {"total_steps": total, "warmup_steps": 2, **schedule}
        base["checkpoint"] = {"every_steps": every, "keep_last": 2, "resume": "auto"}
        base["eval"] = {"every_steps": 4, "num_sequences": 4, "batch_size": 2}
        return base

    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    straight = run_distributed(_train, config(straight_dir), world_size=2)[0]
    stopped = run_distributed(_train, config(resumed_dir, stop_at_step=stop), world_size=2)[0]
    resumed = run_distributed(_train, config(resumed_dir), world_size=2)[0]

    assert sorted(straight["losses"]) == list(range(1, total + 1))
    assert sorted(stopped["losses"]) == list(range(1, stop + 1))
    assert resumed["start_step"] == stop // every * every
    assert sorted(resumed["losses"]) == list(range(stop // every * every + 1, total + 1))
    # bit for bit (fp32, same layout and data position): == on floats, not a tolerance
    for step, loss in {**stopped["losses"], **resumed["losses"]}.items():
        assert loss == straight["losses"][step], step
    assert resumed["eval_losses"][8] == straight["eval_losses"][8]


def test_an_sft_sample_answers_the_prompt_through_the_chat_template():
    """`complete` with a chat template: the prompt is the user's turn, generation starts after the assistant's
    marker (the same ids the template gives a generation prompt) and the eos is not shown."""
    from colo.apps import Llama, get_preset
    from colo.apps.data import ByteTokenizer, ChatTemplate
    from colo.apps.generation import complete, continue_prompt
    from colo.apps.runs import chat_template_of

    torch.manual_seed(0)
    model = Llama(get_preset("tiny", vocab_size=320)).eval()
    tokenizer, template = ByteTokenizer(), ChatTemplate()
    messages = [{"role": "user", "content": "2+2?"}]
    ids, _ = template.tokenize(messages, tokenizer, add_generation_prompt=True)
    expected = continue_prompt(model, ids, max_new_tokens=6, vocab_limit=tokenizer.vocab_size, eos_id=tokenizer.eos_id)
    text = complete(model, tokenizer, "2+2?", chat_template=template, max_new_tokens=6)
    rendered = template.render(messages, add_generation_prompt=True)
    assert text == rendered + tokenizer.decode([t for t in expected if t != tokenizer.eos_id])
    assert rendered.endswith("<|user|>\n2+2?\n<|assistant|>\n")
    assert complete(model, tokenizer, "def ", max_new_tokens=6).startswith("def ")
    assert chat_template_of({"config": {"data": {"task": "pretrain"}}}) is None
    assert chat_template_of({"config": {"data": {"task": "sft", "chat_template": {"turn_end": "|"}}}}) == ChatTemplate(
        turn_end="|"
    )
