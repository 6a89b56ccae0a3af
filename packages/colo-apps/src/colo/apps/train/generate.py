"""Text generation from a trained Llama: load any colo checkpoint into one process, then greedy or nucleus
(top-p, Holtzman et al., 2020) sampling.

Without a KV cache: the native Llama has no incremental-decoding path yet, so every new token runs the model over
the whole (windowed) sequence; fine for samples of a few hundred tokens from small models.
"""

from __future__ import annotations

import os

import torch

from colo.tensor.checkpoint import load_checkpoint, read_index

from ..models.llama import Llama, LlamaConfig, llama_state_dict_from_hf

RUN_KEY = "run"
"""The checkpoint-metadata key under which the trainer saves the run (its config, the Llama config, the step)."""


def load_llama(checkpoint: str | os.PathLike, *, device: str | torch.device = "cpu") -> tuple[Llama, dict]:
    """A single-process `Llama` holding a trainer checkpoint's weights, whatever layout saved it.

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
    config = LlamaConfig(**run["llama_config"])
    targets = {
        name: torch.empty(entry.shape, dtype=entry.dtype)
        for name, entry in index.tensors.items()
        if not name.startswith("optim/")
    }
    load_checkpoint(path, targets, strict=False)
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
    vocab_limit: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a `Llama` (one process, unsharded).
        prompt_ids: the prompt's token ids (at least one).
        max_new_tokens: how many tokens to add.
        temperature: 0 for greedy decoding, else the softmax temperature.
        top_p: sample from the smallest set of tokens whose probability reaches ``top_p`` (1.0: all).
        vocab_limit: never produce ids at or above this (the tokenizer's size when the model's vocabulary is padded).
        eos_id: stop after producing this id.
        generator: the random generator of sampling (seed it for reproducible samples).

    Returns:
        The new token ids (the prompt not included).
    """
    if not prompt_ids:
        raise ValueError("generate: the prompt encodes to no tokens; give a non-empty prompt")
    device = next(model.parameters()).device
    window = model.config.max_position_embeddings
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], device=device)
        logits = model(context, return_logits=True).logits[0, -1].float()
        if vocab_limit is not None:
            logits[vocab_limit:] = float("-inf")
        token = _pick(logits, temperature, top_p, generator)
        ids.append(token)
        new.append(token)
        if eos_id is not None and token == eos_id:
            break
    return new


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p  # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
