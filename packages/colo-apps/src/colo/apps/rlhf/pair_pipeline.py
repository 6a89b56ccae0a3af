"""Preference criteria under a pipeline (``HybridParallel(pp > 1)``): the pair outputs on the last stage.

Without a pipeline the pair forward (`colo.apps.rlhf.modeling.attach_pair_forward`) runs chosen and rejected rows in
one forward and returns per-row quantities. Under a pipeline no rank holds the whole model: the first stage takes
the token ids, the last returns the logits (under tensor parallelism gathered over tp: a pipeline's last stage
outputs whole-vocabulary logits). `PairPipeline` makes a pair criterion a `colo.apps.booster.PipelineCriterion`:

- ``pipeline_split``: the ``(pairs, 2, seq)`` rows become ``(2 * pairs, seq)`` inputs, chosen then rejected of each
  pair next to each other, and every other key of the batch (``labels`` flattened the same way, ``ref_logps``,
  ``margin``) goes with the targets. The executor splits both along dim 0 into the same microbatches, so a pair's
  two rows and its reference log-probs always meet in one microbatch (a batch's pairs must divide by the
  microbatches, as any pipeline batch must). Rows keep their full padded length (a pipeline passes the same shapes
  between stages at every microbatch and step).
- ``pipeline_outputs``: the pair forward's output from the last stage's logits: ``{"logps", "num_tokens"}``
  (`colo.apps.rlhf.modeling.sequence_logps`) or ``{"rewards"}`` (the scalar head read at the rightmost non-pad
  token, as `attach_pair_forward` reads it).
- ``pipeline_loss``: the criterion on those outputs, on the last stage, per microbatch (the executor averages the
  microbatch losses, as the microbatch loop does under ``loss_weighting="microbatch"``).

The criterion's statistics are then recorded on the last stage's ranks; `from_last_stage` hands them to every rank
of the pipeline for logging.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .modeling import last_non_pad_index, sequence_logps


class PairPipeline:
    """Mixin of the pair criteria (`RewardCriterion`, `PreferenceCriterion`): their `PipelineCriterion` methods
    (see the module docstring). A subclass sets ``pipeline_head`` (``"logps"`` or ``"reward"``) and, for rewards,
    ``pad_id``."""

    pipeline_head = "logps"
    pad_id: int | None = None

    def pipeline_split(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(input_ids (2 * pairs, seq), targets)`` of a preference batch."""
        ids = batch["input_ids"]
        if ids.dim() != 3 or ids.shape[1] != 2:
            raise ValueError(
                f"a preference batch holds (pairs, 2, seq) input_ids (chosen, rejected), got {tuple(ids.shape)}"
            )
        pairs, _, seq = ids.shape
        rows = ids.reshape(2 * pairs, seq)
        targets = {name: value for name, value in batch.items() if name not in ("input_ids", "labels")}
        if self.pipeline_head == "reward":
            if self.pad_id is None:
                raise ValueError(
                    f"{type(self).__name__}(pad_id=...) is needed under a pipeline: the reward is read at the "
                    "rightmost token that is not pad_id"
                )
            targets["last"] = last_non_pad_index(rows, self.pad_id)
        else:
            if "labels" not in batch:
                raise ValueError("a DPO batch needs 'labels' (-100 outside the responses)")
            targets["labels"] = batch["labels"].reshape(2 * pairs, seq)
        return rows, targets

    def pipeline_outputs(self, logits: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The pair forward's output for one microbatch from the last stage's ``(2 * pairs, seq, vocab | 1)``."""
        if self.pipeline_head == "reward":
            rows = torch.arange(logits.shape[0], device=logits.device)
            return {"rewards": logits[rows, targets["last"], 0].float().reshape(-1, 2)}
        logps, counts = sequence_logps(logits, targets["labels"])
        return {"logps": logps.reshape(-1, 2), "num_tokens": counts.reshape(-1, 2)}

    def pipeline_loss(self, logits: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The criterion's loss of one microbatch, on the last stage."""
        return self(self.pipeline_outputs(logits, targets), targets)


def from_last_stage(metrics: dict[str, float], mesh) -> dict[str, float]:
    """``metrics`` as the pipeline's last stage holds them, on every rank of its ``pp`` group (one all-gather of a
    small dict; every rank calls it). Without a ``pp`` axis of size > 1: ``metrics``."""
    if mesh is None or "pp" not in mesh.axis_names or mesh.size("pp") == 1:
        return metrics
    from colo.comm import all_gather_object

    return all_gather_object(metrics, group=mesh.group("pp"))[-1]
