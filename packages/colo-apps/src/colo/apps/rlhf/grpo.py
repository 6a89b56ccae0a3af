"""The training side of GRPO / RLOO: the rollout forward and the criterion `Booster.boost` takes.

`attach_rollout_forward` gives a causal LM a second way to be called, *on the instance* (parameter names, plans,
optimizers and checkpoints are untouched): ``model(input_ids=(R, P + T), response_mask=(R, T), position_ids=...,
document_ids=... | attention_mask=..., <criterion inputs>)`` returns ``{"logps": (R, T), "entropy": (R, T)}``, the
log-probs of the response tokens under ``softmax(logits / temperature)`` over the ids below ``vocab_limit`` (the
tokenizer's ids of a padded vocabulary: the policy generation samples from, `colo.apps.generation.SamplingParams`;
differentiable, fp32) and the policy's entropy at those positions; the model inputs are those of
`colo.apps.generation.rollout_model_inputs`, so the forward sees exactly what generation saw. Called without
``response_mask`` the model behaves as before (generation, eval).

`GRPOCriterion` turns that output and the batch's ``advantages`` (``(R,)``), ``old_logps`` and ``ref_logps``
(``(R, T)``) into this microbatch's share of the update batch's loss (`colo.apps.rlhf.policy_loss`): with the global
counts set by `GRPOCriterion.prepare` the Booster's mean over microbatches and data-parallel ranks gives exactly the
aggregated loss, whatever the layout.

On-policy updates (the first and only optimizer update on a rollout batch) need no separate forward for the old
log-probs: the weights that generated the rollout are the weights the update's forward runs with, so the old
log-probs *are* that forward's log-probs, detached (as TRL and verl do when they make one update per rollout). A
batch without ``old_logps`` is taken as on-policy: the criterion uses ``logps.detach()`` and keeps them
(`GRPOCriterion.take_forward_logps`) for the rollout-vs-trainer mismatch metric. With several updates per rollout
the old log-probs must be recomputed before the first update and passed in ``old_logps``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping

import torch
from torch import nn

from ..booster.llama_plan import sequence_split_of
from ..generation.rollout import (
    can_share_prompts,
    hf_shared_prompt_logits,
    native_shared_prompt_hidden,
    shared_prompt_rows,
)
from ..models.llama import Llama
from .off_policy import truncated_importance_weights
from .packing import pack_rollout_rows, packed_token_logps, packing_budget
from .policy_loss import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    AggregationCounts,
    aggregate_loss,
    clipped_policy_loss,
)
from .rollout_pipeline import RolloutPipeline
from .sequence_logps import split_token_logps
from .token_logps import llama_token_logps, token_logps

_MODEL_INPUTS = ("position_ids", "document_ids", "attention_mask")


def attach_rollout_forward(
    model: nn.Module,
    *,
    temperature: float,
    share_prompts: bool = True,
    pack_rows: bool = False,
    vocab_limit: int | None = None,
) -> nn.Module:
    """Make ``model(input_ids=..., response_mask=..., ...)`` return per-token log-probs and entropies of the
    response (module docstring); every other call is the model's own forward.

    The new forward is a method bound to ``model`` that calls the class's ``forward``, so a ``copy.deepcopy`` of the
    model (a frozen reference) computes with the copy's weights.

    Args:
        model (nn.Module): colo's `Llama` (under tensor parallelism its log-probs and entropies come from this rank's
            vocabulary columns, never gathered: `colo.apps.rlhf.token_logps`; under Ulysses or ring attention the
            rows come whole, each rank computes its piece's and the ``(R, T)`` values are gathered over sp:
            `colo.apps.rlhf.sequence_logps`) or a ``transformers`` causal LM.
        temperature (float): the sampling temperature the log-probs are taken at (0, greedy, is taken as 1).
        share_prompts (bool): run each distinct prompt of the batch once and the responses of its rows over its
            keys and values (`colo.apps.generation.rollout.hf_shared_prompt_logits`, `native_shared_prompt_hidden`)
            when neighbouring rows share their prompt (a GRPO group): the same log-probs as the full forward up to
            rounding, with the prompt's repeated work left out. colo's `Llama` takes it only when nothing is laid
            over its layers; nor does any model with hooks or activation checkpointing (`can_share_prompts`); they,
            and rows that share nothing, take the full forward. Default: ``True``.
        pack_rows (bool): colo's `Llama` runs the rows packed into rows of twice the batch's width, each row's
            segment a document of its own, and the values are scattered back (`colo.apps.rlhf.packing`): no compute
            on padding. The tokens it computes against the padded forward's are counted in ``model.pack_tokens``
            (``[padded, packed]``). Under Ulysses or ring attention each packed row (its length rounded up to the
            layout's chunks) is split over sp as any row is and the values gathered before they are scattered back
            (`colo.apps.rlhf.packing.packed_token_logps`). Default: ``False``.
        vocab_limit (int | None): only ids below it are the policy's classes: the rest of the (padded) vocabulary is
            left out of the softmax, as generation leaves it out of the log-probs it reports
            (`colo.apps.generation.SamplingParams`'s ``vocab_limit``, the tokenizer's size). ``None``: the model's
            whole vocabulary. Default: ``None``.

    Returns:
        nn.Module: ``model``, changed in place.
    """
    if getattr(model, "_colo_rollout_forward", False):
        raise ValueError(f"attach_rollout_forward: {type(model).__name__} already has a rollout forward")
    native = isinstance(model, Llama)
    if pack_rows and not native:
        raise ValueError(
            f"attach_rollout_forward: pack_rows needs colo's Llama (document masks), got {type(model).__name__}; "
            "set grpo.pack_rows=false"
        )
    model.pack_tokens = [0, 0]
    class_forward = type(model).forward

    def rollout_forward(self, input_ids=None, *args, response_mask=None, **kwargs):
        if response_mask is None:
            return class_forward(self, input_ids, *args, **kwargs)
        inputs = {name: kwargs[name] for name in _MODEL_INPUTS if kwargs.get(name) is not None}
        length = response_mask.shape[1]
        prompt = input_ids.shape[1] - length
        if prompt < 1:
            raise ValueError(
                f"a rollout batch holds (R, P + T) input_ids with P >= 1 prompt columns before the {length} response "
                f"columns of response_mask, got input_ids {tuple(input_ids.shape)}"
            )
        if native:  # under tensor parallelism from this rank's vocabulary columns (token_logps)
            inputs.pop("attention_mask", None)
            split = sequence_split_of(self)
            if pack_rows:  # the rows' segments packed, each a document of its own, the values scattered back
                positions = inputs.get("position_ids")
                if positions is None:
                    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
                budget = packing_budget(input_ids.shape[1], split)  # under sp: split into the layout's chunks
                packed = pack_rollout_rows(input_ids, positions.expand_as(input_ids), response_mask, budget=budget)
                self.pack_tokens[0] += packed.padded_tokens
                self.pack_tokens[1] += packed.packed_tokens
                shape = tuple(response_mask.shape)
                logps, entropy = packed_token_logps(
                    self, packed, shape, temperature=temperature, split=split, vocab_limit=vocab_limit
                )
                return {"logps": logps, "entropy": entropy}
            if split is not None:  # Ulysses / ring: this rank's piece of each row, the values gathered over sp
                logps, entropy = split_token_logps(
                    self,
                    split,
                    input_ids,
                    first=prompt - 1,
                    last=input_ids.shape[1] - 1,
                    position_ids=inputs.get("position_ids"),
                    document_ids=inputs.get("document_ids"),
                    temperature=temperature,
                    entropy=True,
                    vocab_limit=vocab_limit,
                )
                return {"logps": logps, "entropy": entropy}
            shared = None
            if share_prompts and "document_ids" in inputs and "position_ids" in inputs and can_share_prompts(self):
                shared = shared_prompt_rows(input_ids, inputs["document_ids"], prompt)
            if shared is not None:  # each distinct prompt's forward once (a GRPO group's rows share it)
                positions, documents = inputs["position_ids"], inputs["document_ids"]
                hidden = native_shared_prompt_hidden(self, input_ids, positions, documents, prompt, shared)
            else:
                hidden = self.hidden_states(
                    input_ids, inputs.get("position_ids"), document_ids=inputs.get("document_ids")
                )[:, prompt - 1 : -1]
            tokens = input_ids[:, prompt:]
            logps, entropy = llama_token_logps(
                self, hidden, tokens, temperature=temperature, entropy=True, vocab_limit=vocab_limit
            )
            return {"logps": logps, "entropy": entropy}
        inputs.pop("document_ids", None)
        shared = None
        if share_prompts and "attention_mask" in inputs and "position_ids" in inputs and can_share_prompts(self):
            shared = shared_prompt_rows(input_ids, inputs["attention_mask"], prompt)
        if shared is not None:  # each distinct prompt's forward once (a GRPO group's rows share it)
            forward = functools.partial(class_forward, self)
            logits = hf_shared_prompt_logits(forward, {"input_ids": input_ids, **inputs}, prompt, shared, self.config)
        else:
            output = class_forward(self, input_ids=input_ids, use_cache=False, logits_to_keep=length + 1, **inputs)
            logits = output.logits[:, :-1]
        logps, entropy = token_logps(
            logits, input_ids[:, prompt:], temperature=temperature, entropy=True, vocab_size=vocab_limit
        )
        return {"logps": logps, "entropy": entropy}

    model.forward = types.MethodType(rollout_forward, model)
    model._colo_rollout_forward = True
    return model


class _TokenMetrics:
    """Token-weighted sums of per-token statistics since the last `take_metrics` (this rank's)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}

    def record(self, mask: torch.Tensor, **per_token: torch.Tensor) -> None:
        mask = mask.detach().double().cpu()
        self._sums["_tokens"] = self._sums.get("_tokens", 0.0) + float(mask.sum())
        for name, values in per_token.items():
            total = float((values.detach().double().cpu() * mask).sum())
            self._sums[name] = self._sums.get(name, 0.0) + total

    def take_metrics(self, group=None) -> dict[str, float]:
        """Means over every response token recorded since the last call on the ranks of ``group`` (one
        all-reduce), then forget them."""
        if not self._sums:
            return {}
        names = sorted(self._sums)
        sums = torch.tensor([self._sums[name] for name in names], dtype=torch.float64)
        if group is not None and group.size > 1:
            from colo.comm import all_reduce

            all_reduce(sums, group=group)
        self._sums = {}
        tokens = max(float(sums[names.index("_tokens")]), 1.0)
        return {name: float(sums[i]) / tokens for i, name in enumerate(names) if name != "_tokens"}


class GRPOCriterion(RolloutPipeline, _TokenMetrics):
    """The clipped policy loss with a KL penalty, aggregated over the update batch (`colo.apps.rlhf.policy_loss`).

    Called as ``criterion(output, microbatch)`` on the output of the rollout forward (`attach_rollout_forward`);
    the microbatch holds ``response_mask`` (``(R, T)``), ``advantages`` (``(R,)``), ``old_logps`` (``(R, T)``; left
    out for an on-policy update: the forward's own log-probs, detached, see the module docstring) and, with a
    reference, ``ref_logps``. Call `prepare` with the update batch's global counts before each
    ``booster.train_step``. Metrics (means over response tokens): ``kl`` (with a reference), ``clip_fraction``,
    ``entropy``, ``ratio``.

    Args:
        loss_aggregation (str): one of `LOSS_AGGREGATIONS`. Default: ``"token-mean"``.
        beta (float): the KL coefficient (0: no KL term; the reference log-probs are still read for the metric).
            Default: ``0.04``.
        kl_estimator (str): ``"k1"``, ``"k2"`` or ``"k3"``. Default: ``"k3"``.
        eps_low (float): lower clip range. Default: ``0.2``.
        eps_high (float | None): upper clip range (``None``: ``eps_low``). Default: ``None``.
        kl_ratio_correction (bool): weight the KL term by the importance ratio (DeepSeek-V3.2; TRL 1.16's
            ``use_bias_correction_kl``). Default: ``False``.
        temperature (float): the sampling temperature; read only under a pipeline, where the last stage takes the
            log-probs from the logits itself (`colo.apps.rlhf.rollout_pipeline`). Default: ``1.0``.
        vocab_limit (int | None): the ids generation samples from (`attach_rollout_forward`'s); read only under a
            pipeline, as ``temperature`` is. Default: ``None``.
        importance_sampling_cap (float): the cap of the behaviour importance weight applied when a microbatch
            carries ``behaviour_logps`` (the sampling policy's log-probs of off-policy rollouts):
            ``min(exp(old - behaviour), cap)`` multiplies the clipped surrogate, ``old`` being the proximal
            log-probs (`colo.apps.rlhf.off_policy`). Default: ``2.0``.
    """

    def __init__(
        self,
        *,
        loss_aggregation: str = "token-mean",
        beta: float = 0.04,
        kl_estimator: str = "k3",
        eps_low: float = 0.2,
        eps_high: float | None = None,
        kl_ratio_correction: bool = False,
        temperature: float = 1.0,
        vocab_limit: int | None = None,
        importance_sampling_cap: float = 2.0,
    ) -> None:
        super().__init__()
        self.temperature, self.vocab_limit = temperature, vocab_limit
        if loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(
                f"GRPOCriterion: loss_aggregation={loss_aggregation!r} is unknown; use one of {LOSS_AGGREGATIONS}"
            )
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"GRPOCriterion: kl_estimator={kl_estimator!r} is unknown; use one of {KL_ESTIMATORS}")
        if beta < 0 or eps_low < 0 or (eps_high is not None and eps_high < 0):
            raise ValueError(f"GRPOCriterion: beta={beta}, eps_low={eps_low}, eps_high={eps_high} must be >= 0")
        self.loss_aggregation, self.beta, self.kl_estimator = loss_aggregation, beta, kl_estimator
        self.eps_low, self.eps_high = eps_low, eps_high
        self.kl_ratio_correction = kl_ratio_correction
        self.importance_sampling_cap = importance_sampling_cap
        self.counts: AggregationCounts | None = None
        self.scale = 1.0
        self._forward_logps: list[torch.Tensor] = []
        self.sft = False
        """While set, the loss is the model's own next-token loss of the batch's ``labels`` (the SFT warm-up a GRPO
        recipe starts with)."""

    def prepare(self, counts: AggregationCounts, *, num_microbatches: int, num_data_ranks: int) -> None:
        """Set the update batch's global counts, and undo the Booster's averaging: it takes the mean of the
        microbatch losses over ``num_microbatches`` and of the gradients over ``num_data_ranks``, while the
        aggregated loss is the *sum* of the microbatch shares."""
        self.counts = counts
        self.scale = float(num_microbatches * num_data_ranks)
        self._forward_logps = []

    def take_forward_logps(self) -> torch.Tensor | None:
        """The ``(R, T)`` log-probs (detached, fp32, 0 where masked) the on-policy update's forwards computed for
        this rank's rows since `prepare` (microbatches in order), or ``None`` when the batch carried ``old_logps``;
        forgotten after the call."""
        pieces, self._forward_logps = self._forward_logps, []
        return torch.cat(pieces) if pieces else None

    def __call__(self, output: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.sft:
            return output.loss
        if self.counts is None:
            raise RuntimeError("GRPOCriterion: call prepare(global_counts(...), ...) before the update")
        logps, mask = output["logps"], batch["response_mask"]
        old_logps = batch.get("old_logps")
        if old_logps is None:  # on-policy: the rollout's weights are this forward's (module docstring)
            old_logps = logps.detach()
            self._forward_logps.append(old_logps * mask.to(old_logps.dtype))
        weights = None
        if batch.get("behaviour_logps") is not None:  # off-policy rollout: old_logps are the proximal log-probs
            weights = truncated_importance_weights(
                old_logps, batch["behaviour_logps"], cap=self.importance_sampling_cap
            )
        terms = clipped_policy_loss(
            logps,
            old_logps,
            batch["advantages"],
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            ref_logps=batch.get("ref_logps"),
            beta=self.beta,
            kl_estimator=self.kl_estimator,
            kl_ratio_correction=self.kl_ratio_correction,
            importance_weights=weights,
        )
        share = aggregate_loss(terms.loss, mask, self.loss_aggregation, self.counts)
        stats = {"clip_fraction": terms.clipped, "entropy": output["entropy"], "ratio": terms.ratio}
        if batch.get("ref_logps") is not None:  # no reference (beta 0): no KL to report
            stats["kl"] = terms.kl
        self.record(mask, **stats)
        return share * self.scale
