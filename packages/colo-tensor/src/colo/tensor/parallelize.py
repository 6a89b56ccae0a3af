"""`parallelize(model, mesh, plan)`: apply tensor parallelism to a model from outside, by a plan.

A plan maps module-name patterns to styles (`colo.tensor.styles`)::

    plan = {
        "embed": VocabParallel(),
        "layers.*.attn.wqkv": FusedQKV(),
        "layers.*.attn.wo": Rowwise(),
        "layers.*.mlp.up": Colwise(),
        "layers.*.mlp.down": Rowwise(),
        "layers.*.mlp.dropout": ShardedRNG(tracker),
    }
    parallelize(model, mesh=mesh, plan=plan)

Patterns are matched against qualified module names one dotted atom at a time with `fnmatch` rules (``*``,
``?``, ``[...]`` never cross a dot), and an atom ``**`` matches any number of atoms (``"**.wq"``: every
``wq``); ``""`` names the root. Every pattern must match a module and every style must be able to handle the
modules it matches; both are checked, with errors naming the pattern and the module, before the model changes.

Replaced modules are built from the full weights (each rank keeps its slice), so the sharded model equals the
unsharded one. Every parameter carries its layout afterwards (`layout_of`): the styles' parameters their
shards, all others ``Replicate`` on every axis.

**The meta-device path.** Build the model under ``torch.device("meta")`` (no memory, no initialisation) and
pass ``materialize="cpu"`` (or a CUDA device): modules are then initialised one at a time, in
``model.named_modules()`` order (the order an eager ``__init__`` constructs them in, for models that register
submodules as they build them), each with its own ``reset_parameters()`` (or ``init_fn(name, module)``),
drawing from the same global generator an eager construction draws from; a module a style replaces is sharded
right away and its full weights are freed before the next module is initialised. With the same seed the result
equals the eager path exactly, and the memory in use is this rank's shards plus one module's full parameters,
never the whole model. Buffers are allocated uninitialised: a module's ``reset_parameters()`` (or ``init_fn``)
must fill its own buffers, as it must for its parameters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase

import torch
from torch import nn

from colo.comm import Mesh

from .layout import Layout, layout_of, set_layout
from .styles import ParallelStyle, StyleTarget

InitFn = Callable[[str, nn.Module], None]
"""``init_fn(name, module)``: initialise ``module``'s own (non-recursive) parameters and buffers in place."""


def _matches(pattern: list[str], name: list[str]) -> bool:
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_matches(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatchcase(name[0], head) and _matches(rest, name[1:])


def match_modules(model: nn.Module, pattern: str) -> list[str]:
    """Qualified names of ``model``'s modules that ``pattern`` matches (atom-wise fnmatch, ``**`` for any depth)."""
    atoms = pattern.split(".") if pattern else []
    return [name for name, _ in model.named_modules() if _matches(atoms, name.split(".") if name else [])]


def _own_tensors(module: nn.Module):
    return itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))


def _named_own_tensors(module: nn.Module):
    return itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in _own_tensors(module))


def _parent(model: nn.Module, name: str) -> tuple[nn.Module | None, str]:
    if not name:
        return None, ""
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def _check_arguments(model, mesh, plan, axis, materialize, init_fn) -> torch.device | None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"parallelize: mesh must be a colo.comm.Mesh, e.g. Mesh(tp=2), not {type(mesh).__name__}")
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize: plan must be a mapping of module-name patterns to styles, not {plan!r}")
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"parallelize: plan key {pattern!r} must be a str pattern such as 'layers.*.attn.wq'")
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"parallelize: plan[{pattern!r}] is {style!r}, not a style; use Colwise(), Rowwise(), "
                "VocabParallel(), FusedQKV(), PrepareInput(...), PrepareOutput(...), ShardedRNG(tracker), "
                "SequenceParallel(), UlyssesAttention() or RingAttention()"
            )
        style_axis = style.axis or axis
        if style_axis not in mesh.axis_names:
            raise ValueError(
                f"parallelize: plan[{pattern!r}] uses mesh axis {style_axis!r}, but the mesh has axes "
                f"{mesh.axis_names}; pass axis=... to parallelize or to the style"
            )
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"parallelize: init_fn must be callable as init_fn(name, module), not {init_fn!r}")
    return None if materialize is None else torch.device(materialize)


def _resolve(model: nn.Module, mesh: Mesh, plan, axis: str) -> dict[str, list[tuple[str, ParallelStyle]]]:
    """Module name -> [(pattern, style)], checked: every pattern matches, every style can handle its modules."""
    names = [name for name, _ in model.named_modules()]
    targets: dict[str, list[tuple[str, ParallelStyle]]] = {}
    for pattern, style in plan.items():
        matched = match_modules(model, pattern)
        if not matched:
            examples = ", ".join(repr(n) for n in names[1:7]) or "only the root ''"
            raise ValueError(
                f"parallelize: plan pattern {pattern!r} matches no module of {type(model).__name__}; module names "
                f"look like {examples} (atoms match one at a time: '*' never crosses a dot, '**' spans any depth)"
            )
        for name in matched:
            targets.setdefault(name, []).append((pattern, style))
    owners: dict[int, list[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(param_name)
    for name, styles in targets.items():
        module = model.get_submodule(name) if name else model
        if any(style.replaces for _, style in styles):
            _check_untied(name, module, owners)
        parent, _ = _parent(model, name)
        replacing = [f"{style!r} (from {pattern!r})" for pattern, style in styles if style.replaces]
        if len(replacing) > 1:
            raise ValueError(
                f"parallelize: module {name!r} is matched by {len(replacing)} styles that replace it: "
                f"{', '.join(replacing)}; give each module at most one of Colwise, Rowwise, VocabParallel, FusedQKV"
            )
        if replacing and parent is None:
            raise ValueError(f"parallelize: {replacing[0]} cannot replace the root module; match a submodule")
        for pattern, style in styles:
            style.check(StyleTarget(pattern, name, module, parent, mesh, style.axis or axis))
    # replacing styles first, so hooks of the others land on the module that stays
    return {name: sorted(styles, key=lambda item: not item[1].replaces) for name, styles in targets.items()}


def _check_untied(name: str, module: nn.Module, owners: dict[int, list[str]]) -> None:
    """A replaced module gets new parameters: one shared with another module would silently be untied."""
    for param in module.parameters(recurse=False):
        if len(owners[id(param)]) > 1:
            raise ValueError(
                f"parallelize: module {name!r} is replaced, but its parameter is shared as {owners[id(param)]}; "
                "replacing it would untie them. Untie the weights before parallelize, or leave the module out"
            )


def _check_materializable(model: nn.Module, init_fn: InitFn | None) -> None:
    for name, module in model.named_modules():
        if _has_meta(module) and init_fn is None and not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(
                f"parallelize: module {name or '<root>'!r} ({type(module).__name__}) has parameters or buffers on "
                "the meta device and no reset_parameters(); pass init_fn=lambda name, module: ... to initialise it"
            )


@torch.no_grad()
def _materialize(name: str, module: nn.Module, device: torch.device, init_fn: InitFn | None) -> None:
    """Allocate ``module``'s own meta tensors on ``device`` and initialise them (its children are not touched)."""
    layouts = {n: layout_of(t) for n, t in _named_own_tensors(module)}
    module.to_empty(device=device, recurse=False)
    for n, tensor in _named_own_tensors(module):  # to_empty may hand back new tensor objects: keep their layouts
        if layouts[n] is not None and layout_of(tensor) is None:
            set_layout(tensor, layouts[n])
    if init_fn is not None:
        init_fn(name, module)
    else:
        module.reset_parameters()


def _apply_styles(model: nn.Module, name: str, styles, mesh: Mesh, axis: str) -> None:
    module = model.get_submodule(name) if name else model
    parent, attr = _parent(model, name)
    for pattern, style in styles:
        replacement = style.apply(StyleTarget(pattern, name, module, parent, mesh, style.axis or axis))
        if replacement is not module:
            _keep_frozen(module, replacement, name)
            setattr(parent, attr, replacement)
            module = replacement


def _keep_frozen(original: nn.Module, replacement: nn.Module, name: str) -> None:
    """A replaced module whose parameters were all frozen (``requires_grad=False``, e.g. the base weights under
    LoRA) stays frozen; a mix of frozen and trainable parameters has no clear counterpart in the parallel one."""
    flags = {p.requires_grad for p in original.parameters(recurse=False)}
    if flags == {False}:
        for param in replacement.parameters(recurse=False):
            param.requires_grad_(False)
    elif len(flags) > 1:
        raise ValueError(
            f"module {name!r} has frozen and trainable parameters; a parallel style replaces it as a whole: freeze "
            "all of its parameters or none"
        )


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    plan: Mapping[str, ParallelStyle],
    *,
    axis: str = "tp",
    materialize: torch.device | str | None = None,
    init_fn: InitFn | None = None,
    replicate_layouts: bool = True,
) -> nn.Module:
    """Apply a tensor-parallel plan to ``model`` in place (see the module docstring).

    Args:
        model: the unsharded model, built eagerly or on the meta device; the same on every rank.
        mesh: the mesh (passed in, never global).
        plan: module-name pattern -> style, e.g. ``{"layers.*.mlp.up": Colwise(), "layers.*.mlp.down": Rowwise()}``.
        axis: the mesh axis styles shard over unless they name their own. Default ``"tp"``.
        materialize: initialise meta-device parameters on this device, one module at a time (``None``: leave
            them on the meta device). Default ``None``.
        init_fn: ``init_fn(name, module)`` initialises a materialised module's own parameters and buffers
            instead of its ``reset_parameters()``. Default ``None``.
        replicate_layouts: attach a ``Replicate`` layout to every parameter that has none. Default ``True``.

    Returns:
        ``model``, with the matched modules replaced or wrapped.

    Raises:
        TypeError, ValueError: a pattern matches nothing, a style cannot handle a module it matches (type,
            divisibility), an axis is not on the mesh, or a meta module cannot be initialised; raised before
            the model changes.
    """
    device = _check_arguments(model, mesh, plan, axis, materialize, init_fn)
    targets = _resolve(model, mesh, plan, axis)
    if device is not None:
        _check_materializable(model, init_fn)
    names = [name for name, _ in model.named_modules()]  # names only: replaced modules must be free to go
    for name in names:
        if device is not None:
            module = model.get_submodule(name) if name else model
            if _has_meta(module):
                _materialize(name, module, device, init_fn)
            del module
        if name in targets:
            _apply_styles(model, name, targets[name], mesh, axis)
    if replicate_layouts:
        for param in model.parameters():
            if layout_of(param) is None:
                set_layout(param, Layout(mesh, {}, param.shape))
    return model
