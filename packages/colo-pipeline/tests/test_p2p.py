"""Stage boundaries: structures flatten and rebuild, metadata survives its byte encoding, batches split."""

from __future__ import annotations

import pytest
import torch

from colo.pipeline.p2p import StageMeta, flatten, split_microbatches, unflatten


@pytest.mark.parametrize(
    "value",
    [
        torch.randn(2, 3),
        (torch.randn(2, 3), torch.arange(4)),
        [torch.randn(1)],
        {"h": torch.randn(2, 3, requires_grad=True), "mask": torch.ones(2, dtype=torch.bool)},
    ],
)
def test_flatten_round_trip_and_metadata_bytes(value):
    tensors, meta = flatten(value)
    rebuilt = unflatten(tensors, meta)
    assert type(rebuilt) is type(value)
    assert StageMeta.from_bytes(meta.to_bytes()) == meta
    if isinstance(value, dict):
        assert list(rebuilt) == ["h", "mask"] and meta.tensors[0].requires_grad and not meta.tensors[1].requires_grad


def test_non_tensors_cannot_cross_a_boundary():
    with pytest.raises(TypeError, match="item 'n' is a int; only tensors cross stage boundaries"):
        flatten({"x": torch.ones(1), "n": 3})


def test_split_into_microbatches():
    pieces = split_microbatches({"ids": torch.arange(8).reshape(4, 2)}, 2, name="inputs")
    assert [p["ids"].tolist() for p in pieces] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(ValueError, match="batch size 6 is not divisible by num_microbatches=4"):
        split_microbatches(torch.ones(6, 2), 4, name="inputs")
