"""Preference data (pairs in one item, labels on responses only, left truncation, errors naming file and line) and
the reward model (read at the last non-pad token; exported as LlamaForSequenceClassification with equal scores)."""

from __future__ import annotations

import json

import pytest
import torch

from colo.apps.data import IGNORE_INDEX, ByteTokenizer, ChatTemplate, collate
from colo.apps.rlhf import PreferenceDataset, attach_pair_forward, make_reward_model, read_preference_records


def write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_pairs_labels_and_left_truncation(tmp_path):
    tokenizer = ByteTokenizer()
    path = write(tmp_path / "prefs.jsonl", [{"prompt": "0123456789", "chosen": "ab", "rejected": "xyz"}])
    dataset = PreferenceDataset(read_preference_records(path), tokenizer, seq_len=12, max_prompt_len=6)
    item = dataset[0]
    assert item["input_ids"].shape == (2, 12) and item["lengths"].tolist() == [9, 10]
    assert dataset.num_prompts_truncated == 1  # bos + 10 digits -> the last 6 tokens
    prompt = tokenizer.encode("456789")
    assert item["input_ids"][0, :9].tolist() == prompt + tokenizer.encode("ab") + [tokenizer.eos_id]
    assert (
        item["labels"][0].tolist()
        == [IGNORE_INDEX] * 6 + tokenizer.encode("ab") + [tokenizer.eos_id] + [IGNORE_INDEX] * 3
    )
    assert item["labels"][1, 6:10].tolist() == tokenizer.encode("xyz") + [tokenizer.eos_id]
    assert item["input_ids"][1, 10:].tolist() == [tokenizer.pad_id] * 2
    batch = collate([item, item])  # (pairs, 2, seq): split on dim 0, a pair never splits
    assert batch["input_ids"].shape == (2, 2, 12)


def test_chat_records_go_through_the_template():
    tokenizer, template = ByteTokenizer(), ChatTemplate()
    record = {
        "prompt": [{"role": "user", "content": "hi"}],
        "chosen": [{"role": "assistant", "content": "yo"}],
        "rejected": "no",
    }
    item = PreferenceDataset([record], tokenizer, seq_len=64, template=template)[0]
    ids, labels = template.tokenize([*record["prompt"], {"role": "assistant", "content": "yo"}], tokenizer)
    assert item["input_ids"][0, : len(ids)].tolist() == ids
    assert item["labels"][0, : len(ids)].tolist() == labels  # the template's own mask: only the reply and its eos


@pytest.mark.parametrize(
    "line, message",
    [
        ({"prompt": "a", "chosen": "b"}, r"prefs.jsonl line 2: missing field\(s\) \['rejected'\]"),
        ({"prompt": "a", "chosen": "b", "rejected": "b"}, "prefs.jsonl line 2: chosen and rejected are equal"),
        ('{"prompt": ', "prefs.jsonl line 2: not valid JSON"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "prefs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, line])
    with pytest.raises(ValueError, match=message):
        PreferenceDataset(read_preference_records(path), ByteTokenizer(), seq_len=16)


def test_empty_response_after_truncation_is_an_error(tmp_path):
    path = write(tmp_path / "prefs.jsonl", [{"prompt": "a long prompt", "chosen": "b", "rejected": "c"}])
    with pytest.raises(ValueError, match="prefs.jsonl line 1: the prompt keeps 8 tokens .* leaving no response token"):
        PreferenceDataset(read_preference_records(path), ByteTokenizer(), seq_len=8, max_prompt_len=8)


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]).save_to_disk(str(tmp_path / "ds"))
    records = list(read_preference_records(tmp_path / "ds"))
    assert records == [({"prompt": "a", "chosen": "b", "rejected": "c"}, f"{tmp_path / 'ds'} row 0")]


def test_reward_model_reads_the_last_non_pad_token_and_exports_to_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from colo.apps import Llama, get_preset
    from colo.apps.rlhf import save_reward_model_as_hf

    tokenizer = ByteTokenizer()
    model = Llama(get_preset("tiny", vocab_size=320))
    model.init_weights(0)
    make_reward_model(model, seed=1)
    records = [{"prompt": "1+1=", "chosen": "2", "rejected": "11"}, {"prompt": "2+5=", "chosen": "7", "rejected": "8"}]
    batch = collate([PreferenceDataset(records, tokenizer, seq_len=16)[i] for i in range(2)])
    attach_pair_forward(model, head="reward", pad_id=tokenizer.pad_id)
    with torch.no_grad():
        rewards = model(**batch)["rewards"]
        full = model._colo_pair_forward(batch["input_ids"].reshape(4, 16), return_logits=True).logits[..., 0]
    last = batch["lengths"].reshape(4) - 1  # right padding: the last real token
    # the pair forward runs only up to the longest row: other matmul shapes, equal to rounding
    torch.testing.assert_close(rewards.reshape(4), full[torch.arange(4), last], rtol=1e-5, atol=1e-6)

    save_reward_model_as_hf(model, tmp_path / "rm", pad_token_id=tokenizer.pad_id)
    hf = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert hf.config.num_labels == 1 and hf.score.bias is None and hf.config.pad_token_id == tokenizer.pad_id
    with torch.no_grad():
        scores = hf(input_ids=batch["input_ids"].reshape(4, 16)).logits.reshape(4)
    torch.testing.assert_close(scores, rewards.reshape(4), rtol=1e-5, atol=1e-5)  # different kernels, same math
