"""Batches from every dataset feed the native Llama as they are: ``model(**batch)`` gives a finite loss."""

import torch

from colo.apps.data import (
    ByteTokenizer,
    PackedDataset,
    ResumableDistributedSampler,
    SFTDataset,
    TokenBudgetDataset,
    batches,
)
from colo.apps.models.llama import Llama, get_preset


def test_batches_feed_the_llama():
    tokenizer = ByteTokenizer()
    torch.manual_seed(0)
    model = Llama(get_preset("tiny", vocab_size=tokenizer.vocab_size))
    model.init_weights(0)
    docs = ["def f(x):\n    return x + 1\n" * 3, "naïve café", "print('hello')\n" * 4]
    datasets = [
        PackedDataset(docs, tokenizer, seq_len=16),
        TokenBudgetDataset(docs, tokenizer, seq_len=32),
        SFTDataset([{"prompt": "2+2?", "response": "4"}] * 2, tokenizer, seq_len=48),
    ]
    for dataset in datasets:
        sampler = ResumableDistributedSampler(len(dataset), batch_size=2, seed=0)
        batch = next(batches(dataset, sampler))
        loss = model(**batch).loss
        assert torch.isfinite(loss), type(dataset).__name__
