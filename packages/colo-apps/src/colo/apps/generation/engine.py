"""`generate`: batched decoding with a static KV cache for the native Llama and the Hugging Face ``LlamaForCausalLM``.

The prompts are left-padded to the longest and prefilled in one forward, each prompt once (not once per sample: its
``n`` rows then get copies of its keys and values and of its last logits), into a cache allocated once for the call
(`colo.apps.models.llama.KVCache`, or transformers' ``StaticCache``); then every step feeds one token per row. The
left padding is masked out of attention (document ids ``-1`` for the native Llama, a 0 in Hugging Face's
``attention_mask``) and positions count from each row's first real token, so a prompt's continuation does not depend
on what else is in the batch. A row stops at its eos (later steps write ``pad_token_id`` and a mask
of 0); the loop ends when every row has stopped or after ``max_new_tokens`` steps, and the response columns are cut
to the steps run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from colo.comm.regions import region

from .params import SamplingParams
from .rollout import Rollout, is_hf_model, padded_document_ids, padded_positions
from .sampling import next_tokens

TokenSync = Callable[[torch.Tensor], torch.Tensor]
"""Called on each step's ``(rows, 2)`` float64 ``[token, logprob]`` pairs before they are used; returns the pairs
every rank must use (tensor-parallel generation broadcasts rank 0's)."""


class _NativeDecoder:
    """Prefill and one-token steps of a `colo.apps.models.llama.Llama` over a `KVCache`."""

    def __init__(self, model: nn.Module, rows: int, max_len: int):
        self.model, self.rows, self.max_len = model, rows, max_len
        self.cache = None
        self.padded = True

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, repeats: int) -> torch.Tensor:
        """The logits after the prompts ``ids`` ``(rows / repeats, prompt)``, each prompt's keys and values then
        repeated ``repeats`` times along the batch (row ``i`` -> rows ``i * repeats ..``); ``(rows, vocab)``."""
        from ..models.llama import KVCache

        self.padded = bool((keys < 0).any())  # no padding anywhere: plain causal attention at every step
        self.cache = KVCache.for_model(self.model, batch_size=self.rows, max_len=self.max_len)
        if repeats == 1:
            return self(ids, positions, keys)
        length = ids.shape[1]
        prompts = KVCache.for_model(self.model, batch_size=ids.shape[0], max_len=length)
        logits = self._logits(ids, positions, keys, prompts)
        for full, once in zip((*self.cache.keys, *self.cache.values), (*prompts.keys, *prompts.values), strict=True):
            full.view(ids.shape[0], repeats, *full.shape[1:])[:, :, :length].copy_(once.unsqueeze(1))
        self.cache.length = length
        return logits.repeat_interleave(repeats, dim=0)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """fp32 ``(rows, vocab)`` logits after ``ids`` ``(rows, seq)`` at ``positions``; ``keys``: the document ids
        (or attention mask) of every cached and new token."""
        return self._logits(ids, positions, keys, self.cache)

    def _logits(self, ids, positions, keys, cache) -> torch.Tensor:
        document_ids = keys if self.padded else None
        hidden = self.model.hidden_states(ids, positions, kv_cache=cache, document_ids=document_ids)
        _, logits = self.model.objective(hidden[:, -1:], self.model.lm_head)
        return logits[:, -1].float()

    def cache_bytes(self) -> int:
        """Bytes of the cache's key and value buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.cache.keys, *self.cache.values))


class _HFDecoder:
    """Prefill and one-token steps of a Hugging Face causal LM over a transformers ``StaticCache``."""

    def __init__(self, model: nn.Module, rows: int, max_len: int):
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, repeats: int) -> torch.Tensor:
        """As `_NativeDecoder.prefill`: the prompts once into a ``DynamicCache``, whose keys and values are then
        written ``repeats`` times each into the static cache (its ``update``, which allocates it)."""
        if repeats == 1:
            return self(ids, positions, keys)
        from transformers import DynamicCache

        once = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids, attention_mask=keys, position_ids=positions, cache=once, use_cache=True, logits_to_keep=1
        )
        for index, layer in enumerate(once.layers):
            self.cache.update(
                layer.keys.repeat_interleave(repeats, dim=0), layer.values.repeat_interleave(repeats, dim=0), index
            )
        return out.logits[:, -1].float().repeat_interleave(repeats, dim=0)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids, attention_mask=keys, position_ids=positions, cache=self.cache, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        return out.logits[:, -1].float()

    def cache_bytes(self) -> int:
        """Bytes of the cache's key and value buffers (allocated at the prefill)."""
        total = 0
        for layer in getattr(self.cache, "layers", []):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total


def _vocab_and_window(model: nn.Module) -> tuple[int, int]:
    config = model.config
    return int(config.vocab_size), int(config.max_position_embeddings)


def _check_prompts(prompts: object, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(
            "generate: prompts must be a non-empty list of token-id lists (one per prompt, unpadded), got "
            f"{type(prompts).__name__}"
        )
    checked = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or not prompt:
            raise ValueError(f"generate: prompts[{index}] is empty or not a list of token ids; give at least one token")
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"generate: prompts[{index}] must hold int token ids")
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"generate: prompts[{index}] holds id {low if low < 0 else high} outside the model's vocabulary "
                f"[0, {vocab_size})"
            )
        checked.append(ids)
    return checked


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in evaluation mode for the duration of the ``with`` block (Hugging Face models turn the KV
    cache off under training with checkpointing), then restore every module's own ``training`` flag.

    Args:
        model (nn.Module): the model to decode with.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters)."""
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _default_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.seed is None or params.greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


FINISHED_CHECK_EVERY = 8
"""Decode steps between two checks whether every row has finished (each check is a host-device sync)."""


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    token_sync: TokenSync | None = None,
    stats: dict | None = None,
) -> Rollout:
    """Continue every prompt ``params.n`` times in one batch, with a static KV cache.

    Args:
        model (nn.Module): a native `colo.apps.models.llama.Llama` (one process, or tensor-parallel: every rank of
            the group calls with the same prompts and generator state) or a Hugging Face ``LlamaForCausalLM``
            (any transformers causal LM that takes ``cache`` / ``attention_mask`` / ``position_ids``).
        prompts (list[list[int]]): the prompts' token ids, unpadded, at least one token each.
        params (SamplingParams): lengths, stop ids, temperature, top-p, top-k, samples per prompt.
        generator (torch.Generator | None): the random generator of sampling; ``None``: one seeded with
            ``params.seed``, or torch's global generator when that is ``None`` too. Default: ``None``.
        token_sync (TokenSync | None): see `TokenSync` (for the hybrid engine); ``None``: none. Default: ``None``.
        stats (dict | None): filled with ``"kv_cache_bytes"`` (the static cache's size) when given. Default:
            ``None``.

    Returns:
        Rollout: ``len(prompts) * params.n`` rows (prompt ``i`` in rows ``i * n .. i * n + n - 1``).

    Raises:
        ValueError: bad prompts (empty, ids outside the vocabulary), or a prompt plus ``max_new_tokens`` longer
            than the model's ``max_position_embeddings``.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"generate: params must be a SamplingParams, not {type(params).__name__}")
    hf = is_hf_model(model)
    vocab_size, window = _vocab_and_window(model)
    prompts = _check_prompts(prompts, vocab_size)
    if params.pad_token_id >= vocab_size or any(e >= vocab_size for e in params.eos_ids):
        raise ValueError(
            f"generate: pad_token_id={params.pad_token_id} / eos_token_id={params.eos_token_id} must be ids in the "
            f"model's vocabulary [0, {vocab_size})"
        )
    prompt_length = max(len(p) for p in prompts)
    if prompt_length + params.max_new_tokens > window:
        raise ValueError(
            f"generate: the longest prompt ({prompt_length} tokens) plus max_new_tokens={params.max_new_tokens} "
            f"exceeds the model's max_position_embeddings={window}; shorten the prompts or lower max_new_tokens"
        )
    device = model_device(model)
    if generator is None:
        generator = _default_generator(params, device)
    n, steps = params.n, params.max_new_tokens
    rows = len(prompts) * n
    total = prompt_length + steps

    padded = torch.full((len(prompts), prompt_length), params.pad_token_id, dtype=torch.long)
    for index, prompt in enumerate(prompts):
        padded[index, prompt_length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
    padding = torch.tensor([prompt_length - len(p) for p in prompts], dtype=torch.long)
    prompt_ids = padded.repeat_interleave(n, dim=0).to(device)
    padding = padding.repeat_interleave(n).to(device)
    positions = padded_positions(padding, total)
    keys = padded_document_ids(padding, total) if not hf else (padded_document_ids(padding, total) + 1)

    responses = torch.full((rows, steps), params.pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, steps, dtype=torch.float32, device=device)
    response_mask = torch.zeros(rows, steps, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    eos = torch.tensor(params.eos_ids, dtype=torch.long, device=device)

    decoder_cls = _HFDecoder if hf else _NativeDecoder
    with eval_mode(model), region(lambda: f"colo.generate {len(prompts)} prompts x {params.n}"):
        decoder = decoder_cls(model, rows, max(prompt_length, total - 1))  # the last token is never fed back
        # each prompt is prefilled once, not n times: its n rows share the keys and values (copied) and the logits
        logits = decoder.prefill(prompt_ids[::n], positions[::n, :prompt_length], keys[::n, :prompt_length], repeats=n)
        if stats is not None:
            stats["kv_cache_bytes"] = decoder.cache_bytes()
        run = 0
        for step in range(steps):
            tokens, token_logprobs = next_tokens(logits, params, generator)
            if token_sync is not None:
                pairs = token_sync(torch.stack([tokens.double(), token_logprobs.double()], dim=1))
                tokens, token_logprobs = pairs[:, 0].long(), pairs[:, 1].float()
            live = ~done
            responses[:, step] = torch.where(live, tokens, params.pad_token_id)
            logprobs[:, step] = torch.where(live, token_logprobs, 0.0)
            response_mask[:, step] = live.long()
            run = step + 1
            if eos.numel():
                done |= live & torch.isin(tokens, eos)
            # reading `done` waits for the device: do it every few steps, not every token (a GPU keeps queueing)
            if step + 1 == steps or ((step + 1) % FINISHED_CHECK_EVERY == 0 and bool(done.all())):
                break
            column = prompt_length + step
            logits = decoder(responses[:, step : step + 1], positions[:, column : column + 1], keys[:, : column + 1])

    # steps decoded after every row had finished (between two checks) hold no live row: drop them. Live rows only
    # ever finish, so the steps with one are a prefix
    run = int(response_mask[:, :run].any(dim=0).sum())
    responses, logprobs, response_mask = responses[:, :run], logprobs[:, :run], response_mask[:, :run]
    prompt_mask = (padded_document_ids(padding, prompt_length) + 1).long()
    return Rollout(
        input_ids=torch.cat([prompt_ids, responses], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
        response_mask=response_mask,
        logprobs=logprobs,
        prompt_length=prompt_length,
        prompt_index=torch.arange(len(prompts), device=device).repeat_interleave(n),
        temperature=float(params.temperature),
    )
