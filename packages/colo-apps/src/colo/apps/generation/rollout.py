"""`Rollout`: what `generate` returns, and the inputs and log-probs of the training forward over it.

Layout of a rollout of ``R`` rows (``n`` samples of each prompt, rows of one prompt contiguous), prompts left-padded
to ``P`` tokens and responses of at most ``T`` tokens::

    input_ids       [pad pad p0 p1 p2 | r0 r1 eos pad pad]     (R, P + T)
    attention_mask  [ 0   0  1  1  1  |  1  1  1   0   0 ]     (R, P + T)
    response_mask                     [  1  1  1   0   0 ]     (R, T)
    logprobs                          [ l0 l1 l2   0   0 ]     (R, T)  log p(r_t | ...) at the sampling temperature

`rollout_model_inputs` gives the training forward exactly what generation saw: positions count from 0 at each
row's first real token, and the left padding is masked out of attention (the native Llama's ``document_ids``: ``-1``
on the padding, ``0`` from the first real token on; Hugging Face's ``attention_mask``). `sequence_logprobs` turns
that forward's logits into the ``(R, T)`` log-probs of the response tokens, which equal ``rollout.logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Rollout:
    """Prompts and their sampled continuations, with masks and per-token log-probs (see the module docstring).

    Attributes:
        input_ids (torch.Tensor): ``(R, P + T)`` long: prompts left-padded to ``P``, then the responses, padded
            after their eos (or the last step) with ``pad_token_id``.
        attention_mask (torch.Tensor): ``(R, P + T)`` long: 1 on real prompt tokens and on response tokens up to
            and including the eos.
        response_mask (torch.Tensor): ``(R, T)`` long: 1 on generated tokens up to and including the eos.
        logprobs (torch.Tensor): ``(R, T)`` float32: log-prob of each sampled token under the policy's
            ``logits / temperature`` (before top-p / top-k; temperature 1 for greedy decoding), 0 where masked.
        prompt_length (int): ``P``.
        prompt_index (torch.Tensor): ``(R,)`` long: the prompt each row continues (row ``r`` -> ``r // n``).
        temperature (float): the sampling temperature (0 for greedy) the log-probs were taken at.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    prompt_length: int
    prompt_index: torch.Tensor
    temperature: float = 1.0

    @property
    def num_rows(self) -> int:
        """``R``: the number of sequences."""
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        """``T``: the response columns (the most tokens any row generated)."""
        return self.input_ids.shape[1] - self.prompt_length

    @property
    def response_ids(self) -> torch.Tensor:
        """``(R, T)``: the response columns of ``input_ids`` (padding included)."""
        return self.input_ids[:, self.prompt_length :]

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated over all rows (the eos included, the padding not)."""
        return int(self.response_mask.sum())

    def responses(self) -> list[list[int]]:
        """The generated ids of every row (the eos included when one was produced), padding dropped."""
        lengths = self.response_mask.sum(dim=1).tolist()
        rows = self.response_ids.tolist()
        return [row[: int(length)] for row, length in zip(rows, lengths, strict=True)]

    def prompts(self) -> list[list[int]]:
        """The prompt ids of every row, padding dropped."""
        mask = self.attention_mask[:, : self.prompt_length].bool()
        return [row[m].tolist() for row, m in zip(self.input_ids[:, : self.prompt_length], mask, strict=True)]

    def to(self, device: torch.device | str) -> Rollout:
        """A copy with every tensor on ``device``."""
        return Rollout(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_mask=self.response_mask.to(device),
            logprobs=self.logprobs.to(device),
            prompt_length=self.prompt_length,
            prompt_index=self.prompt_index.to(device),
            temperature=self.temperature,
        )


def left_padding(attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """``(R,)`` the number of left-padding tokens of each row (zeros of the prompt part of ``attention_mask``)."""
    return prompt_length - attention_mask[:, :prompt_length].sum(dim=1)


def padded_positions(padding: torch.Tensor, length: int) -> torch.Tensor:
    """``(R, length)`` RoPE positions counting from 0 at each row's first real token (0 on the left padding)."""
    columns = torch.arange(length, device=padding.device)
    return (columns[None, :] - padding[:, None]).clamp_(min=0)


def padded_document_ids(padding: torch.Tensor, length: int) -> torch.Tensor:
    """``(R, length)`` document ids for the native Llama: ``-1`` on the left padding, ``0`` from the first real token
    (padding is a document of its own, `colo.kernels.document_mask`)."""
    columns = torch.arange(length, device=padding.device)
    return (columns[None, :] >= padding[:, None]).long() - 1


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` (or the module it wraps) is a Hugging Face ``PreTrainedModel``."""
    seen = model
    for _ in range(8):
        if type(seen).__module__.startswith("transformers.") and hasattr(seen, "config"):
            return True
        inner = getattr(seen, "module", None)
        if not isinstance(inner, nn.Module):
            return False
        seen = inner
    return False


def rollout_model_inputs(rollout: Rollout, *, model: nn.Module | None = None, hf: bool | None = None) -> dict:
    """The keyword inputs of a training forward over ``rollout.input_ids`` that sees exactly what generation saw.

    Positions count from 0 at each row's first real token and go on through the response (the tokens after an eos
    included, as generation fed them); the left padding is masked out of attention. Call ``model(**inputs)``.

    Args:
        rollout (Rollout): the rollout.
        model (nn.Module | None): the model the inputs are for (wrappers with ``.module`` are looked through);
            decides the padding mask's form when ``hf`` is not given. Default: ``None`` (the native Llama).
        hf (bool | None): ``True``: Hugging Face inputs (``input_ids``, ``attention_mask``, ``position_ids``);
            ``False``: the native `colo.apps.models.llama.Llama`'s (``input_ids``, ``position_ids``,
            ``document_ids``). Default: ``None`` (from ``model``).

    Returns:
        dict: the inputs, every tensor ``(R, P + T)`` on the rollout's device.
    """
    if hf is None:
        hf = model is not None and is_hf_model(model)
    length = rollout.input_ids.shape[1]
    padding = left_padding(rollout.attention_mask, rollout.prompt_length)
    inputs = {"input_ids": rollout.input_ids, "position_ids": padded_positions(padding, length)}
    if hf:
        columns = torch.arange(length, device=padding.device)
        inputs["attention_mask"] = (columns[None, :] >= padding[:, None]).long()
    else:
        inputs["document_ids"] = padded_document_ids(padding, length)
    return inputs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of ``tokens`` under ``softmax(logits / temperature)`` in fp32 (temperature 0 taken as 1).

    Args:
        logits (torch.Tensor): ``(..., vocab)``.
        tokens (torch.Tensor): ``(...)`` long ids.
        temperature (float): the sampling temperature.

    Returns:
        torch.Tensor: ``(...)`` float32, differentiable.
    """
    scaled = logits.float()
    if temperature not in (0, 1):
        scaled = scaled / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(logits: torch.Tensor, rollout: Rollout, temperature: float | None = None) -> torch.Tensor:
    """The ``(R, T)`` log-probs of the response tokens from a training forward over ``rollout.input_ids``.

    Position ``P + t - 1`` predicts response token ``t``; masked tokens (after the eos) get 0. The result is
    differentiable (the policy-gradient losses use it) and equals ``rollout.logprobs`` up to floating-point rounding
    when the forward ran on `rollout_model_inputs` with the weights that generated the rollout (a rollout sampled
    with ``SamplingParams.vocab_limit`` took them over the ids below it: pass ``logits[..., :vocab_limit]``).

    Args:
        logits (torch.Tensor): ``(R, P + T, vocab)`` logits of the forward (``(R, T, vocab)`` is also accepted:
            the logits of positions ``P - 1 .. P + T - 2`` only).
        rollout (Rollout): the rollout.
        temperature (float | None): the temperature to score at; ``None``: the rollout's. Default: ``None``.

    Returns:
        torch.Tensor: ``(R, T)`` float32.
    """
    rows, total = rollout.input_ids.shape
    prompt, length = rollout.prompt_length, rollout.response_length
    if logits.dim() != 3 or logits.shape[0] != rows or logits.shape[1] not in (total, length):
        raise ValueError(
            f"sequence_logprobs: logits {tuple(logits.shape)} must be (R, P + T, vocab) = ({rows}, {total}, vocab) "
            f"(or the ({rows}, {length}, vocab) response predictions) for this rollout"
        )
    if logits.shape[1] == total and total != length:
        logits = logits[:, prompt - 1 : total - 1]
    temperature = rollout.temperature if temperature is None else temperature
    logprobs = token_logprobs(logits, rollout.response_ids, temperature)
    return logprobs * rollout.response_mask.to(logprobs.dtype)


def shared_prompt_rows(input_ids: torch.Tensor, keys: torch.Tensor, prompt_length: int) -> torch.Tensor | None:
    """Which rows of a rollout batch repeat the prompt of the row before them (the ``n`` samples of a prompt are
    contiguous): ``(R,)`` long, each row's index among the distinct prompts, or ``None`` when no two neighbouring
    rows share their prompt columns.

    Args:
        input_ids (torch.Tensor): ``(R, P + T)`` ids.
        keys (torch.Tensor): ``(R, >= P)`` what else tells the prompts apart (the attention mask or positions).
        prompt_length (int): ``P``.
    """
    if input_ids.shape[0] < 2:
        return None
    ids, other = input_ids[:, :prompt_length], keys[:, :prompt_length]
    same = (ids[1:] == ids[:-1]).all(dim=1) & (other[1:] == other[:-1]).all(dim=1)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=same.device), ~same])
    inverse = starts.long().cumsum(0) - 1
    if int(inverse[-1]) + 1 == input_ids.shape[0]:
        return None
    return inverse


def hf_shared_prompt_logits(forward, inputs: dict, prompt_length: int, inverse: torch.Tensor, config) -> torch.Tensor:
    """The ``(R, T, vocab)`` logits that predict the response tokens of a rollout batch (positions ``P - 1 ..
    P + T - 2``) from a Hugging Face causal LM, computing each distinct prompt once.

    The distinct prompts run first with a ``DynamicCache`` (their last logits predict the first response token);
    the cache is then indexed out to every row (``inverse``) and the responses run over it. Causal attention makes
    the prompt positions independent of what follows them, so this is the full forward over ``(R, P + T)`` with the
    repeated prompt work left out; it is differentiable (the gradient of a shared prompt sums over its rows).

    Args:
        forward: the model's forward (``input_ids``, ``attention_mask``, ``position_ids``, ``cache``,
            ``use_cache``, ``logits_to_keep``).
        inputs (dict): ``input_ids``, ``attention_mask`` and ``position_ids``, each ``(R, P + T)``.
        prompt_length (int): ``P``.
        inverse (torch.Tensor): `shared_prompt_rows` of the batch.
        config: the model's config (for the cache).
    """
    from transformers import DynamicCache

    ids, mask, positions = inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"]
    firsts = _first_rows(inverse)
    prompt = slice(0, prompt_length)
    cache = DynamicCache(config=config)
    out = forward(
        input_ids=ids[firsts, prompt], attention_mask=mask[firsts, prompt], position_ids=positions[firsts, prompt],
        cache=cache, use_cache=True, logits_to_keep=1,
    )  # fmt: skip
    _check_cached(cache, prompt_length)
    first = out.logits[:, -1:][inverse]
    length = ids.shape[1] - prompt_length
    if length == 1:
        return first
    cache.batch_select_indices(inverse)
    response = slice(prompt_length, prompt_length + length - 1)  # the last token predicts nothing
    out = forward(
        input_ids=ids[:, response], attention_mask=mask[:, : prompt_length + length - 1],
        position_ids=positions[:, response], cache=cache, use_cache=True, logits_to_keep=0,
    )  # fmt: skip
    _check_cached(cache, prompt_length + length - 1)
    return torch.cat([first, out.logits], dim=1)


def _check_cached(cache, length: int) -> None:
    """The model wrote every layer's keys and values (a block that drops its cache would make the responses attend
    to nothing before them)."""
    if not cache.layers or any(int(layer.get_seq_length()) != length for layer in cache.layers):
        raise RuntimeError(
            "shared-prompt forward: the model did not write its keys and values to the cache (a block drops it, e.g. "
            "under gradient checkpointing); attach the rollout forward with share_prompts=False"
        )


def _first_rows(inverse: torch.Tensor) -> torch.Tensor:
    """``(R,)`` bool: the first row of each run of rows sharing a prompt."""
    firsts = torch.ones_like(inverse, dtype=torch.bool)
    firsts[1:] = inverse[1:] != inverse[:-1]
    return firsts


class _PromptCache:
    """What `Llama.hidden_states` takes as a ``kv_cache``, kept differentiable: every layer's keys and values of the
    distinct prompts (their forward), indexed out to the rows (`select`), then each layer's response keys and values
    appended (the second forward). Not a decoding cache: nothing is preallocated or written in place."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def check_input(self, batch: int, seq: int, *, num_layers: int, device: torch.device) -> None:
        if num_layers != len(self.keys):
            raise ValueError(f"shared-prompt forward: {num_layers} layers, but the cache was made for {len(self.keys)}")

    def layer(self, index: int) -> _PromptCacheLayer:
        return _PromptCacheLayer(self, index)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]


class _PromptCacheLayer:
    def __init__(self, cache: _PromptCache, index: int) -> None:
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache, index = self.cache, self.index
        if cache.keys[index] is not None:
            k, v = torch.cat([cache.keys[index], k], dim=1), torch.cat([cache.values[index], v], dim=1)
        cache.keys[index], cache.values[index] = k, v
        return k, v


def can_share_prompts(model: nn.Module) -> bool:
    """Whether the shared-prompt forwards (`hf_shared_prompt_logits`, `native_shared_prompt_hidden`) may run on
    ``model``: nothing is laid over its blocks (no forward hooks, no activation checkpointing, which drops or refuses
    the cache in training) and, for colo's `Llama`, no tensor or sequence parallel projection or attention core."""
    from ..models.llama import AttentionCore, Llama

    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return False
        if getattr(module, "_colo_activation_checkpointing", None) or getattr(module, "gradient_checkpointing", False):
            return False
    if isinstance(model, Llama):
        for layer in model.layers.values():
            attention = layer.self_attn
            if type(attention.qkv_proj) is not nn.Linear or type(attention.core) is not AttentionCore:
                return False
    return True


def native_shared_prompt_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    document_ids: torch.Tensor,
    prompt_length: int,
    inverse: torch.Tensor,
) -> torch.Tensor:
    """colo's Llama (`can_share_prompts`): the ``(R, T, hidden)`` final hidden states that predict the response tokens
    (positions ``P - 1 .. P + T - 2``) of a rollout batch, each distinct prompt computed once (as
    `hf_shared_prompt_logits`: the prompts, then the responses over their keys and values indexed out to the rows;
    differentiable).

    Args:
        model (nn.Module): the `Llama`.
        input_ids, position_ids, document_ids (torch.Tensor): ``(R, P + T)``, as `rollout_model_inputs` gives.
        prompt_length (int): ``P``.
        inverse (torch.Tensor): `shared_prompt_rows` of the batch.
    """
    firsts = _first_rows(inverse)
    prompt = slice(0, prompt_length)
    cache = _PromptCache(len(model.layers))
    hidden = model.hidden_states(
        input_ids[firsts, prompt],
        position_ids[firsts, prompt],
        kv_cache=cache,
        document_ids=document_ids[firsts, prompt],
    )
    first = hidden[:, -1:][inverse]
    length = input_ids.shape[1] - prompt_length
    if length == 1:
        return first
    cache.select(inverse)
    response = slice(prompt_length, prompt_length + length - 1)  # the last token predicts nothing
    hidden = model.hidden_states(
        input_ids[:, response],
        position_ids[:, response],
        kv_cache=cache,
        document_ids=document_ids[:, : prompt_length + length - 1],
    )
    return torch.cat([first, hidden], dim=1)
