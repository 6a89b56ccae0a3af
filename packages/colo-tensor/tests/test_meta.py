"""The meta-device path of `parallelize`: a model built on ``torch.device("meta")`` and materialized one module at
a time equals the eagerly built and parallelized model exactly (same generator, same order of draws), with a
module's own ``reset_parameters()`` or with an ``init_fn``; and the memory it allocates on the way never holds
more than this rank's shards plus one module's full parameters.

Memory is measured deterministically, not from the allocator or the RSS: a dispatch mode sees every tensor
that every aten op creates, counts the bytes of each new storage and uncounts them when the storage is freed
(a finalizer on the storage object), so the largest sum of simultaneously alive storages is exact.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from colo.comm import Mesh
from colo.comm.testing import run_distributed
from colo.tensor import Colwise, FusedQKV, Rowwise, VocabParallel, layout_of, parallelize

DIM, HEAD_DIM, HIDDEN, VOCAB, NUM_LAYERS = 16, 4, 64, 50, 4


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.num_kv_heads = 4, 2
        self.norm = nn.LayerNorm(DIM)
        self.wqkv = nn.Linear(DIM, (self.num_heads + 2 * self.num_kv_heads) * HEAD_DIM)
        self.wo = nn.Linear(self.num_heads * HEAD_DIM, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(NUM_LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, 2 * (VOCAB // 2), bias=False)


PLAN = {
    "embed": VocabParallel(),
    "layers.*.wqkv": FusedQKV(),
    "layers.*.wo": Rowwise(),
    "layers.*.up": Colwise(),
    "layers.*.down": Rowwise(),
    "head": Colwise(),
}


def _state(model):
    return {name: (t.detach().clone(), repr(layout_of(t))) for name, t in model.named_parameters()}


def _small_normal(name, module):
    """An init_fn in the style of GPT-2/Llama recipes: normal(0, 0.02) weights, zero biases, norms at one."""
    for param_name, param in module.named_parameters(recurse=False):
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            nn.init.ones_(param) if param_name == "weight" else nn.init.zeros_(param)
        elif param_name == "bias":
            nn.init.zeros_(param)
        else:
            nn.init.normal_(param, std=0.02)


def _meta_equals_eager(use_init_fn):
    mesh = Mesh(tp=2)
    init_fn = _small_normal if use_init_fn else None
    torch.manual_seed(0)
    if use_init_fn:  # eager reference: the same init_fn over the modules in order, then the plan
        with torch.device("meta"):
            eager = Model()
        eager.to_empty(device="cpu")
        with torch.no_grad():
            for name, module in eager.named_modules():
                if next(module.parameters(recurse=False), None) is not None:
                    init_fn(name, module)
    else:
        eager = Model()
    parallelize(eager, mesh=mesh, plan=PLAN)

    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = Model()
    on_meta = all(p.is_meta for p in lazy.parameters())
    parallelize(lazy, mesh=mesh, plan=PLAN, materialize="cpu", init_fn=init_fn)
    heads = [(layer.num_heads, layer.num_kv_heads) for layer in lazy.layers]
    return on_meta, _state(eager), _state(lazy), heads


def test_meta_path_equals_eager_path_with_reset_parameters():
    for on_meta, eager, lazy, heads in run_distributed(_meta_equals_eager, False, world_size=2):
        assert on_meta
        assert eager.keys() == lazy.keys()
        for name in eager:
            torch.testing.assert_close(lazy[name][0], eager[name][0], rtol=0, atol=0, msg=name)
            assert lazy[name][1] == eager[name][1], name
        assert heads == [(2, 1)] * NUM_LAYERS  # FusedQKV set the local head counts


def test_meta_path_equals_eager_path_with_init_fn():
    for _, eager, lazy, _ in run_distributed(_meta_equals_eager, True, world_size=2):
        for name in eager:
            torch.testing.assert_close(lazy[name][0], eager[name][0], rtol=0, atol=0, msg=name)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created inside the mode and still alive: now, and the largest ever."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in inputs or key in self.live or storage.nbytes() == 0:
                continue  # a view, an in-place result, or a storage already counted
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out


def _own_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def _peak_memory():
    mesh = Mesh(tp=2)
    with torch.device("meta"):
        lazy = Model()
    largest_module = max(_own_bytes(m) for m in lazy.modules())  # full sizes, read off the meta model
    full_model = sum(p.numel() * p.element_size() for p in lazy.parameters())
    with LiveBytes() as materializing:
        parallelize(lazy, mesh=mesh, plan=PLAN, materialize="cpu")
    kept = sum(p.numel() * p.element_size() for p in lazy.parameters())
    with LiveBytes() as eager:
        Model()
    return {
        "peak": materializing.peak,
        "left": materializing.current,
        "kept": kept,
        "largest_module": largest_module,
        "full_model": full_model,
        "eager_peak": eager.peak,
    }


def test_meta_path_holds_the_shards_plus_one_module_at_a_time():
    for result in run_distributed(_peak_memory, world_size=2):
        # Everything still alive after materializing is this rank's shards: every full tensor was freed.
        assert result["left"] == result["kept"]
        # At any moment: the shards kept so far plus the module being materialized (its full weight and bias).
        assert result["peak"] <= result["kept"] + result["largest_module"]
        # ...which is far from the whole model, which the eager construction holds (the tracker sees it).
        assert result["peak"] < 0.7 * result["full_model"]
        assert result["eager_peak"] >= result["full_model"]
