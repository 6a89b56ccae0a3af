"""Packed SFT (several conversations per row, ``packing="documents"``) trains exactly like one conversation per row.

`SFTDataset(..., packing="documents")` bin-packs whole conversations into rows with ``position_ids`` restarting per
conversation; the Llama masks attention per conversation from them. On 2 processes, under DDP and ZeRO-2 with
``loss_weighting="token"`` (the SFT default of run configs), 3 AdamW steps on packed rows give the losses and the
parameters of 3 steps on the same conversations one per padded row.

Tolerances (fp32): losses rtol 1e-5; parameters rtol 1e-5, atol 1e-4. Not bit-identical: the packed batch has fewer,
fuller rows, so the same per-token sums are reduced in another order (matmul blocking, the loss's mean); AdamW
amplifies rounding in near-zero gradient entries to ~1e-5 (see test_booster_hybrid.py), while attending across a
conversation boundary changes the loss at the 1e-3 level.
"""

from __future__ import annotations

import pytest
import torch

from colo.apps.data import ByteTokenizer, SFTDataset, collate
from colo.comm.testing import run_distributed

SEQ_LEN, LR = 96, 1e-2


def conversations(step: int, rank: int) -> list[dict]:
    """Six prompt/response records of 32 to 44 tokens each once templated, for (step, rank): two or three a row."""
    records = []
    for n in range(6):
        value = 97 * step + 13 * rank + 7 * n
        records.append({"prompt": f"{value}+{n}" + "?" * (n % 3), "response": f"{value + n}" + "!" * n})
    return records


def rows(step: int, rank: int, packing: str) -> dict[str, torch.Tensor]:
    dataset = SFTDataset(conversations(step, rank), ByteTokenizer(), seq_len=SEQ_LEN, packing=packing)
    return collate([dataset[i] for i in range(len(dataset))])


def test_packed_sft_rows_hold_whole_conversations_with_restarted_positions():
    unpacked, packed = rows(0, 0, "none"), rows(0, 0, "documents")
    assert set(unpacked) == {"input_ids", "labels"} and unpacked["input_ids"].shape == (6, SEQ_LEN)
    assert set(packed) == {"input_ids", "labels", "position_ids"} and packed["input_ids"].shape[0] < 6
    # the same labelled tokens, and every conversation once: its tokens start where position 0 is
    assert int((packed["labels"] != -100).sum()) == int((unpacked["labels"] != -100).sum())
    starts = packed["position_ids"] == 0
    bos = packed["input_ids"] == ByteTokenizer.bos_id
    assert int(bos.sum()) == 6 and bool((starts | ~bos).all())
    with pytest.raises(ValueError, match="packing='rows' is unknown"):
        SFTDataset(conversations(0, 0), ByteTokenizer(), seq_len=SEQ_LEN, packing="rows")


def _train(plugin_name: str, packing: str):
    from colo.apps import DDP, Booster, Llama, Zero, get_preset

    torch.manual_seed(0)
    model = Llama(get_preset("tiny", vocab_size=320))
    model.init_weights(0)
    plugin = DDP(loss_weighting="token") if plugin_name == "ddp" else Zero(stage=2, loss_weighting="token")
    booster = Booster(plugin)
    booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    rank = torch.distributed.get_rank()
    losses = [booster.train_step(rows(step, rank, packing)).loss for step in range(3)]
    if plugin_name == "ddp":
        params = {
            name.removeprefix("module."): p.detach().clone() for name, p in booster.engine.model.named_parameters()
        }
    else:
        params = booster.engine.optimizer.full_params()
    return losses, params


def _packed_and_unpacked(plugin_name: str):
    return _train(plugin_name, "documents"), _train(plugin_name, "none")


@pytest.mark.parametrize("plugin_name", ["ddp", "zero2"])
def test_packed_sft_trains_like_one_conversation_per_row(plugin_name):
    for (packed_losses, packed), (losses, params) in run_distributed(_packed_and_unpacked, plugin_name, world_size=2):
        assert packed_losses == pytest.approx(losses, rel=1e-5)
        assert packed.keys() == params.keys()
        for name, value in params.items():
            torch.testing.assert_close(packed[name], value, rtol=1e-5, atol=1e-4, msg=name)
