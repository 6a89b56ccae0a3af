"""PPO's criterion under a pipeline (``HybridParallel(pp > 1)``): the actor's and the critic's per-token outputs on
the last stage.

Without a pipeline the PPO forward (`colo.apps.rlhf.critic.attach_ppo_forward`) returns the response tokens'
log-probs and entropies (actor) or values (critic) and `colo.apps.rlhf.ppo.PPOCriterion` turns them into the loss.
Under a pipeline no rank holds the whole model: the first stage takes the rollout rows (with the positions and
document ids generation used) and the last stage returns its head's output over every position, whole-vocabulary
logits for the actor, ``(R, P + T, 1)`` for a separate critic (colo's Llama made a reward model, its scalar head on
the last stage). `PPOPipeline` makes `PPOCriterion` a `colo.apps.booster.PipelineCriterion`, GRPO's cut
(`colo.apps.rlhf.rollout_pipeline.RolloutPipeline`) with PPO's per-row tensors and heads:

- ``pipeline_split``: inputs ``{"x", "position_ids", "document_ids"}``; targets: the response tokens and every
  per-row tensor of the update batch (``response_mask``, ``advantages``, ``old_logps``, ``old_values``,
  ``returns``), split with the rows into the same microbatches;
- ``pipeline_outputs``: the actor's ``{"logps", "entropy"}`` at the criterion's ``temperature`` over its
  ``vocab_limit`` ids (the entropy differentiable, for the bonus), or the critic's ``{"values"}``: the scalar head
  at the position before each response token, as `attach_ppo_forward` reads them. A pipelined `Booster.forward`
  (the experience's old log-probs and old values) and the pipelined frozen reference return them on every rank
  of the pipeline (sent from the last stage), so GAE and the whitening run on whole rows on every rank;
- ``pipeline_loss``: the criterion on those outputs, per microbatch, on the last stage (the clipped policy loss, or
  the clipped value loss).

The value head on the actor's backbone (``ppo.critic: shared``, role ``"actor_critic"``) does not run under a
pipeline: the head sits beside ``lm_head`` on the last stage, which outputs only the logits; `pipeline_split`
refuses it, naming the field and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .rollout_pipeline import RolloutPipeline
from .token_logps import token_logps


class PPOPipeline(RolloutPipeline):
    """Mixin of `colo.apps.rlhf.ppo.PPOCriterion`: its `PipelineCriterion` methods (module docstring). The subclass
    holds ``role``, ``sft``, ``temperature`` and ``vocab_limit``."""

    role: str = "actor"
    vocab_limit: int | None = None
    pipeline_row_keys = ("response_mask", "advantages", "old_logps", "old_values", "returns")

    def pipeline_split(self, batch: Mapping[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
        """The first stage's inputs and the last stage's targets of an update (or SFT warm-up) batch."""
        if self.role == "actor_critic":
            raise ValueError(
                "PPO's value head on the actor's backbone (ppo.critic='shared') does not run under a pipeline (the "
                "last stage outputs only the logits); set ppo.critic='separate' (a critic pipelined as the actor), "
                "or plugin.pp=1"
            )
        return super().pipeline_split(batch)

    def pipeline_outputs(self, logits: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The actor's ``{"logps", "entropy"}`` or the critic's ``{"values"}`` (``(R, T)``, fp32) of the response
        tokens from the last stage's ``(R, P + T, vocab | 1)`` output."""
        tokens = targets["tokens"]
        scoring = logits[:, -tokens.shape[1] - 1 : -1]  # position j scores token j + 1 (the state it is sampled in)
        if self.role == "critic":
            return {"values": scoring[..., 0].float()}
        logps, entropy = token_logps(
            scoring, tokens, temperature=self.temperature or 1.0, vocab_size=self.vocab_limit, entropy=True,
            entropy_grad=True,
        )  # fmt: skip
        return {"logps": logps, "entropy": entropy}
