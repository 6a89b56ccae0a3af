"""One prompt continued token by token with a sliding context window (`continue_prompt`), and as text
(`complete`): ``colo generate`` and the trainer's final samples.

Greedy or nucleus (top-p, Holtzman et al., 2020) / top-k sampling. With a KV cache (the default) a prompt that fits
the model's window with its new tokens is decoded by the batched engine (`colo.apps.generation.generate`: one
prefill into a static `KVCache`, then one single-token forward per new token). Past the window the context slides:
the last ``max_position_embeddings`` tokens are re-prefilled for every token. ``use_cache=False`` keeps the
reference path that re-runs the model over the whole (windowed) sequence for every token; both paths pick tokens
with the engine's sampler (`colo.apps.generation.sampling.next_tokens`), so a seeded generator gives the same
tokens on either.
"""

from __future__ import annotations

import inspect

import torch

from ..models.llama import KVCache, Llama
from .engine import generate
from .params import SamplingParams
from .sampling import next_tokens


@torch.no_grad()
def continue_prompt(
    model: Llama,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    vocab_limit: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens.

    The context of every new token is the last ``max_position_embeddings`` tokens (a sliding window, positions
    ``0 ..`` from its start). With the cache, the prompt (its last window) is prefilled in one forward into a
    `KVCache` allocated once for the call, then each token costs one single-token forward. When the cache is full
    (prompt + new tokens past ``max_position_embeddings``), the last window is re-prefilled into the reset cache
    (positions restart at 0), exactly the context the uncached path uses; from then on every token is such a
    re-prefill, so past the window generation costs what it costs without the cache.

    Args:
        model: a `Llama` (one process, unsharded).
        prompt_ids: the prompt's token ids (at least one).
        max_new_tokens: how many tokens to add.
        temperature: 0 for greedy decoding, else the softmax temperature.
        top_p: sample from the smallest set of tokens whose probability reaches ``top_p`` (1.0: all).
        top_k: sample from the ``top_k`` most likely tokens (0: all).
        vocab_limit: never produce ids at or above this (the tokenizer's size when the model's vocabulary is padded).
        eos_id: stop after producing this id.
        generator: the random generator of sampling (seed it for reproducible samples).
        use_cache: decode incrementally with a KV cache; ``False`` re-runs the model over the whole window for
            every token (the reference; same tokens up to floating-point rounding).

    Returns:
        The new token ids (the prompt not included).
    """
    if not prompt_ids:
        raise ValueError("continue_prompt: the prompt encodes to no tokens; give a non-empty prompt")
    if max_new_tokens < 1:
        return []
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, eos_token_id=eos_id,
        vocab_limit=vocab_limit,
    )  # fmt: skip
    device = next(model.parameters()).device
    window = model.config.max_position_embeddings
    ids = list(prompt_ids)
    if use_cache and len(ids) + max_new_tokens <= window:  # the engine: one static cache, no sliding
        return generate(model, [ids], params, generator=generator).responses()[0]
    new: list[int] = []
    cache = None
    if use_cache:
        # the last new token is never fed back, so prompt + max_new_tokens - 1 rows would do; one spare is harmless
        cache = KVCache.for_model(model, batch_size=1, max_len=min(window, len(ids) + max_new_tokens))
    pending = ids[-window:]  # the tokens of the context not in the cache yet
    for _ in range(max_new_tokens):
        if cache is None:
            context = torch.tensor([ids[-window:]], device=device)
            logits = model(context, return_logits=True).logits[0, -1].float()
        else:
            if cache.length + len(pending) > cache.max_len:  # only once the window is full: slide it
                cache.reset()
                pending = ids[-window:]
            logits = _next_token_logits(model, torch.tensor([pending], device=device), cache)
        token = int(next_tokens(logits[None], params, generator)[0][0])
        ids.append(token)
        new.append(token)
        pending = [token]
        if eos_id is not None and token == eos_id:
            break
    return new


def _next_token_logits(model: Llama, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """fp32 logits after ``input_ids`` ``(1, seq)`` continuing ``cache``; the head runs on the last position only."""
    hidden = model.hidden_states(input_ids, kv_cache=cache)
    _, logits = model.objective(hidden[:, -1:], model.lm_head)
    return logits[0, -1].float()


def complete(model: Llama, tokenizer, prompt: str, *, chat_template=None, escape_bytes: bool = False, **options) -> str:
    """``prompt`` and its continuation as text: `continue_prompt` on the encoded prompt, decoded.

    With ``chat_template`` (an SFT run's), ``prompt`` is the user's message: the conversation is rendered up to the
    assistant's marker, the reply is generated until the eos token, and the rendered text with the reply is
    returned (the eos itself not shown).

    Args:
        model: the `Llama`.
        tokenizer: the run's tokenizer (``encode`` / ``decode``, ``eos_id``, ``vocab_size``).
        prompt: the text to continue, or the user's message.
        chat_template: a `ChatTemplate`, or ``None`` for plain continuation.
        escape_bytes: show bytes that are not valid UTF-8 as ``\\xNN`` rather than U+FFFD (byte-level tokenizers,
            whose ``decode`` takes ``errors``).
        **options: `continue_prompt`'s settings (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
            ``generator``, ``use_cache``).
    """
    if chat_template is None:
        ids, shown = tokenizer.encode(prompt), prompt
    else:
        messages = [{"role": "user", "content": prompt}]
        ids, _ = chat_template.tokenize(messages, tokenizer, add_generation_prompt=True)
        shown = chat_template.render(messages, add_generation_prompt=True)
    new = continue_prompt(model, ids, vocab_limit=tokenizer.vocab_size, eos_id=tokenizer.eos_id, **options)
    if new and new[-1] == tokenizer.eos_id:
        new = new[:-1]
    if escape_bytes and "errors" in inspect.signature(tokenizer.decode).parameters:
        return shown + tokenizer.decode(new, errors="backslashreplace")
    return shown + tokenizer.decode(new)
