"""The resumable distributed sampler: rank shares, epochs, resume mid-epoch, and batches."""

import json

import pytest
import torch

from colo.apps.data import ByteTokenizer, PackedDataset, ResumableDistributedSampler, batches


def _epoch(sampler):
    return [list(batch) for batch in sampler]


@pytest.mark.parametrize("drop_last", [True, False])
def test_rank_shares_are_disjoint_and_cover_the_epoch(drop_last):
    n, replicas, batch_size = 103, 4, 5
    samplers = [
        ResumableDistributedSampler(n, num_replicas=replicas, rank=r, batch_size=batch_size, drop_last=drop_last)
        for r in range(replicas)
    ]
    epochs = [_epoch(s) for s in samplers]
    assert len({len(e) for e in epochs}) == 1 and len(epochs[0]) == len(samplers[0])
    assert all(len(b) == batch_size for e in epochs for b in e)
    taken = [i for e in epochs for b in e for i in b]
    if drop_last:
        assert len(taken) == len(set(taken)) == n - n % (replicas * batch_size)  # disjoint
    else:
        assert set(taken) == set(range(n))  # covering, wrapped around to fill the last global batch
        assert len(taken) == 6 * replicas * batch_size
    # step k's global batch is one contiguous slice of the epoch's permutation, split strided over ranks
    order = samplers[0].permutation(0).tolist()
    for step in range(len(epochs[0]) if drop_last else 0):
        chunk = order[step * replicas * batch_size : (step + 1) * replicas * batch_size]
        assert sorted(i for e in epochs for i in e[step]) == sorted(chunk)
        assert epochs[1][step] == chunk[1::replicas]


def test_each_epoch_has_its_own_permutation():
    sampler = ResumableDistributedSampler(50, batch_size=5, seed=3)
    first, second = _epoch(sampler), _epoch(sampler)
    assert sampler.epoch == 2
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(50))
    again = ResumableDistributedSampler(50, batch_size=5, seed=3)
    assert _epoch(again) == first  # deterministic in (seed, epoch)
    assert _epoch(ResumableDistributedSampler(50, batch_size=5, seed=4)) != first
    assert _epoch(ResumableDistributedSampler(50, batch_size=5, shuffle=False))[0] == [0, 1, 2, 3, 4]


def test_resume_mid_epoch_yields_exactly_the_remaining_batches():
    def make(**kw):
        return ResumableDistributedSampler(97, num_replicas=2, rank=1, batch_size=4, seed=7, **kw)

    reference = make()
    full = _epoch(reference) + _epoch(reference)  # two epochs uninterrupted
    run = make()
    iterator = iter(run)
    consumed = [next(iterator) for _ in range(5)]
    state = json.loads(json.dumps(run.state_dict()))  # JSON-able
    assert state["epoch"] == 0 and state["batches_consumed"] == 5 and state["samples_consumed"] == 40
    resumed = make()
    resumed.load_state_dict(state)
    assert consumed + _epoch(resumed) + _epoch(resumed) == full
    # a state saved right after an epoch's last batch resumes at the next epoch's first
    done = make()
    _ = [b for b, _ in zip(iter(done), range(len(done)))]
    after = make()
    after.load_state_dict(done.state_dict())
    assert _epoch(after) == full[len(reference) :]


def test_resume_with_another_data_parallel_size_and_mismatches():
    saved = ResumableDistributedSampler(64, num_replicas=4, rank=0, batch_size=2, seed=1)
    iterator = iter(saved)
    for _ in range(3):
        next(iterator)  # 3 global batches of 8 = 24 samples
    state = saved.state_dict()
    two = [ResumableDistributedSampler(64, num_replicas=2, rank=r, batch_size=4, seed=1) for r in range(2)]
    for sampler in two:
        sampler.load_state_dict(state)
    rest = sorted(i for s in two for b in _epoch(s) for i in b)
    assert rest == sorted(saved.permutation(0)[24:].tolist())
    with pytest.raises(ValueError, match="not a whole number of global batches of 16"):
        ResumableDistributedSampler(64, num_replicas=2, batch_size=8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="the checkpoint has seed=1, this run seed=2"):
        ResumableDistributedSampler(64, num_replicas=4, batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="rank=2 must be in 0..1"):
        ResumableDistributedSampler(64, num_replicas=2, rank=2, batch_size=2)
    with pytest.raises(ValueError, match="fewer than one global batch of 80"):
        ResumableDistributedSampler(64, num_replicas=4, batch_size=20)


def test_batches_collates_and_tracks_consumption():
    dataset = PackedDataset(["some text to pack " * 20], ByteTokenizer(), seq_len=16)
    sampler = ResumableDistributedSampler(len(dataset), batch_size=3, seed=0)
    stream = batches(dataset, sampler)
    batch = next(stream)
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (3, 16)
    indices = sampler.epoch_batches(0)[0]
    assert torch.equal(batch["input_ids"], torch.stack([dataset[i]["input_ids"] for i in indices]))
    assert sampler.state_dict()["batches_consumed"] == 1
    assert len(list(stream)) == len(sampler) - 1
    endless = batches(dataset, sampler, repeat=True)
    assert len([next(endless) for _ in range(3 * len(sampler))]) == 3 * len(sampler)
