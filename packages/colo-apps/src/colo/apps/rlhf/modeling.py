"""Models for preference training: the pair forward (policy log-probs or rewards) and the reward model.

`attach_pair_forward` replaces a model's ``forward`` *on the instance* (parameter names, plans, optimizers and
checkpoints are untouched, and every plugin calls it as it calls any model) with one that takes the preference
batch's ``(pairs, 2, seq)`` tensors, runs chosen and rejected rows in one forward of ``(2 * pairs, width)``
(``width`` the longest row of the microbatch: padding past it is not computed) and returns per-row quantities:

- ``head="logps"`` (DPO family): ``{"logps": (pairs, 2) sums of log pi over the response tokens, "num_tokens":
  (pairs, 2)}``, from the model's logits (a ``transformers`` causal LM) or, for colo's `Llama`, its ``lm_head``'s
  (under tensor parallelism this rank's vocabulary columns, never gathered), through `colo.apps.rlhf.token_logps`;
  under Ulysses or ring attention (``sp > 1``) the rows come whole and each rank scores its piece of them, the
  per-token values gathered over sp (`colo.apps.rlhf.sequence_logps`);
- ``head="reward"`` (reward model): ``{"rewards": (pairs, 2)}``, the scalar head read at the rightmost token that is
  not ``pad_id``, the rule ``transformers``' ``LlamaForSequenceClassification`` applies (so an exported model scores
  the same).

A native reward model is colo's `Llama` whose ``lm_head`` is a ``hidden -> 1`` linear without bias
(`make_reward_model`); `save_reward_model_as_hf` writes it as ``LlamaForSequenceClassification`` (``num_labels=1``,
``score.weight``, ``pad_token_id``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ..booster.llama_plan import sequence_split_of
from ..data import IGNORE_INDEX
from ..models.llama import Llama
from ..models.llama.loss import shift_labels
from .sequence_logps import split_head_outputs, split_token_logps
from .token_logps import target_logps, vocabulary_split

HEADS = ("logps", "reward")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the sum of ``log softmax(logits)[t, labels[t + 1]]`` over labelled tokens, and their count
    (`colo.apps.rlhf.token_logps.target_logps` of whole logits).

    Args:
        logits (torch.Tensor): ``(rows, seq, vocab)``.
        labels (torch.Tensor): ``(rows, seq)`` aligned with the inputs (position ``t`` predicts ``labels[t + 1]``),
            ``-100`` for no loss.

    Returns:
        ``(logps, num_tokens)``, each ``(rows,)``; logps in fp32.
    """
    targets = labels[:, 1:]
    picked = target_logps(logits[:, :-1], targets, ignore_index=IGNORE_INDEX)
    return picked.sum(-1), (targets != IGNORE_INDEX).sum(-1)


def last_non_pad_index(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The rightmost position of each row holding a token other than ``pad_id`` (0 for an all-pad row), as
    ``transformers``' sequence classifiers find it."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad_id)).argmax(-1)


def _is_sequence_classifier(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def attach_pair_forward(model: nn.Module, *, head: str, pad_id: int) -> nn.Module:
    """Make ``model(input_ids=(pairs, 2, seq), labels=..., lengths=(pairs, 2), ...)`` return the pair outputs
    described in the module docstring; other batch keys (``ref_logps``) are left to the criterion.

    Args:
        model (nn.Module): colo's `Llama` (a reward model from `make_reward_model`), a ``transformers`` causal LM, or
            (``head="reward"``) a ``transformers`` ``...ForSequenceClassification`` with one label.
        head (str): ``"logps"`` or ``"reward"``.
        pad_id (int): the padding token (the reward head reads the rightmost other token).

    Returns:
        nn.Module: ``model``, changed in place.
    """
    if head not in HEADS:
        raise ValueError(f"attach_pair_forward: head={head!r} is unknown; use one of {HEADS}")
    if getattr(model, "_colo_pair_forward", None) is not None:
        raise ValueError(f"attach_pair_forward: {type(model).__name__} already has a pair forward")
    original = model.forward
    native = isinstance(model, Llama)
    classifier = _is_sequence_classifier(model)
    if head == "logps" and classifier:
        raise ValueError("attach_pair_forward: head='logps' needs a causal LM, not a sequence classifier")

    def pair_forward(input_ids, labels=None, lengths=None, **_criterion_inputs):
        if input_ids.dim() != 3 or input_ids.shape[1] != 2:
            raise ValueError(
                f"a preference batch holds (pairs, 2, seq) input_ids (chosen, rejected), got {tuple(input_ids.shape)}"
            )
        pairs, _, seq = input_ids.shape
        width = int(lengths.max()) if lengths is not None else seq
        ids = input_ids.reshape(2 * pairs, seq)[:, :width]
        if native and head == "logps":
            return _native_pair_logps(model, ids, labels, pairs, seq, width)
        split = sequence_split_of(model) if native else None
        if split is not None:  # Ulysses / ring: each rank its piece of the rows, the head's values gathered over sp
            rewards = split_head_outputs(model, split, ids)
            rows = torch.arange(2 * pairs, device=ids.device)
            return {"rewards": rewards[rows, last_non_pad_index(ids, pad_id)].reshape(pairs, 2)}
        if native:
            output = original(ids, return_logits=True)
        else:
            output = original(input_ids=ids, use_cache=False) if not classifier else original(input_ids=ids)
        logits = output.logits
        if head == "logps":
            if labels is None:
                raise ValueError("a DPO batch needs 'labels' (-100 outside the responses)")
            logps, counts = sequence_logps(logits, labels.reshape(2 * pairs, seq)[:, :width])
            return {"logps": logps.reshape(pairs, 2), "num_tokens": counts.reshape(pairs, 2)}
        if classifier:  # transformers pools at the rightmost non-pad token itself
            rewards = logits.reshape(2 * pairs)
        else:
            rows = torch.arange(2 * pairs, device=ids.device)
            rewards = logits[rows, last_non_pad_index(ids, pad_id), 0]
        return {"rewards": rewards.float().reshape(pairs, 2)}

    model.forward = pair_forward
    model._colo_pair_forward = original
    return model


def _native_pair_logps(model: Llama, ids, labels, pairs: int, seq: int, width: int) -> dict:
    """colo's `Llama`: per-token log-probs of the shifted labels (`colo.apps.rlhf.token_logps.target_logps`), under
    tensor parallelism from this rank's vocabulary columns without gathering them."""
    if labels is None:
        raise ValueError("a DPO batch needs 'labels' (-100 outside the responses)")
    objective = model.objective
    split = sequence_split_of(model)
    if split is not None:  # Ulysses / ring: the rows come whole; each rank scores its piece, gathered over sp
        targets = shift_labels(labels.reshape(2 * pairs, seq)[:, :width], objective.ignore_index)
        ignored = targets == objective.ignore_index
        logps, _ = split_token_logps(model, split, ids, first=0, last=width, targets=targets.masked_fill(ignored, 0))
        logps = logps.masked_fill(ignored, 0.0)
        counts = (~ignored).sum(-1)
        return {"logps": logps.sum(-1).reshape(pairs, 2), "num_tokens": counts.reshape(pairs, 2)}
    targets = objective.targets(labels.reshape(2 * pairs, seq)[:, :width])
    group, vocab_size = vocabulary_split(model)
    logits = model.lm_head(model.hidden_states(ids))  # under tp: this rank's vocabulary columns
    token_logps = target_logps(logits, targets, ignore_index=objective.ignore_index, vocab_size=vocab_size, group=group)
    counts = (targets != objective.ignore_index).sum(-1)
    return {"logps": token_logps.sum(-1).reshape(pairs, 2), "num_tokens": counts.reshape(pairs, 2)}


def make_reward_model(model: Llama, *, seed: int = 0) -> Llama:
    """Turn colo's Llama into a reward model in place: ``lm_head`` becomes a ``hidden -> 1`` linear without bias,
    initialized ``normal(0, initializer_range)`` from ``seed`` (as ``transformers`` initializes ``score``).

    Returns:
        Llama: ``model``; its "logits" are ``(rows, seq, 1)`` rewards (read them with `attach_pair_forward`).
    """
    config = model.config
    if config.tie_word_embeddings:
        raise ValueError(
            "make_reward_model: a tied lm_head cannot become the reward head; use tie_word_embeddings=False"
        )
    device = model.embed_tokens.weight.device
    head = nn.Linear(config.hidden_size, 1, bias=False, device=device, dtype=model.embed_tokens.weight.dtype)
    if device.type != "meta":
        _init_reward_head(head, config, seed)
    else:  # a model the plugin materializes shard by shard: the head is drawn from the seed there too
        from ..booster.llama_plan import materialize_fn_of, set_materialize_fn

        if materialize_fn_of(model) is not None:
            set_materialize_fn(model, _RewardHeadThen(materialize_fn_of(model), config, seed))
    model.lm_head = head
    model._colo_reward_model = True
    return model


@torch.no_grad()
def _init_reward_head(head: nn.Linear, config, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * config.initializer_range)


class _RewardHeadThen:
    """A meta-device model's ``init_fn`` (`colo.apps.booster.llama_plan.set_materialize_fn`) for a reward model:
    the scalar head drawn from the seed as `make_reward_model` draws it, every other module by ``init_fn`` (e.g.
    the pretrained weights of ``model.init_from``, whose ``lm_head`` is a vocabulary's, not a scalar head)."""

    def __init__(self, init_fn, config, seed: int) -> None:
        self.init_fn, self.config, self.seed = init_fn, config, seed

    def __call__(self, name: str, module: nn.Module) -> None:
        if name == "lm_head":
            _init_reward_head(module, self.config, self.seed)
        else:
            self.init_fn(name, module)


def save_reward_model_as_hf(model: Llama, directory: str | os.PathLike, *, pad_token_id: int) -> None:
    """Write a reward model from `make_reward_model` as ``transformers.LlamaForSequenceClassification``
    (``num_labels=1``, ``score.weight`` without bias, ``pad_token_id`` set): ``config.json`` + ``model.safetensors``.

    ``transformers`` scores at the rightmost token that is not ``pad_token_id``; colo reads its head there too, so
    the loaded model gives the same rewards.
    """
    from safetensors.torch import save_file

    from ..hf.llama_io import llama_config_to_hf
    from ..models.llama.hf import llama_state_dict_to_hf

    native = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    score = native.pop("lm_head.weight")
    if score.shape[0] != 1:
        raise ValueError(f"save_reward_model_as_hf: lm_head has {score.shape[0]} outputs; make_reward_model first")
    state = llama_state_dict_to_hf({**native, "lm_head.weight": torch.zeros(1)}, model.config)
    state.pop("lm_head.weight", None)
    state["score.weight"] = score
    state = {name: tensor.contiguous().cpu() for name, tensor in state.items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = llama_config_to_hf(model.config, dtype=score.dtype)
    config.update(
        architectures=["LlamaForSequenceClassification"],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        pad_token_id=pad_token_id,
        problem_type="regression",
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
