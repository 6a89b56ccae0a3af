"""Choosing the next token from a batch of logits: greedy, or temperature sampling after top-k and top-p filtering,
with the chosen token's log-prob under the unfiltered policy: ``softmax(logits / temperature)`` over the ids below
``SamplingParams.vocab_limit`` (the tokenizer's ids of a padded vocabulary)."""

from __future__ import annotations

import torch

from .params import SamplingParams


def filter_logits(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``scaled`` ``(rows, vocab)`` (logits already divided by the temperature) with every token outside the
    vocabulary limit, the top-k and then the top-p nucleus set to ``-inf`` (a new tensor)."""
    filtered = scaled.clone()
    if params.vocab_limit is not None and params.vocab_limit < filtered.shape[-1]:
        filtered[:, params.vocab_limit :] = float("-inf")
    if 0 < params.top_k < filtered.shape[-1]:
        kth = filtered.topk(params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = filtered.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p  # keeps the prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    return filtered


def next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` ``(rows, vocab)``.

    Args:
        logits (torch.Tensor): the policy's logits at this step (any float dtype; computed on in fp32).
        params (SamplingParams): temperature, top-k, top-p, vocabulary limit.
        generator (torch.Generator | None): the random generator of sampling (``None``: torch's global one).

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(tokens, logprobs)``, both ``(rows,)``: the chosen ids (long) and their
        fp32 log-probs under the policy ``softmax(logits[:, :vocab_limit] / temperature)`` (the whole row without a
        ``vocab_limit``; temperature 1 when greedy): over the ids that can be sampled, before top-k and top-p (filters,
        not the policy: vLLM and verl report the same unfiltered log-probs).
    """
    logits = logits.float()
    policy = logits  # the columns of the policy's ids: the padded ones are never sampled, never counted
    if params.vocab_limit is not None and params.vocab_limit < logits.shape[-1]:
        policy = logits[:, : params.vocab_limit]
    if params.greedy:
        scaled = policy
        tokens = policy.argmax(dim=-1)
    else:
        scaled = logits / params.temperature if params.temperature != 1 else logits
        # drawn over the whole row, the padded columns at probability 0 (`filter_logits`)
        probs = filter_logits(scaled, params).softmax(dim=-1)
        if generator is not None and generator.device != probs.device:
            tokens = torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1)
            tokens = tokens.to(probs.device)
        else:
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        scaled = scaled[:, : policy.shape[-1]]
    logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
