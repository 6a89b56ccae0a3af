"""`ServingEngine`: continuous batching over a paged KV cache, with per-request sampling, for `colo serve`.

Requests join and leave the running batch between decode steps (Yu et al., 2022, "Orca"); their keys and values
live in a `PagedKVCache` of fixed-size blocks under a fixed budget (Kwon et al., 2023, vLLM). One `step`:

1. applies the control operations queued since the last step (`add_request`, `abort`, `shutdown`; under tensor
   parallelism rank 0's are broadcast first, so every rank schedules identically);
2. admits waiting requests, oldest first, while the batch has room and the free list holds blocks for the whole
   prompt, and prefills them in one forward (prompts of different lengths packed into one row of real tokens, each
   with its own positions, attending within its own row of the cache): each gets its first token;
3. runs one decode forward over every running request (one token each). A request whose next token needs a new
   block when none is free preempts the newest running request (its blocks are freed and it goes back to the
   front of the queue, to be recomputed from its prompt and the tokens it already has), as vLLM's recompute
   preemption does; it may be the request itself.

Prefix caching (``enable_prefix_caching``, on by default): an admitted request shares the cache's blocks that already
hold its leading full blocks of tokens (`PagedKVCache.match_prefix`: a system prompt, a GRPO group's prompt, the
turns before a chat's last one, a preempted request's own tokens) and prefills only the rest, at least its last
token. Its full blocks are named in the forward that writes them, so a request admitted in the same step with the
same prefix shares them too (each layer writes every row's keys before any row reads).

Chunked prefill (``max_tokens_per_step``): the tokens the forwards of one step feed are bounded. The requests
decoding at the start of the step take one token each; what is left goes to prefills, first those cut short in
earlier steps, then newly admitted ones, each fed as many of its prompt tokens as the rest of the budget allows
(it samples its first token once the whole prompt is in the cache, and decodes from the next step on). A long
prompt is thus prefilled over several steps while the running requests keep decoding at every one. Without a
budget a prompt is prefilled in one step and its request decodes in that step too.

Sampling is per request (`RequestParams`): temperature (0 is greedy), top-k then top-p, each request with its own
``torch.Generator`` when it has a seed, so a seeded request draws the same tokens whatever else is in the batch
(and across a preemption: the recompute continues the same generator). A request finishes with ``"stop"`` at an
eos (unless ``ignore_eos``), a ``stop_token_ids`` token or a stop string (the generated tokens are decoded
incrementally, `serving.text.IncrementalText`: each token decodes a window of a few tokens, not the whole output,
and the new text is searched from where the last search could not yet match), with ``"length"`` after
``max_tokens`` tokens, or with ``"abort"``. The tokens that ended a request stay in its output (the stop string is
reported so the server cuts the text before it). With ``RequestParams.logprobs`` each output carries its tokens'
log-probabilities under the model (the log-softmax of the step's logits) and the step's most likely alternatives.

The model is a native `colo.apps.models.llama.Llama` (weight-only quantized ones included); a Hugging Face
``LlamaForCausalLM`` is converted to a native Llama at construction (its weights copied once). Under tensor
parallelism (``group``: the model is already tp-sharded) every rank builds the engine; rank 0 alone calls
`add_request` / `abort` / `shutdown`, samples, and broadcasts each forward's tokens and finish decisions; the
other ranks loop ``while not engine.is_shut_down: engine.step()`` and run the same forwards.

Example::

    engine = ServingEngine(model, tokenizer=tokenizer, max_batch_size=8, block_size=16, num_blocks=256)
    engine.add_request("a", tokenizer.encode("Hello"), RequestParams(max_tokens=32, temperature=0.7, seed=1))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_token_ids, out.finish_reason)
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from ..generation.engine import eval_mode, model_device
from ..generation.paged_cache import PagedKVCache
from ..generation.params import SamplingParams
from ..generation.rollout import is_hf_model
from ..generation.sampling import next_tokens
from ..models.llama import Llama, llama_config_from_hf, llama_state_dict_from_hf
from .text import IncrementalText, find_stop

FINISH_REASONS = ("stop", "length", "abort")
MAX_LOGPROBS = 20
"""The most alternatives `RequestParams.logprobs` may ask for (OpenAI's ``top_logprobs`` limit)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class RequestParams:
    """How one request is continued, validated on construction (the OpenAI completion fields).

    Example::

        RequestParams(max_tokens=64, temperature=0.7, top_p=0.9, stop=("\\n\\n",), seed=7)
    """

    max_tokens: int = 16
    """The most tokens generated (the request finishes with ``"length"`` there)."""
    temperature: float = 1.0
    """Softmax temperature; ``0`` is greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches ``top_p``; ``1.0`` keeps all."""
    top_k: int = 0
    """Sample from the ``top_k`` most likely tokens; ``0`` keeps all."""
    stop: tuple[str, ...] = ()
    """Stop strings: the request finishes with ``"stop"`` once its decoded text contains one (needs a tokenizer)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that finish the request with ``"stop"`` (kept in the output), besides the eos."""
    seed: int | None = None
    """Seed of the request's own sampling generator; ``None``: torch's global generator."""
    ignore_eos: bool = False
    """Keep generating past the eos token (benchmarks)."""
    logprobs: int | None = None
    """Report each generated token's log-probability and those of the ``logprobs`` most likely tokens at its step
    (0: the generated token's alone), from the model's distribution (the log-softmax of its logits, before
    temperature, top-k and top-p); ``None``: none."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"RequestParams: max_tokens={self.max_tokens!r} must be an int >= 1")
        temperature = self.temperature
        if not _is_number(temperature) or not 0 <= temperature < float("inf"):
            raise ValueError(f"RequestParams: temperature={temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"RequestParams: top_p={self.top_p!r} must be in (0, 1] (1.0 keeps every token)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"RequestParams: top_k={self.top_k!r} must be an int >= 0 (0 keeps every token)")
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple):
            raise ValueError(f"RequestParams: stop={self.stop!r} must be a tuple of strings (wrap one in a tuple)")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"RequestParams: stop={self.stop!r} must hold non-empty strings")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"RequestParams: stop_token_ids={self.stop_token_ids!r} must be a tuple of token ids >= 0")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"RequestParams: seed={self.seed!r} must be an int or None")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"RequestParams: ignore_eos={self.ignore_eos!r} must be a bool")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"RequestParams: logprobs={self.logprobs!r} must be an int in [0, {MAX_LOGPROBS}] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sampling(self, vocab_limit: int | None = None) -> SamplingParams:
        """The `SamplingParams` of `colo.apps.generation.sampling.next_tokens` for this request (tokens drawn below
        ``vocab_limit`` when given)."""
        return SamplingParams(
            max_new_tokens=self.max_tokens, temperature=float(self.temperature), top_p=float(self.top_p),
            top_k=self.top_k, vocab_limit=vocab_limit,
        )  # fmt: skip


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely tokens at its step (`RequestParams.logprobs`).

    Attributes:
        token_id: the generated token.
        logprob: its log-probability under the model (the log-softmax of the step's logits).
        top: ``(token_id, logprob)`` of the step's most likely tokens, most likely first (``logprobs`` of them).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class RequestOutput:
    """What one `ServingEngine.step` did for one request.

    Attributes:
        request_id: the request's id.
        new_token_ids: tokens generated in this step (0, 1 or 2: a request admitted in this step gets its prefill
            token and its first decode token).
        finished: whether the request is done (this is its last output).
        finish_reason: ``"stop"`` (eos, a stop token or a stop string), ``"length"`` (``max_tokens``) or
            ``"abort"``; ``None`` while running.
        stop_string: the stop string matched, when one finished the request (the server cuts the text before it).
        prompt_tokens: tokens of the prompt.
        completion_tokens: tokens generated so far, this step's included.
        cached_prompt_tokens: prompt tokens whose keys and values came from the prefix cache (not computed) at
            the request's first admission.
        logprobs: with `RequestParams.logprobs`, one `TokenLogprob` per token of ``new_token_ids``; else ``None``.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    params: RequestParams
    arrival: int
    output: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose keys and values are in the cache
    prefill_end: int = 0  # tokens to prefill since the last admission: prefilling while num_cached < prefill_end
    cached_prompt_tokens: int | None = None  # prompt tokens the prefix cache held at the first admission
    generator: torch.Generator | None = None
    sampling: SamplingParams | None = None
    finish_reason: str | None = None
    stop_string: str | None = None
    text: IncrementalText | None = None  # the decoded output, with stop strings
    text_checked: int = 0  # characters of the decoded output already searched for stop strings

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def _native_model(model: nn.Module) -> nn.Module:
    """``model`` itself when native; a Hugging Face Llama converted to a native `Llama` (weights copied)."""
    if not is_hf_model(model):
        if not hasattr(model, "layers") or not hasattr(model, "hidden_states"):
            raise TypeError(
                f"ServingEngine: model must be a native colo Llama or a Hugging Face LlamaForCausalLM, not "
                f"{type(model).__name__}"
            )
        return model
    if any(not isinstance(m, nn.Linear) and "Quantized" in type(m).__name__ for m in model.modules()):
        raise ValueError(
            "ServingEngine: a quantized Hugging Face model cannot be converted; quantize the native Llama instead "
            "(colo.apps.quant.quantize_model on the model load_llama_from_hf returns)"
        )
    config = llama_config_from_hf(model.config)
    reference = next(model.parameters())
    with torch.device("meta"):
        native = Llama(config)
    native.to_empty(device=reference.device)
    native.to(reference.dtype)
    state = llama_state_dict_from_hf(model.state_dict(), config)
    native.load_state_dict(state)
    native.tie_weights()
    native.rotary_emb.reset_parameters()
    return native.eval()


class ServingEngine:
    """Continuous batching with a paged KV cache (see the module docstring).

    Args:
        model (nn.Module): a native `colo.apps.models.llama.Llama` (tp-sharded under ``group``) or a Hugging Face
            ``LlamaForCausalLM`` (converted to a native Llama).
        tokenizer: a Hugging Face tokenizer, needed for stop strings (and the default eos). Default: ``None``.
        eos_token_id (int | list[int] | None): the eos id(s) that finish a request with ``"stop"``; ``None``: the
            tokenizer's, else none. Default: ``None``.
        max_batch_size (int): the most requests running at once. Default: ``16``.
        block_size (int): tokens per KV block. Default: ``16``.
        kv_cache_bytes (int | None): the KV budget in bytes (this rank's under tp); give this or ``num_blocks``.
        num_blocks (int | None): the KV budget in blocks. Neither given: enough for ``max_batch_size`` requests of
            ``max_model_len`` tokens. Default: ``None``.
        max_model_len (int | None): the most tokens of prompt plus generation; ``None``: the model's
            ``max_position_embeddings``. Default: ``None``.
        vocab_limit (int | None): sample only ids below it (the tokenizer's size when the model's embedding is
            padded past it, as ``SamplingParams.vocab_limit``); ``None``: every row of the output layer. Default:
            ``None``.
        group: the tensor-parallel process group the model is sharded over (``None``: one process).
        enable_prefix_caching (bool): share cached blocks of a prompt's leading full blocks and skip their prefill
            (see the module docstring). Default: ``True``.
        max_tokens_per_step (int | None): the most tokens one step feeds (decode tokens plus prefill chunks); a
            longer prompt is prefilled over several steps. At least ``max_batch_size``; ``None``: no bound (every
            admitted prompt is prefilled whole). Default: ``None``.

    Attributes:
        cache (PagedKVCache): the paged KV cache.
        is_shut_down (bool): set once a `shutdown` has been applied by a `step`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tokenizer=None,
        eos_token_id: int | list[int] | tuple[int, ...] | None = None,
        max_batch_size: int = 16,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        vocab_limit: int | None = None,
        group=None,
        enable_prefix_caching: bool = True,
        max_tokens_per_step: int | None = None,
    ):
        self.model = _native_model(model)
        self.tokenizer = tokenizer
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        if vocab_limit is not None and (not _is_int(vocab_limit) or not 1 <= vocab_limit <= self.vocab_size):
            raise ValueError(
                f"ServingEngine: vocab_limit={vocab_limit!r} must be an int in [1, vocab_size={self.vocab_size}] or "
                "None"
            )
        self.vocab_limit = vocab_limit
        for name, value in (("max_batch_size", max_batch_size), ("block_size", block_size)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"ServingEngine: {name}={value!r} must be an int >= 1")
        window = int(config.max_position_embeddings)
        if max_model_len is None:
            max_model_len = window
        if not _is_int(max_model_len) or not 1 <= max_model_len <= window:
            raise ValueError(
                f"ServingEngine: max_model_len={max_model_len!r} must be an int in [1, max_position_embeddings="
                f"{window}]"
            )
        self.max_batch_size, self.block_size, self.max_model_len = max_batch_size, block_size, max_model_len
        if max_tokens_per_step is not None and (
            not _is_int(max_tokens_per_step) or max_tokens_per_step < max_batch_size
        ):
            raise ValueError(
                f"ServingEngine: max_tokens_per_step={max_tokens_per_step!r} must be an int >= max_batch_size="
                f"{max_batch_size} (every running request decodes one token per step) or None"
            )
        self.max_tokens_per_step = max_tokens_per_step
        self.eos_ids = self._eos_ids(eos_token_id, tokenizer)
        if kv_cache_bytes is not None and num_blocks is not None:
            raise ValueError("ServingEngine: give kv_cache_bytes or num_blocks, not both")
        if kv_cache_bytes is not None:
            if not _is_int(kv_cache_bytes) or kv_cache_bytes < 1:
                raise ValueError(f"ServingEngine: kv_cache_bytes={kv_cache_bytes!r} must be an int >= 1")
            per_block = PagedKVCache.bytes_per_block(self.model, block_size)
            num_blocks = kv_cache_bytes // per_block
            if num_blocks < 1:
                raise ValueError(
                    f"ServingEngine: kv_cache_bytes={kv_cache_bytes} is less than one block ({per_block} bytes at "
                    f"block_size={block_size}); raise it"
                )
        elif num_blocks is None:
            num_blocks = max_batch_size * -(-max_model_len // block_size)
        elif not _is_int(num_blocks) or num_blocks < 1:
            raise ValueError(f"ServingEngine: num_blocks={num_blocks!r} must be an int >= 1")
        self.cache = PagedKVCache.for_model(
            self.model, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching
        )
        self.device = model_device(self.model)
        self.group = group if group is not None and _group_size(group) > 1 else None
        self.rank = _group_rank(group) if self.group is not None else 0
        self.is_shut_down = False
        self.num_preemptions = 0
        """Requests preempted (freed and requeued for recompute) so far."""
        self.num_prefill_tokens = 0
        """Tokens fed by prefill forwards so far (prefix-cached tokens are not fed)."""
        self.num_decode_tokens = 0
        """Tokens fed by decode forwards so far (one per running request per step)."""
        self.num_prefix_cached_tokens = 0
        """Tokens admitted requests took from the prefix cache instead of prefilling them, so far."""
        self._lock = threading.Lock()
        self._ops: list[tuple] = []
        self._active: set[str] = set()  # ids added and not yet reported finished (rank 0)
        self._closing = False
        self._arrivals = itertools.count()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []

    @staticmethod
    def _eos_ids(eos_token_id, tokenizer) -> tuple[int, ...]:
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            return ()
        ids = (eos_token_id,) if _is_int(eos_token_id) else tuple(eos_token_id)
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"ServingEngine: eos_token_id={eos_token_id!r} must be a token id, a list of them or None")
        return ids

    # --- control (rank 0; thread-safe) -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: RequestParams) -> None:
        """Queue a request; it is admitted by a later `step`.

        Raises:
            ValueError: an empty prompt, ids outside the vocabulary, prompt plus ``max_tokens`` over
                ``max_model_len`` or over the whole KV budget, stop strings without a tokenizer, a duplicate id.
            RuntimeError: after `shutdown`, or on a rank other than 0 of a tensor-parallel group.
        """
        self._check_controller("add_request")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"add_request: request_id={request_id!r} must be a non-empty string")
        if not isinstance(params, RequestParams):
            raise TypeError(f"add_request: params must be a RequestParams, not {type(params).__name__}")
        if isinstance(prompt_token_ids, torch.Tensor):
            prompt_token_ids = prompt_token_ids.tolist()
        prompt = list(prompt_token_ids) if isinstance(prompt_token_ids, (list, tuple)) else None
        if not prompt:
            raise ValueError(f"add_request: request {request_id!r} has an empty prompt; give at least one token id")
        if not all(_is_int(t) for t in prompt):
            raise ValueError(f"add_request: request {request_id!r}'s prompt must hold int token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"add_request: request {request_id!r} holds token id {bad[0]} outside the vocabulary [0, "
                f"{self.vocab_size})"
            )
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"add_request: request {request_id!r} has {len(prompt)} prompt tokens + max_tokens="
                f"{params.max_tokens} = {total} > max_model_len={self.max_model_len}; shorten the prompt or lower "
                "max_tokens"
            )
        needed = self.cache.blocks_for(total - 1)  # the last token is never fed back
        if needed > self.cache.num_blocks:
            raise ValueError(
                f"add_request: request {request_id!r} needs {needed} KV blocks of {self.block_size} tokens but the "
                f"cache holds {self.cache.num_blocks}; lower max_tokens or raise kv_cache_bytes / num_blocks"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(f"add_request: request {request_id!r} has stop strings; build the engine with a tokenizer")
        with self._lock:
            if self._closing:
                raise RuntimeError("add_request: the engine is shutting down; no new requests are accepted")
            if request_id in self._active:
                raise ValueError(f"add_request: request_id {request_id!r} is already in use by an unfinished request")
            self._active.add(request_id)
            self._ops.append(("add", request_id, prompt, params))

    def abort(self, request_id: str) -> None:
        """Abort a request: the next `step` reports it finished with ``"abort"`` (unknown or finished ids: nothing)."""
        self._check_controller("abort")
        with self._lock:
            self._ops.append(("abort", request_id))

    def shutdown(self) -> None:
        """Refuse new requests; the next `step` aborts every unfinished one (reported), sets `is_shut_down` on
        every rank, and later steps return ``[]``."""
        self._check_controller("shutdown")
        with self._lock:
            if not self._closing:
                self._closing = True
                self._ops.append(("shutdown",))

    def has_unfinished(self) -> bool:
        """Whether a request is queued, waiting or running, or a shutdown is yet to be applied (rank 0)."""
        with self._lock:
            if self._ops:
                return True
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        """Requests in the running batch (holding KV blocks)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued or waiting for KV blocks or a batch slot (preempted ones included)."""
        with self._lock:
            queued = sum(op[0] == "add" for op in self._ops)
        return queued + len(self._waiting)

    def _check_controller(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(
                f"{what}: only rank 0 of the tensor-parallel group controls the engine; the other ranks loop "
                "`while not engine.is_shut_down: engine.step()`"
            )

    # --- one iteration -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Apply the queued control operations, admit and prefill what the KV budget allows, decode one token for
        every running request. Returns one `RequestOutput` per request that got tokens or finished (rank 0; the
        other ranks get the same list without stop strings decided by them)."""
        if self.is_shut_down:
            return []
        with self._lock:
            ops, self._ops = self._ops, []
        if self.group is not None:
            from colo.comm import broadcast_object

            ops = broadcast_object(ops if self.rank == 0 else None, src=0, group=self.group)
        outputs: dict[str, RequestOutput] = {}
        for op in ops:
            self._apply(op, outputs)
        if self.is_shut_down:
            return self._report(outputs)
        mode = eval_mode(self.model) if self.model.training else contextlib.nullcontext()  # walks every module
        with torch.no_grad(), mode:
            ready = None  # with a budget, only the requests decoding at the start of the step decode in it
            if self.max_tokens_per_step is not None:
                ready = [r for r in self._running if r.num_cached >= r.prefill_end]
            prefills = self._schedule_prefills(len(ready) if ready is not None else 0)
            if prefills:
                self._forward(prefills, outputs=outputs)
            if ready is None:
                ready = [r for r in self._running if r.num_cached >= r.prefill_end]
            decoding = self._reserve_decode_slots(ready)
            if decoding:
                self._forward([(request, 1) for request in decoding], outputs=outputs)
        return self._report(outputs)

    def _apply(self, op: tuple, outputs: dict[str, RequestOutput]) -> None:
        kind = op[0]
        if kind == "add":
            _, request_id, prompt, params = op
            sampling = params.sampling(self.vocab_limit)
            request = _Request(request_id, prompt, params, next(self._arrivals), sampling=sampling)
            if params.seed is not None and not params.greedy and self.rank == 0:
                request.generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self._waiting.append(request)
        elif kind == "abort":
            for queue in (self._waiting, self._running):
                for request in list(queue):
                    if request.request_id == op[1]:
                        queue.remove(request)
                        self._finish(request, "abort", outputs)
        elif kind == "shutdown":
            for request in [*self._running, *self._waiting]:
                self._finish(request, "abort", outputs)
            self._running.clear()
            self._waiting.clear()
            self.is_shut_down = True

    def _schedule_prefills(self, num_decoding: int) -> list[tuple[_Request, int]]:
        """This step's prefill rows ``(request, tokens to feed)``: prefills cut short by the budget first, then
        waiting requests admitted oldest first while the batch has room and the cache has blocks for the whole
        prompt (sharing its cached prefix blocks)."""
        budget = float("inf") if self.max_tokens_per_step is None else self.max_tokens_per_step - num_decoding
        rows = []

        def feed(request: _Request) -> None:
            nonlocal budget
            chunk = min(request.prefill_end - request.num_cached, budget)
            rows.append((request, chunk))
            budget -= chunk
            # named now: a request admitted after it in this step shares the blocks this forward writes
            self.cache.cache_full_blocks(request.request_id, request.tokens, request.num_cached + chunk)

        for request in self._running:
            if request.num_cached < request.prefill_end and budget > 0:
                feed(request)
        while self._waiting and len(self._running) < self.max_batch_size and budget > 0:
            request = self._waiting[0]
            tokens = request.tokens
            prefix = self.cache.match_prefix(tokens)
            if not self.cache.allocate(request.request_id, len(tokens), prefix=prefix):
                break
            self._waiting.popleft()
            request.num_cached = len(prefix) * self.block_size
            request.prefill_end = len(tokens)
            if request.cached_prompt_tokens is None:
                request.cached_prompt_tokens = min(request.num_cached, len(request.prompt))
            self.num_prefix_cached_tokens += request.num_cached
            self._running.append(request)
            feed(request)
        return rows

    def _reserve_decode_slots(self, ready: list[_Request]) -> list[_Request]:
        """Blocks for the next token of every request in ``ready`` still running, preempting the newest running
        request while none is free."""
        decoding = [request for request in ready if request in self._running]
        index = 0
        while index < len(decoding):
            request = decoding[index]
            if self.cache.allocate(request.request_id, request.num_cached + 1):
                index += 1
                continue
            victim = self._running.pop()  # the newest running request (maybe mid-prefill, maybe this one)
            self.cache.free(victim.request_id)
            victim.num_cached = victim.prefill_end = 0
            self._waiting.appendleft(victim)
            self.num_preemptions += 1
            if victim in decoding:
                decoding.remove(victim)
        return decoding

    def _forward(self, rows: list[tuple[_Request, int]], *, outputs: dict[str, RequestOutput]) -> None:
        """One forward feeding each request its next ``n`` uncached tokens (a prefill chunk, or its last token to
        decode); every request whose tokens are then all in the cache gets one new token."""
        requests = [request for request, _ in rows]
        starts = [request.num_cached for request in requests]
        num_new = [n for _, n in rows]
        fed: list[int] = []  # the tokens fed, row after row
        for request, start, new in zip(requests, starts, num_new, strict=True):
            tokens = request.tokens
            fed += tokens[start : start + new]
            self.cache.cache_full_blocks(request.request_id, tokens, start + new)  # decode: the blocks it fills
            if request.num_cached < request.prefill_end:
                self.num_prefill_tokens += new
            else:
                self.num_decode_tokens += new
        # rows of different lengths go in packed (one row of real tokens, no padding through the projections and
        # the MLP); rows of one length (decode steps) as they are
        packed = min(num_new) != max(num_new)
        batch = self.cache.batch([r.request_id for r in requests], starts, num_new, packed=packed)
        ids = torch.tensor(fed, dtype=torch.long).view(1 if packed else len(rows), -1)
        hidden = self.model.hidden_states(ids.to(self.device), batch.position_ids, kv_cache=batch)
        for request, start, new in zip(requests, starts, num_new, strict=True):
            request.num_cached = start + new
        sampled = [row for row, request in enumerate(requests) if request.num_cached >= request.prefill_end]
        if not sampled:
            return
        if packed:  # row i's last token is at accumulate(num_new)[i] - 1
            ends = list(itertools.accumulate(num_new))
            last = hidden[0, torch.tensor([ends[row] - 1 for row in sampled], device=hidden.device)]
        else:
            rows_t = torch.tensor(sampled, device=hidden.device)
            last = hidden[rows_t, torch.tensor([num_new[row] for row in sampled], device=hidden.device) - 1]
        _, logits = self.model.objective(last[:, None], self.model.lm_head)
        logits = logits[:, -1]
        requests = [requests[row] for row in sampled]
        decisions = self._decide(requests, logits) if self.rank == 0 else None
        if self.group is not None:
            from colo.comm import broadcast_object

            decisions = broadcast_object(decisions, src=0, group=self.group)
        for request, (token, reason, stop_string, logprob) in zip(requests, decisions, strict=True):
            request.output.append(token)
            out = self._output(request, outputs)
            out.new_token_ids.append(token)
            if logprob is not None:
                out.logprobs = [*(out.logprobs or []), logprob]
            if reason is not None:
                request.stop_string = stop_string
                self._running.remove(request)
                self._finish(request, reason, outputs)

    def _decide(self, requests: list[_Request], logits: torch.Tensor) -> list[tuple]:
        """Rank 0: each request's next token, whether it finishes (reason, stop string), its `TokenLogprob`."""
        decisions = []
        for row, request in enumerate(requests):
            token, _ = next_tokens(logits[row : row + 1], request.sampling, request.generator)
            token = int(token[0])
            logprob = None
            if request.params.logprobs is not None:
                logprob = self._logprob(logits[row], token, request.params.logprobs)
            decisions.append((token, *self._finish_reason(request, token), logprob))
        return decisions

    def _logprob(self, logits: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
        """``token``'s log-probability at a step and the ``num_top`` most likely tokens' (below ``vocab_limit``)."""
        logprobs = torch.log_softmax(logits[: self.vocab_limit].float(), dim=-1)
        values, ids = logprobs.topk(num_top) if num_top else (logprobs[:0], logprobs[:0].long())
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(token, float(logprobs[token]), top)

    def _finish_reason(self, request: _Request, token: int) -> tuple[str | None, str | None]:
        params = request.params
        if token in self.eos_ids and not params.ignore_eos:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", None
        if params.stop:
            if request.text is None:
                request.text = IncrementalText(partial(self.tokenizer.decode, skip_special_tokens=True))
            request.text.add([token])
            longest = max(len(s) for s in params.stop)
            found = find_stop(request.text.text, params.stop, max(0, request.text_checked - longest + 1))
            request.text_checked = len(request.text.text)
            if found is not None:
                return "stop", found[1]
        if len(request.output) + 1 >= params.max_tokens:
            return "length", None
        return None, None

    def _finish(self, request: _Request, reason: str, outputs: dict[str, RequestOutput]) -> None:
        self.cache.free(request.request_id)
        request.finish_reason = reason
        out = self._output(request, outputs)
        out.finished, out.finish_reason, out.stop_string = True, reason, request.stop_string

    def _output(self, request: _Request, outputs: dict[str, RequestOutput]) -> RequestOutput:
        out = outputs.get(request.request_id)
        if out is None:
            out = outputs[request.request_id] = RequestOutput(
                request.request_id, [], False, None, None, len(request.prompt), 0
            )
        out.completion_tokens = len(request.output)
        out.cached_prompt_tokens = request.cached_prompt_tokens or 0
        return out

    def _report(self, outputs: dict[str, RequestOutput]) -> list[RequestOutput]:
        finished = [request_id for request_id, out in outputs.items() if out.finished]
        if finished:
            with self._lock:
                self._active.difference_update(finished)
        return list(outputs.values())

    # --- convenience -------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: RequestParams | list[RequestParams]) -> list[list[int]]:
        """Add every prompt (one `RequestParams` for all, or one each), step until they finish, return each one's
        generated tokens in prompt order. Rank 0 of an idle engine only."""
        self._check_controller("generate")
        if self.has_unfinished():
            raise RuntimeError("generate: the engine has unfinished requests; drain them with step() first")
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(
                f"generate: {len(per_prompt)} RequestParams for {len(prompts)} prompts; give one or one each"
            )
        ids = [f"generate-{next(self._arrivals)}-{index}" for index in range(len(prompts))]
        for request_id, prompt, request_params in zip(ids, prompts, per_prompt, strict=True):
            self.add_request(request_id, prompt, request_params)
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
        return [tokens[request_id] for request_id in ids]


def _group_size(group) -> int:
    size = getattr(group, "size", None)
    if isinstance(size, int):
        return size
    import torch.distributed as dist

    return dist.get_world_size(group)


def _group_rank(group) -> int:
    rank = getattr(group, "rank", None)
    if isinstance(rank, int):
        return rank
    import torch.distributed as dist

    return dist.get_rank(group)
