"""Text generation from a trained Llama: load any colo checkpoint into one process, then greedy or nucleus
(top-p, Holtzman et al., 2020) / top-k sampling.

With a KV cache (the default) a prompt that fits the model's window with its new tokens is decoded by the
generation engine (`colo.apps.generation.generate`: one prefill into a static `KVCache`, then one single-token
forward per new token). Past the window the context slides: the last ``max_position_embeddings`` tokens are
re-prefilled for every token. ``use_cache=False`` keeps the reference path that re-runs the model over the whole
(windowed) sequence for every token; both paths pick tokens with the engine's sampler
(`colo.apps.generation.sampling.next_tokens`), so a seeded generator gives the same tokens on either.
"""

from __future__ import annotations

import inspect
import os

import torch

from colo.tensor.checkpoint import load_checkpoint, read_index

from ..generation import SamplingParams
from ..generation import generate as generate_batch
from ..generation.sampling import next_tokens
from ..lora import has_lora_tensors, lora_scaling, merge_lora_tensors
from ..models.llama import KVCache, Llama, LlamaConfig, llama_state_dict_from_hf

RUN_KEY = "run"
"""The checkpoint-metadata key under which the trainer saves the run (its config, the Llama config, the step)."""


def lora_scaling_of(run: dict) -> float:
    """The LoRA scaling (``alpha / r``) of a trainer run's metadata; a `ValueError` when the run had no LoRA."""
    settings = (run.get("config") or {}).get("lora") or {}
    if not settings.get("enabled"):
        raise ValueError("the checkpoint holds LoRA adapters but its run config has no lora section enabled")
    return lora_scaling(settings["r"], settings["alpha"], use_rslora=settings.get("use_rslora", False))


def model_config_of(run: dict) -> LlamaConfig:
    """The model config a trainer run's metadata records: a `MoELlamaConfig` for a mixture-of-experts run (its
    ``llama_config`` holds the MoE fields), else a `LlamaConfig`."""
    fields = run["llama_config"]
    if "num_local_experts" in fields:
        from ..models.moe_llama import MoELlamaConfig

        return MoELlamaConfig(**fields)
    return LlamaConfig(**fields)


def load_llama(checkpoint: str | os.PathLike, *, device: str | torch.device = "cpu") -> tuple[Llama, dict]:
    """A single-process `Llama` holding a trainer checkpoint's weights, whatever layout saved it (the adapters of a
    LoRA run merged into the weights; a `MoELlama` with every expert for a mixture-of-experts run, any ``ep``).

    Args:
        checkpoint: a committed checkpoint directory written by the trainer (`colo.apps.train.Trainer`).
        device: where to build the model.

    Returns:
        ``(model, run)``: the model in eval mode, and the run metadata (``run["config"]`` is the `RunConfig` as a
        dict, ``run["llama_config"]`` the model's shape).

    Raises:
        ValueError: the checkpoint was not written by the trainer (no run metadata).
    """
    path = os.fspath(checkpoint)
    index = read_index(path)
    run = index.metadata.get(RUN_KEY)
    if not isinstance(run, dict) or "llama_config" not in run:
        raise ValueError(
            f"{path} has no '{RUN_KEY}' metadata: it was not written by colo's trainer, so the model shape is unknown"
        )
    config = model_config_of(run)
    if type(config) is not LlamaConfig:  # MoE: the experts' names and layouts are colo.apps.hf.mixtral_io's
        from ..hf.mixtral_io import load_moe_llama_checkpoint

        return load_moe_llama_checkpoint(path, config, device=device), run
    targets = {
        name: torch.empty(entry.shape, dtype=entry.dtype)
        for name, entry in index.tensors.items()
        if not name.startswith("optim/")
    }
    load_checkpoint(path, targets, strict=False)
    if has_lora_tensors(targets):  # a LoRA run: base weights and adapters, merged into plain weights
        targets = merge_lora_tensors(targets, scaling=lora_scaling_of(run))
    state = llama_state_dict_from_hf(targets, config)
    with torch.device(device):
        model = Llama(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"{path} lacks {missing[:3]} ({len(missing)} parameters of the Llama); is it a Llama run?")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name].to(param.dtype))
    model.eval()
    return model, run


@torch.no_grad()
def generate(
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
        raise ValueError("generate: the prompt encodes to no tokens; give a non-empty prompt")
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
        return generate_batch(model, [ids], params, generator=generator).responses()[0]
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


def chat_template_of(run: dict):
    """The `ChatTemplate` a chat run (``data.task='sft'``) trained with, from its checkpoint metadata; ``None``
    for other runs. (Checkpoints written before the metadata held ``chat_template`` name it in their config.)"""
    from ..data import ChatTemplate

    if "chat_template" in run:
        return ChatTemplate(**run["chat_template"])
    data = (run.get("config") or {}).get("data") or {}
    from .task import task_specs

    spec = task_specs().get(data.get("task"))
    if spec is not None and getattr(spec.load(), "chats", False):  # an older checkpoint of a chat run
        return ChatTemplate(**data.get("chat_template", {}))
    return None


def complete(model: Llama, tokenizer, prompt: str, *, chat_template=None, escape_bytes: bool = False, **options) -> str:
    """``prompt`` and its continuation as text: `generate` on the encoded prompt, decoded.

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
        **options: `generate`'s settings (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
            ``generator``, ``use_cache``).
    """
    if chat_template is None:
        ids, shown = tokenizer.encode(prompt), prompt
    else:
        messages = [{"role": "user", "content": prompt}]
        ids, _ = chat_template.tokenize(messages, tokenizer, add_generation_prompt=True)
        shown = chat_template.render(messages, add_generation_prompt=True)
    new = generate(model, ids, vocab_limit=tokenizer.vocab_size, eos_id=tokenizer.eos_id, **options)
    if new and new[-1] == tokenizer.eos_id:
        new = new[:-1]
    if escape_bytes and "errors" in inspect.signature(tokenizer.decode).parameters:
        return shown + tokenizer.decode(new, errors="backslashreplace")
    return shown + tokenizer.decode(new)
