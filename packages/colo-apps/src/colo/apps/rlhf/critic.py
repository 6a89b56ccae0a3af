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

Under Ulysses or ring attention (`colo.apps.HybridParallel` ``sp > 1``) colo's `Llama` takes the rows whole, each
rank computes the outputs of its piece of every row and the ``(R, T)`` values are all-gathered over sp
(`colo.apps.rlhf.sequence_logps.split_rollout_outputs`, GRPO's path): every sp rank then holds whole rows, on which
GAE and the losses run unchanged, and the gather's backward sums the ranks' gradients.

Called without ``response_mask`` the model behaves as before (generation, eval).

Heads:

- a separate critic is colo's `Llama` made a reward model (`colo.apps.rlhf.modeling.make_reward_model`: ``lm_head``
  becomes ``hidden -> 1``), so a reward model trained by ``data.task: rm`` can start it, or a ``transformers``
  ``LlamaForSequenceClassification`` with one label (its ``score`` read at every position, not only the last);
- a shared backbone gets a ``value_head`` (``hidden -> 1``, no bias) beside its ``lm_head`` (`add_value_head`; colo's
  `Llama` or a ``transformers`` causal LM).

`critic_from_policy` starts a separate critic from the policy's weights (the frozen reference's) with a fresh scalar
head, under any layout of either (`PolicyWeights`): under `HybridParallel` tensor parallelism the critic is laid out
by its own plan, as the actor is (module docstring of `colo.apps.rlhf.ppo_task`).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from colo.tensor import gather, layout_of

from ..booster.llama_plan import materialize_fn_of, sequence_split_of, set_materialize_fn
from ..booster.plans import find_plan
from ..models.llama import Llama
from .modeling import make_reward_model
from .sequence_logps import split_rollout_outputs
from .token_logps import llama_token_logps, token_logps

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
    std = getattr(config, "initializer_range", 0.02)
    if weight.device.type != "meta":
        _init_value_head(head, std, seed)
    elif materialize_fn_of(model) is not None:  # materialized by the plugin (e.g. from init_from): the head from seed
        set_materialize_fn(model, _ValueHeadThen(materialize_fn_of(model), std, seed))
    model.value_head = head
    return model


@torch.no_grad()
def _init_value_head(head: nn.Linear, std: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)


class _ValueHeadThen:
    """A meta-device model's ``init_fn``: the value head drawn from the seed as `add_value_head` draws it, every
    other module by ``init_fn``."""

    def __init__(self, init_fn, std: float, seed: int) -> None:
        self.init_fn, self.std, self.seed = init_fn, std, seed

    def __call__(self, name: str, module: nn.Module) -> None:
        if name == "value_head":
            _init_value_head(module, self.std, self.seed)
        else:
            self.init_fn(name, module)


class PolicyWeights:
    """``init_fn(name, module)`` that fills module ``name`` of a model with the values of the module of that name
    in ``source``, a model of the same architecture: whole, or laid out tensor-parallel by a plan (each sharded
    tensor all-gathered over its group, `colo.tensor.gather`; a fused q/k/v weight reassembled from its q, k and v
    shards by the plan's checkpoint names). Given to `colo.apps.booster.llama_plan.set_materialize_fn`, it lets the
    plugin materialize a meta-device model module by module, each rank keeping its own shards; neither model is
    ever gathered whole. Every rank must fill the same modules in the same order (the gathers are collectives).

    Args:
        source (nn.Module): the model whose weights are copied (e.g. a frozen reference from `Booster.frozen_copy`).
    """

    def __init__(self, source: nn.Module) -> None:
        self.source = source
        plan = find_plan(source)
        self.names = plan.checkpoint_names(source) if plan is not None else None

    def _pieces(self, name: str, tensor: torch.Tensor) -> list[tuple[str, int, int]] | None:
        """``[(checkpoint name, first row, rows), ...]`` of a whole tensor, or ``None``: itself, by its name."""
        return self.names(name, tensor) if self.names is not None else None

    @torch.no_grad()
    def __call__(self, name: str, module: nn.Module) -> None:
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if not own:
            return
        try:
            source = self.source.get_submodule(name)
        except AttributeError:
            raise ValueError(f"PolicyWeights: the source model has no module {name!r} to copy") from None
        values: dict[str, torch.Tensor] = {}
        for leaf, tensor in [*source.named_parameters(recurse=False), *source.named_buffers(recurse=False)]:
            qualified = f"{name}.{leaf}" if name else leaf
            whole = gather(tensor) if layout_of(tensor) is not None else tensor
            pieces = self._pieces(qualified, whole)
            if pieces is None:
                values[qualified] = whole
            for key, first, rows in pieces or ():
                values[key] = whole.narrow(0, first, rows)
        for leaf, tensor in own:
            qualified = f"{name}.{leaf}" if name else leaf
            keys = [key for key, _, _ in self._pieces(qualified, tensor) or [(qualified, 0, 0)]]
            missing = [key for key in keys if key not in values]
            if missing:
                raise ValueError(f"PolicyWeights: the source model has no tensor {missing[0]!r} for {qualified!r}")
            value = torch.cat([values[key] for key in keys]) if len(keys) > 1 else values[keys[0]]
            if value.shape != tensor.shape:
                raise ValueError(
                    f"PolicyWeights: {qualified} is {tuple(value.shape)} in the source model and "
                    f"{tuple(tensor.shape)} here; give a source of the same architecture"
                )
            tensor.copy_(value)


def critic_from_policy(model: Llama, policy: nn.Module, *, seed: int, device=None) -> Llama:
    """Make ``model`` a separate PPO critic that starts from ``policy``'s weights with a fresh scalar head
    (`colo.apps.rlhf.modeling.make_reward_model` from ``seed``), trainable, with the critic's forward.

    Args:
        model (Llama): a freshly built model of the policy's architecture: whole, or on the meta device for a
            plugin that materializes it (`HybridParallel`: each rank then fills only its shards, module by module,
            from ``policy``, `PolicyWeights`).
        policy (nn.Module): the weights to start from (the frozen reference), whole or laid out tensor-parallel.
        seed (int): the scalar head's seed.
        device: materialize a meta-device ``model`` here, whole (for a plugin that keeps models whole: DDP or ZeRO
            beside a tensor-parallel actor); ``None``: leave it to the plugin. Default: ``None``.

    Returns:
        Llama: ``model``, changed in place.
    """
    weights = PolicyWeights(policy)
    if any(p.is_meta for p in model.parameters()):
        set_materialize_fn(model, weights)
        make_reward_model(model, seed=seed)  # wraps weights: the head from the seed, every other module from policy
        if device is not None:
            init_fn = materialize_fn_of(model)
            model.to_empty(device=device)
            for name, module in model.named_modules():
                init_fn(name, module)
    else:
        make_reward_model(model, seed=seed)
        for name, module in model.named_modules():
            if name != "lm_head":
                weights(name, module)
    model.requires_grad_(True)
    return attach_ppo_forward(model, role="critic")


def _backbone_hidden(model: nn.Module, native: bool, inputs: dict, input_ids: torch.Tensor) -> torch.Tensor:
    if native:
        inputs.pop("attention_mask", None)
        return model.hidden_states(input_ids, inputs.get("position_ids"), document_ids=inputs.get("document_ids"))
    inputs.pop("document_ids", None)
    return model.model(input_ids=input_ids, use_cache=False, **inputs).last_hidden_state


def attach_ppo_forward(
    model: nn.Module, *, role: str, temperature: float = 1.0, vocab_limit: int | None = None
) -> nn.Module:
    """Make ``model(input_ids=..., response_mask=..., ...)`` return the per-token outputs of ``role`` (module
    docstring); every other call is the model's own forward.

    Args:
        model (nn.Module): ``"actor"``: colo's `Llama` (under tensor parallelism its log-probs and entropies come from
            this rank's vocabulary columns, never gathered: `colo.apps.rlhf.token_logps`) or a ``transformers`` causal
            LM; ``"critic"``: colo's `Llama`
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
        split = sequence_split_of(self) if native else None
        if split is not None:  # Ulysses / ring: this rank's piece of each row, the values gathered over sp
            head = self.lm_head if role == "critic" else getattr(self, "value_head", None)
            return split_rollout_outputs(
                self, split, input_ids, first=prompt - 1, last=input_ids.shape[1] - 1,
                position_ids=inputs.get("position_ids"), document_ids=inputs.get("document_ids"),
                temperature=temperature, logps=role != "critic", entropy=True, entropy_grad=True,
                vocab_limit=vocab_limit, value_head=head if role != "actor" else None,
            )  # fmt: skip
        hidden = _backbone_hidden(self, native and not classifier, inputs, input_ids)[:, prompt - 1 : -1]
        result = {}
        if role == "critic":
            head = self.score if classifier else self.lm_head
            result["values"] = head(hidden)[..., 0].float()
            return result
        tokens = input_ids[:, prompt:]
        settings = dict(temperature=temperature, entropy=True, entropy_grad=True)  # (the entropy bonus' gradient)
        if native:  # under tensor parallelism from this rank's vocabulary columns, never gathered
            logps, entropy = llama_token_logps(self, hidden, tokens, vocab_limit=vocab_limit, **settings)
        else:
            logps, entropy = token_logps(self.lm_head(hidden), tokens, vocab_size=vocab_limit, **settings)
        result["logps"], result["entropy"] = logps, entropy
        if role == "actor_critic":
            result["values"] = self.value_head(hidden)[..., 0].float()
        return result

    model.forward = types.MethodType(ppo_forward, model)
    model._colo_rollout_forward = True
    model._colo_ppo_role = role
    return model
