"""SFT: the chat template renders conversations and only the assistant's replies carry a loss."""

import json

import pytest
import torch

from colo.apps.data import ByteTokenizer, ChatTemplate, SFTDataset, read_documents

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ciao"},
]


def test_template_renders_and_masks_exactly():
    tokenizer = ByteTokenizer()
    template = ChatTemplate()
    text = template.render(CONVERSATION)
    assert text == (
        "<bos><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello!<eos><|user|>\nBye\n<|assistant|>\nCiao<eos>"
    )
    ids, labels = template.tokenize(CONVERSATION, tokenizer)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert len(ids) == len(labels)
    labelled = [i for i, label in zip(ids, labels) if label != -100]
    assert labelled == [*b"Hello!", 257, *b"Ciao", 257]  # replies and their eos, nothing else
    for i, label in zip(ids, labels):
        assert label in (-100, i)
    # the labelled positions are exactly where the replies sit in the rendered text
    first = ids.index(ord("H"), len(tokenizer.encode("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n")))
    assert labels[first : first + 7] == [*b"Hello!", 257] and labels[first - 1] == -100
    prompt = template.render(CONVERSATION[:2], add_generation_prompt=True)
    assert prompt.endswith("<|user|>\nHi\n<|assistant|>\n")


def test_custom_template_and_role_errors():
    template = ChatTemplate(role_markers={"user": "Q: ", "assistant": "A: "}, turn_end=" | ", add_bos=False)
    assert template.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]) == (
        "Q: x | A: y<eos>"
    )
    with pytest.raises(ValueError, match=r"message 0 has role 'system'.*add it to ChatTemplate.role_markers"):
        template.tokenize(CONVERSATION, ByteTokenizer())
    with pytest.raises(ValueError, match="assistant_role='bot' has no entry"):
        ChatTemplate(assistant_role="bot")


def test_sft_dataset_pads_truncates_and_reads_pairs(tmp_path):
    tokenizer = ByteTokenizer()
    path = tmp_path / "sft.jsonl"
    path.write_text(
        json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"prompt": "2+2?", "response": "4"}) + "\n"
    )
    dataset = SFTDataset(read_documents(path), tokenizer, seq_len=128)
    assert len(dataset) == 2
    item = dataset[1]
    ids, labels = item["input_ids"], item["labels"]
    assert ids.dtype == labels.dtype == torch.int64 and ids.shape == labels.shape == (128,)
    expected, _ = ChatTemplate().tokenize(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], tokenizer
    )
    n = len(expected)
    assert ids[:n].tolist() == expected and (ids[n:] == tokenizer.pad_id).all()
    assert labels[labels != -100].tolist() == [ord("4"), tokenizer.eos_id]
    assert (labels[n:] == -100).all()
    # dict records work directly too, and truncation keeps only what fits
    short = SFTDataset([{"prompt": "p", "response": "a long answer"}], tokenizer, seq_len=30)
    prompt_len = 1 + len("<|user|>\np\n<|assistant|>\n")  # bos + markers + prompt: 26 tokens
    assert short.num_truncated == 1 and short[0]["input_ids"].shape == (30,)
    assert short[0]["labels"][prompt_len:].tolist() == list(b"a lo")  # the reply, cut at seq_len
    assert (short[0]["labels"][:prompt_len] == -100).all()


def test_sft_dataset_errors():
    tokenizer = ByteTokenizer()
    with pytest.raises(ValueError, match="conversation 0 is plain text"):
        SFTDataset(["just text"], tokenizer, seq_len=32)
    with pytest.raises(ValueError, match=r"none of the 1 conversations has an assistant token within seq_len=8"):
        SFTDataset([CONVERSATION], tokenizer, seq_len=8)
    skipped = SFTDataset([CONVERSATION, {"prompt": "p", "response": "r"}], tokenizer, seq_len=30)
    assert len(skipped) == 1 and skipped.num_skipped == 1
