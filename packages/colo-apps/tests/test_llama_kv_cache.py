"""Incremental decoding with a `KVCache` computes what the full forward computes, and `continue_prompt` with the cache
produces the tokens of the full-recompute reference.

- Logits: a prompt prefilled into the cache, then one token (and once a chunk of three) at a time, gives at every
  position the logits of one full forward over the whole sequence, for multi-head, grouped-query and multi-query
  attention and a batch of three, in fp32 on the torch kernels and on the Triton kernels (Triton's interpreter on
  CPU). Tolerance atol=rtol=1e-5, not zero: a query attends over ``length + seq`` keys instead of the full
  sequence's masked row, and the projections multiply matrices of other heights, so sums run in other orders
  (observed on CPU: within 2.4e-6 of logits with std 0.8, under a fifth of the tolerance).
- ``continue_prompt(use_cache=True)`` equals ``continue_prompt(use_cache=False)`` token for token, greedy and seeded
  top-p, also when prompt + new tokens pass ``max_position_embeddings`` (the window slides) and when the prompt alone
  does; the cached path really prefills once and then feeds one token per forward.
- A cache that does not fit the input fails with a message naming what to change.
"""

from __future__ import annotations

import pytest
import torch

from colo.apps.generation import continue_prompt
from colo.apps.models.llama import KVCache, Llama, get_preset
from colo.kernels import use_backend

SEED = 1234
LOGITS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _model(num_key_value_heads: int = 2, **overrides) -> Llama:
    """The "tiny" Llama (4 query heads of 16) in fp32, weights drawn with std 0.1 so logits are not flat."""
    config = get_preset("tiny", num_key_value_heads=num_key_value_heads, initializer_range=0.1, **overrides)
    torch.manual_seed(SEED)
    model = Llama(config)
    model.init_weights(SEED)
    return model.eval()


def _tokens(batch: int, seq: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _incremental_logits(model: Llama, ids: torch.Tensor, *, prompt_len: int, chunk_at: int) -> torch.Tensor:
    """Logits of ``ids`` decoded with a cache: prefill ``prompt_len``, one token at a time, one chunk of three."""
    cache = KVCache.for_model(model, batch_size=ids.shape[0], max_len=ids.shape[1])
    pieces, start = [], 0
    while start < ids.shape[1]:
        stop = prompt_len if start == 0 else start + (3 if start == chunk_at else 1)
        pieces.append(model(ids[:, start:stop], kv_cache=cache).logits)
        start = stop
    assert cache.length == ids.shape[1]
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("num_key_value_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_cached_decoding_matches_full_forward(num_key_value_heads):
    model = _model(num_key_value_heads)
    ids = _tokens(3, 20)
    with torch.no_grad():
        full = model(ids).logits
        incremental = _incremental_logits(model, ids, prompt_len=7, chunk_at=12)
    torch.testing.assert_close(incremental, full, **LOGITS_TOLERANCE)


def test_cached_decoding_matches_full_forward_on_triton_kernels():
    model = _model(2)
    ids = _tokens(2, 9)
    with torch.no_grad(), use_backend("triton"):
        full = model(ids).logits
        incremental = _incremental_logits(model, ids, prompt_len=4, chunk_at=5)
    torch.testing.assert_close(incremental, full, **LOGITS_TOLERANCE)


def test_reset_cache_decodes_a_new_prompt_like_a_fresh_cache():
    model = _model()
    first, second = _tokens(1, 6, seed=1), _tokens(1, 6, seed=2)
    cache = KVCache.for_model(model, max_len=8)
    with torch.no_grad():
        model(first, kv_cache=cache)
        cache.reset()
        reused = model(second, kv_cache=cache).logits
        fresh = model(second, kv_cache=KVCache.for_model(model, max_len=8)).logits
    torch.testing.assert_close(reused, fresh, rtol=0, atol=0)


def test_cache_takes_the_model_dtype_and_heads():
    model = _model(1).to(torch.bfloat16)
    cache = KVCache.for_model(model, batch_size=2)
    assert cache.keys[0].shape == (2, 128, 1, 16) and cache.keys[0].dtype == torch.bfloat16
    assert len(cache.keys) == len(cache.values) == 2 and cache.max_len == model.config.max_position_embeddings


def _forward_lengths(model: Llama) -> list[int]:
    """Record the sequence length of every forward (a hook on the embedding)."""
    lengths: list[int] = []
    model.embed_tokens.register_forward_hook(lambda module, args, output: lengths.append(args[0].shape[1]))
    return lengths


@pytest.mark.parametrize(
    ("prompt_len", "max_new_tokens", "window"),
    [(10, 30, 128), (10, 20, 16), (20, 6, 16)],
    ids=["within-window", "window-slides", "prompt-past-window"],
)
def test_greedy_generate_with_cache_equals_full_recompute(prompt_len, max_new_tokens, window):
    model = _model(max_position_embeddings=window)
    prompt = _tokens(1, prompt_len, seed=3)[0].tolist()
    reference = continue_prompt(model, prompt, max_new_tokens=max_new_tokens, use_cache=False)
    lengths = _forward_lengths(model)
    cached = continue_prompt(model, prompt, max_new_tokens=max_new_tokens)
    assert cached == reference
    assert len(cached) == max_new_tokens and len(set(cached)) > 1  # a real continuation, not one repeated id
    # one prefill of the (windowed) prompt, then one token per forward until the window is full, then a re-prefill
    # of the last window per token
    total = prompt_len + max_new_tokens - 1  # tokens fed: the last new one never is
    within = min(window, total) - min(prompt_len, window)
    expected = [min(prompt_len, window)] + [1] * within + [window] * (max_new_tokens - 1 - within)
    assert lengths == expected


@pytest.mark.parametrize("window", [128, 16], ids=["within-window", "window-slides"])
def test_top_p_sampling_with_cache_equals_full_recompute(window):
    model = _model(max_position_embeddings=window)
    prompt = _tokens(1, 8, seed=4)[0].tolist()
    settings = {"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.9, "vocab_limit": 100}
    reference = continue_prompt(model, prompt, generator=torch.Generator().manual_seed(7), use_cache=False, **settings)
    cached = continue_prompt(model, prompt, generator=torch.Generator().manual_seed(7), **settings)
    greedy = continue_prompt(model, prompt, max_new_tokens=24, vocab_limit=100)
    assert cached == reference
    assert cached != greedy and max(cached) < 100  # sampled, within the vocabulary limit


def test_generate_stops_at_eos_with_cache():
    model = _model()
    prompt = _tokens(1, 5, seed=5)[0].tolist()
    free = continue_prompt(model, prompt, max_new_tokens=12)
    eos = free[4]
    stopped = continue_prompt(model, prompt, max_new_tokens=12, eos_id=eos)
    assert stopped == free[: free.index(eos) + 1]


def test_cache_for_another_batch_size_says_which():
    model = _model()
    cache = KVCache.for_model(model, batch_size=2, max_len=16)
    with pytest.raises(ValueError, match=r"batch_size=2 but the input has 3 sequences.*batch_size=3"):
        model(_tokens(3, 4), kv_cache=cache)


def test_full_cache_says_how_long_to_build_it():
    model = _model()
    cache = KVCache.for_model(model, max_len=8)
    model(_tokens(1, 6), kv_cache=cache)
    with pytest.raises(ValueError, match=r"6 cached \+ 3 new tokens exceed max_len=8.*max_len>=9"):
        model(_tokens(1, 3), kv_cache=cache)
    assert cache.length == 6  # nothing was written


def test_cache_past_max_position_embeddings_says_to_reset():
    model = _model(max_position_embeddings=16)
    cache = KVCache.for_model(model, max_len=20)
    model(_tokens(1, 16), kv_cache=cache)
    with pytest.raises(ValueError, match="max_position_embeddings=16; reset the KV cache"):
        model(_tokens(1, 1), kv_cache=cache)


def test_cache_of_another_shape_says_which():
    model = _model(2)
    with pytest.raises(ValueError, match="built for 1 layers but the model has 2"):
        model(_tokens(1, 2), kv_cache=KVCache(num_layers=1, batch_size=1, max_len=8, num_kv_heads=2, head_dim=16))
    wrong_heads = KVCache(num_layers=2, batch_size=1, max_len=8, num_kv_heads=4, head_dim=16)
    with pytest.raises(ValueError, match=r"kv_heads=4.*KVCache.for_model"):
        model(_tokens(1, 2), kv_cache=wrong_heads)
    with pytest.raises(ValueError, match="max_len=0 must be a positive int"):
        KVCache(num_layers=2, batch_size=1, max_len=0, num_kv_heads=2, head_dim=16)


def test_a_decoding_step_with_padded_rows_checks_the_document_ids_once_not_per_layer(monkeypatch):
    # left-padded prompts decode with document ids over every cached and new key (-1 on the padding): the model
    # builds one DocumentMask per step, so the ids are read on the host once per step, not once per layer, and the
    # logits are those of handing every layer the raw ids (bit-equal: the same masked attention)
    from colo.apps.models.llama import model as llama_model
    from colo.kernels import document_mask as documents

    checks = []
    check = documents.check_document_ids

    def counting_check(*args, check_values=True, **kwargs):
        checks.extend([args[1]] if check_values else [])  # the host sync
        return check(*args, check_values=check_values, **kwargs)

    monkeypatch.setattr(documents, "check_document_ids", counting_check)
    model = _model(num_hidden_layers=3)
    ids = _tokens(2, 9)
    keys = torch.zeros(2, 9, dtype=torch.long)
    keys[1, :3] = -1  # row 1: three padding slots, then its prompt

    def decode():
        cache = KVCache.for_model(model, batch_size=2, max_len=9)
        with torch.no_grad():
            prefill = model(ids[:, :8], kv_cache=cache, document_ids=keys[:, :8]).logits
            return prefill, model(ids[:, 8:], kv_cache=cache, document_ids=keys).logits

    shared = decode()
    assert checks == ["document_ids", "document_ids"]  # prefill and one step, three layers each
    checks.clear()
    with monkeypatch.context() as per_layer:
        per_layer.setattr(llama_model, "layers_document_mask", lambda document_ids, **_: document_ids)
        expected = decode()
    assert len(checks) == 6
    for actual, reference in zip(shared, expected):
        torch.testing.assert_close(actual, reference, rtol=0, atol=0)
