"""The frozen reference of the DPO family, as log-probs computed once before training.

The reference is the policy's starting point. Rather than keep a second model (and shard it like the policy), colo
runs the policy itself forward (no gradients) over every training pair before the first step and stores the two
sequence log-probs with the data (`WithReferenceLogps`), the way TRL's ``precompute_ref_log_probs`` does; the
trainer saves the table in checkpoints, so a resumed run uses the same reference. Under LoRA the freshly added
adapters are zero (``B = 0``), so this *is* the base model with the adapters disabled, with no copy of it. Works under
every plugin: it is only forwards through the boosted model, the same number on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.utils.data import Dataset

from ..data import collate


@torch.no_grad()
def precompute_reference_logps(
    forward: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
    dataset: Dataset,
    *,
    batch_size: int = 8,
    num_replicas: int = 1,
    rank: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The reference's ``(len(dataset), 2)`` sequence log-probs (chosen, rejected), on every rank.

    Each of ``num_replicas`` ranks computes an equal share of the pairs (the last batches padded by wrapping around,
    so every rank runs the same number of forwards, as ZeRO-3 and tensor parallelism need), then the shares are
    all-gathered.

    Args:
        forward: runs the pair forward on a batch dict (``booster.forward`` of a boosted model whose
            forward is `attach_pair_forward(head="logps")`), or such a model itself (called as ``model(**batch)``).
        dataset (Dataset): `PreferenceDataset` items.
        batch_size (int): pairs per forward. Default: ``8``.
        num_replicas (int): ranks that get different samples. Default: ``1``.
        rank (int): this rank's index among them. Default: ``0``.
        device: where the batches go. Default: ``"cpu"``.
    """
    if isinstance(forward, torch.nn.Module):
        module = forward
        forward = lambda batch: module(**batch)  # noqa: E731
    count = len(dataset)
    per_rank = -(-count // num_replicas)
    mine = [(rank + num_replicas * i) % count for i in range(per_rank)]
    pieces = []
    for start in range(0, per_rank, batch_size):
        batch = collate([dataset[i] for i in mine[start : start + batch_size]])
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        pieces.append(forward(batch)["logps"].detach().float().cpu())
    local = torch.cat(pieces)
    if num_replicas == 1:
        return local[:count]
    from colo.comm import all_gather_object

    table = torch.empty(count, 2)
    # one entry per world rank; ranks that share a sample rank (tensor / sequence parallel) hold the same values
    for sample_rank, values in all_gather_object((rank, local.tolist())):
        for i, pair in enumerate(values):
            table[(sample_rank + num_replicas * i) % count] = torch.tensor(pair)
    return table


class WithReferenceLogps(Dataset):
    """A preference dataset whose items also hold ``"ref_logps"`` (``(2,)``, float32) from a precomputed table."""

    def __init__(self, dataset: Dataset, table: torch.Tensor) -> None:
        if table.shape != (len(dataset), 2):
            raise ValueError(f"reference table {tuple(table.shape)} does not match {len(dataset)} pairs")
        self.dataset, self.table = dataset, table.float()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**self.dataset[index], "ref_logps": self.table[index]}

    def __getattr__(self, name):
        if name in ("dataset", "table"):
            raise AttributeError(name)
        return getattr(self.dataset, name)
