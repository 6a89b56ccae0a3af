"""PPO's models: the critic's value head (on the actor's backbone or on a model of its own) and the forward over a
rollout that gives per-token log-probs, entropies and values.

`attach_ppo_forward` gives a model a second way to be called, *on the instance* (parameter names, plans, optimizers
and checkpoints are untouched; the plugins' module hooks run as for any call): ``model(input_ids=(R, P + T),
response_mask=(R, T), position_ids=..., document_ids=... | attention_mask=...)`` returns, for the response tokens,

- ``role="actor"``: ``{"logps", "entropy"}``: log-probs of the sampled tokens under ``softmax(logits / temperature)``
  and the policy's entropy there, both fp32 and differentiable (the entropy bonus needs its gradient);
- ``role="critic"``: ``{"values"}``: the value head read at the position that predicts each response token (the state
  the token is sampled in, the alignment of the logits), fp32;
- ``role="actor_critic"``: all three from one pass of a shared backbone (`add_value_head`).

Called without ``response_mask`` the model behaves as before (generation, eval).

Heads:

- a separate critic is colo's `Llama` made a reward model (`colo.apps.rlhf.modeling.make_reward_model`: ``lm_head``
  becomes ``hidden -> 1``), so a reward model trained by ``data.task: rm`` can start it, or a ``transformers``
  ``LlamaForSequenceClassification`` with one label (its ``score`` read at every position, not only the last);
- a shared backbone gets a ``value_head`` (``hidden -> 1``, no bias) beside its ``lm_head`` (`add_value_head`; colo's
  `Llama` or a ``transformers`` causal LM).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..generation.rollout import token_logprobs
from ..models.llama import Llama

ROLES = ("actor", "critic", "actor_critic")
_MODEL_INPUTS = ("position_ids", "document_ids", "attention_mask")


def add_value_head(model: nn.Module, *, seed: int = 0) -> nn.Module:
    """Give ``model`` (colo's `Llama` or a ``transformers`` causal LM) a ``value_head``: ``hidden -> 1`` linear
    without bias beside its ``lm_head``, ``normal(0, initializer_range)`` from ``seed`` (the shared-backbone critic).
    """
    if hasattr(model, "value_head"):
        raise ValueError(f"add_value_head: {type(model).__name__} already has a value_head")
    config = model.config
    hidden = config.hidden_size
    weight = model.get_input_embeddings().weight if not isinstance(model, Llama) else model.embed_tokens.weight
    head = nn.Linear(hidden, 1, bias=False, device=weight.device, dtype=weight.dtype)
    if weight.device.type != "meta":
        with torch.no_grad():
            generator = torch.Generator().manual_seed(seed)
            std = getattr(config, "initializer_range", 0.02)
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
    model.value_head = head
    return model


def _backbone_hidden(model: nn.Module, native: bool, inputs: dict, input_ids: torch.Tensor) -> torch.Tensor:
    if native:
        inputs.pop("attention_mask", None)
        return model.hidden_states(input_ids, inputs.get("position_ids"), document_ids=inputs.get("document_ids"))
    inputs.pop("document_ids", None)
    return model.model(input_ids=input_ids, use_cache=False, **inputs).last_hidden_state


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-position entropy of ``softmax(logits / temperature)`` in fp32, differentiable."""
    scaled = logits.float()
    if temperature not in (0, 1):
        scaled = scaled / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def attach_ppo_forward(
    model: nn.Module, *, role: str, temperature: float = 1.0, vocab_limit: int | None = None
) -> nn.Module:
    """Make ``model(input_ids=..., response_mask=..., ...)`` return the per-token outputs of ``role`` (module
    docstring); every other call is the model's own forward.

    Args:
        model (nn.Module): ``"actor"``: colo's `Llama` or a ``transformers`` causal LM; ``"critic"``: colo's `Llama`
            after `make_reward_model` or a ``transformers`` ``...ForSequenceClassification`` with one label;
            ``"actor_critic"``: a causal LM after `add_value_head`.
        role (str): one of `ROLES`.
        temperature (float): the sampling temperature the log-probs are taken at (0 taken as 1).
        vocab_limit (int | None): the ids generation samples from (`colo.apps.generation.SamplingParams`'s
            ``vocab_limit``: a tokenizer smaller than the model's padded vocabulary): log-probs and entropies are
            those of the softmax over them, the distribution the rollout was drawn from. Over the whole padded
            vocabulary the k1 KL reward could be raised without bound by moving mass onto ids that are never
            sampled. ``None``: the whole vocabulary. Default: ``None``.

    Returns:
        nn.Module: ``model``, changed in place.

    Raises:
        ValueError: an unknown role, or a model that cannot play it (named with the fix).
    """
    if role not in ROLES:
        raise ValueError(f"attach_ppo_forward: role={role!r} is unknown; use one of {ROLES}")
    if getattr(model, "_colo_rollout_forward", False):
        raise ValueError(f"attach_ppo_forward: {type(model).__name__} already has a rollout forward")
    native = isinstance(model, Llama)
    classifier = type(model).__name__.endswith("ForSequenceClassification")
    if role == "critic":
        outputs = 1 if classifier else getattr(model.lm_head, "out_features", None) if native else None
        if outputs != 1:
            raise ValueError(
                f"a PPO critic is colo's Llama with a scalar head (make_reward_model) or a transformers "
                f"...ForSequenceClassification with num_labels=1; got {type(model).__name__}"
                + (f" whose lm_head has {outputs} outputs" if native else "")
                + " (ppo.critic='shared' puts the value head on the actor's backbone instead)"
            )
    else:
        if classifier or (native and model.lm_head.out_features == 1):
            raise ValueError(f"attach_ppo_forward: role={role!r} needs a causal LM, got a scalar-headed model")
        if role == "actor_critic" and not isinstance(getattr(model, "value_head", None), nn.Linear):
            raise ValueError("attach_ppo_forward: role='actor_critic' needs add_value_head(model) first")
    class_forward = type(model).forward

    def ppo_forward(self, input_ids=None, *args, response_mask=None, **kwargs):
        if response_mask is None:
            output = class_forward(self, input_ids, *args, **kwargs)
            if role == "actor_critic" and torch.is_grad_enabled() and getattr(output, "loss", None) is not None:
                # an SFT warm-up step trains the lm head only: the value head joins the graph with a zero gradient,
                # as data parallelism needs every trained parameter to get one
                output.loss = output.loss + 0.0 * self.value_head.weight.sum()
            return output
        inputs = {name: kwargs[name] for name in _MODEL_INPUTS if kwargs.get(name) is not None}
        length = response_mask.shape[1]
        prompt = input_ids.shape[1] - length
        if prompt < 1:
            raise ValueError(
                f"a rollout batch holds (R, P + T) input_ids with P >= 1 prompt columns before the {length} response "
                f"columns of response_mask, got input_ids {tuple(input_ids.shape)}"
            )
        hidden = _backbone_hidden(self, native and not classifier, inputs, input_ids)[:, prompt - 1 : -1]
        result = {}
        if role == "critic":
            head = self.score if classifier else self.lm_head
            result["values"] = head(hidden)[..., 0].float()
            return result
        if native:  # the model's objective: under tensor parallelism it gathers the vocabulary-parallel logits
            logits = self.objective(hidden, self.lm_head, None, return_logits=True)[1]
        else:
            logits = self.lm_head(hidden)
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits = logits[..., :vocab_limit]
        result["logps"] = token_logprobs(logits, input_ids[:, prompt:], temperature)
        result["entropy"] = _entropy(logits, temperature)
        if role == "actor_critic":
            result["values"] = self.value_head(hidden)[..., 0].float()
        return result

    model.forward = types.MethodType(ppo_forward, model)
    model._colo_rollout_forward = True
    model._colo_ppo_role = role
    return model
