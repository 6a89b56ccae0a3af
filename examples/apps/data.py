"""Packed pre-training data on 2 data-parallel ranks: a tokenizer, a corpus, a resumable sampler, DDP steps."""

import torch

from colo.apps import DDP, Booster, Llama, get_preset
from colo.apps.data import (
    PackedDataset,
    ResumableDistributedSampler,
    batches,
    default_corpus,
    load_tokenizer,
    read_documents,
)
from colo.comm import Mesh, launch


def train(num_steps=3):
    mesh = Mesh(dp=2)
    tokenizer = load_tokenizer(None)  # ByteTokenizer (vocab 259); or "path/to/tokenizer.json"
    corpus = read_documents(default_corpus())  # the Python standard library's .py files: on every machine
    dataset = PackedDataset(corpus, tokenizer, seq_len=64, max_tokens=200_000)  # all of it (~12M tokens) in < 1 s
    sampler = ResumableDistributedSampler(
        len(dataset), num_replicas=mesh.size("dp"), rank=mesh.rank("dp"), batch_size=4, seed=0
    )
    model = Llama(get_preset("tiny", vocab_size=tokenizer.vocab_size))
    model.init_weights(0)
    booster = Booster(DDP())
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    stream = batches(dataset, sampler, repeat=True)  # {"input_ids": (4, 64), "labels": (4, 64)}, int64
    losses = [booster.train_step(next(stream)).loss for _ in range(num_steps)]

    state = sampler.state_dict()  # JSON-able; load_state_dict(state) continues at the next sample
    resumed = ResumableDistributedSampler(
        len(dataset), num_replicas=mesh.size("dp"), rank=mesh.rank("dp"), batch_size=4, seed=0
    )
    resumed.load_state_dict(state)
    assert torch.equal(next(batches(dataset, resumed))["input_ids"], next(stream)["input_ids"])
    return losses, state


if __name__ == "__main__":
    (losses, state), (losses_1, _) = launch(train, 2, backend="gloo")  # 2 CPU processes
    assert losses == losses_1, "the loss is the mean over the data-parallel ranks: the same on each"
    print(f"ok: {len(losses)} DDP steps on packed byte windows, loss {losses[-1]:.4f}, sampler state {state}")
