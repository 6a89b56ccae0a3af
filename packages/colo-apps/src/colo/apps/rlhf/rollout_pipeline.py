"""The GRPO / RLOO criterion under a pipeline (``HybridParallel(pp > 1)``): per-token log-probs on the last stage.

Without a pipeline the rollout forward (`colo.apps.rlhf.grpo.attach_rollout_forward`) returns the response tokens'
log-probs and entropies and `GRPOCriterion` turns them into the loss. Under a pipeline the first stage takes the
rollout rows (with the positions and document ids generation used, handed from stage to stage) and the last stage
returns whole-vocabulary logits; `RolloutPipeline` makes the criterion a `colo.apps.booster.PipelineCriterion`:

- ``pipeline_split``: inputs ``{"x": input_ids, "position_ids", "document_ids"}`` (``(R, P + T)``); targets: the
  response tokens ``(R, T)`` and every per-row tensor of the batch (``response_mask``, ``advantages``,
  ``old_logps``, ``ref_logps``), split with the rows into the same microbatches, so each row's advantage and masks
  travel with it. During the SFT warm-up (``criterion.sft``): ``(input_ids, labels)``, the next-token loss.
- ``pipeline_outputs``: ``{"logps", "entropy"}`` of the response tokens from the last stage's logits
  (`colo.apps.rlhf.token_logps.token_logps` at the criterion's ``temperature``, over its ``vocab_limit`` ids): what
  the rollout forward returns.
  A pipelined `Booster.forward` (old log-probs of an off-policy update) and the pipelined frozen reference
  (`Booster.frozen_copy` under pp) return it on every rank.
- ``pipeline_loss``: the criterion on those outputs, per microbatch, on the last stage.

The criterion's statistics and the on-policy update's own log-probs are then held by the last stage's ranks
(`colo.apps.rlhf.pair_pipeline.from_last_stage` hands them to the others).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..models.llama.loss import causal_lm_loss
from .token_logps import token_logps


class RolloutPipeline:
    """Mixin of `GRPOCriterion`: its `PipelineCriterion` methods (module docstring). The subclass holds ``sft``,
    ``temperature`` (the sampling temperature the log-probs are taken at) and ``vocab_limit`` (the ids generation
    samples from; ``None``: every column of the logits)."""

    temperature: float = 1.0
    vocab_limit: int | None = None
    sft: bool = False
    pipeline_shapes_vary = True
    """Rollout rows differ in width (and the SFT warm-up's rows in layout) from step to step."""
    pipeline_row_keys: tuple[str, ...] = ("response_mask", "advantages", "old_logps", "ref_logps")
    """The per-row tensors of a batch that travel with its rows to the last stage (those the batch holds)."""

    def pipeline_split(self, batch: Mapping[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
        """The first stage's inputs and the last stage's targets of a rollout (or, in the SFT warm-up, LM) batch."""
        if self.sft:
            return batch["input_ids"], {"labels": batch["labels"]}
        ids, mask = batch["input_ids"], batch["response_mask"]
        rows, length = ids.shape
        inputs = {"x": ids}
        for name in ("position_ids", "document_ids"):
            if batch.get(name) is not None:
                inputs[name] = batch[name].expand(rows, -1)
        targets = {"tokens": ids[:, length - mask.shape[1] :]}
        targets.update({name: batch[name] for name in self.pipeline_row_keys if batch.get(name) is not None})
        return inputs, targets

    def pipeline_outputs(self, logits: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"logps", "entropy"}`` (``(R, T)``, fp32) of the response tokens from ``(R, P + T, vocab)`` logits."""
        tokens = targets["tokens"]
        scoring = logits[:, -tokens.shape[1] - 1 : -1]  # position j predicts token j + 1
        logps, entropy = token_logps(
            scoring, tokens, temperature=self.temperature or 1.0, vocab_size=self.vocab_limit, entropy=True
        )
        return {"logps": logps, "entropy": entropy}

    def pipeline_loss(self, logits: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One microbatch's share of the update loss on the last stage (the next-token loss in the SFT warm-up)."""
        if self.sft:
            return causal_lm_loss(logits, targets["labels"])
        return self(self.pipeline_outputs(logits, targets), targets)
