"""The backward split of zero-bubble schedules: ``B`` (input gradient) now, ``W`` (weight gradient) later.

`backward_input` runs ``torch.autograd.grad`` from a stage's outputs to its inputs only, keeping the graph.
While it runs, a pre-hook on every *frontier* node (a node on the input path with an edge that leads to
parameters, e.g. the ``addmm`` of a linear layer) records the gradient arriving at that node. `backward_weight`
later restarts autograd from those recorded gradients along the weight edges only: first each frontier node's
weight edges, then whatever sits between those edges and the parameters (a transpose, a cast). So ``W`` never
recomputes the input path, ``B`` leaves every parameter's ``.grad`` untouched, and ``B`` + ``W`` produce the
gradients of one ordinary backward (summed in another order, so equal up to rounding).

``W`` goes through ``torch.autograd.grad`` and writes ``.grad`` itself, so gradient hooks of the parameters do
not fire; data-parallel gradient sync runs from the executor's explicit callback instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class PendingWeightGrad:
    """What `backward_input` leaves for `backward_weight` (the retained graph and the recorded gradients)."""

    params: list[torch.Tensor]
    """Parameters whose gradients `backward_weight` computes through autograd."""
    frontier: list[tuple[object, tuple, list[tuple[object, int]]]] = field(default_factory=list)
    """(node, gradients recorded at it, its weight edges) for every frontier node."""
    roots: list[tuple[object, int, torch.Tensor]] = field(default_factory=list)
    """(node, output index, gradient): outputs that do not depend on the inputs at all."""
    ready: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(parameter, gradient) computed during B (parameters shared between weight edges), added at W."""


def _accumulate(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is None:
        return
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad.add_(grad)


def _graph_reach(roots: list[object], inputs: set[object], params: set[object]) -> tuple[set[object], set[object]]:
    """Nodes from which an input's gradient accumulator is reachable, and those from which a parameter's is."""
    reaches_input: set[object] = set()
    reaches_param: set[object] = set()
    visited: set[object] = set()
    stack: list[tuple[object, bool]] = [(node, False) for node in roots if node is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            for child, _ in node.next_functions:
                if child is None:
                    continue
                if child in reaches_input:
                    reaches_input.add(node)
                if child in reaches_param:
                    reaches_param.add(node)
            continue
        if node in visited:
            continue
        visited.add(node)
        if node in inputs:
            reaches_input.add(node)
        if node in params:
            reaches_param.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in visited)
    return reaches_input, reaches_param


def _subgraph(start: object, stop: set[object]) -> set[object]:
    """Nodes reachable from ``start`` (included) without entering ``stop``."""
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return seen


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], PendingWeightGrad]:
    """``B``: the gradients of ``inputs``, leaving parameters' ``.grad`` alone; returns them and the pending ``W``.

    A weight edge is *clean* when no other weight edge reaches its target; ``W`` restarts autograd at clean
    edges. Parameters reached through an edge that is not clean (a weight used by several ops whose gradient
    paths merge before the parameter) get their gradient computed here, in ``B``, and added to ``.grad`` at ``W``.

    Args:
        outputs: the stage's output tensors that require grad (the scaled loss on the last stage).
        grad_outputs: their gradients.
        inputs: the stage's inputs (leaves; those that do not require grad, e.g. token ids, get ``None``).
        params: the parameters whose gradients `backward_weight` will produce.

    Returns:
        ``(input_grads, pending)``: one gradient per input (``None`` where an input was unused).
    """
    params = [p for p in params if p.requires_grad]
    wanted = [x for x in inputs if x.requires_grad]
    input_nodes = {get_gradient_edge(x).node for x in wanted}
    param_node = {get_gradient_edge(p).node: p for p in params}
    roots = [o.grad_fn for o in outputs]
    reaches_input, reaches_param = _graph_reach(roots, input_nodes, set(param_node))

    frontier: dict[object, list[tuple[object, int]]] = {}
    for node in reaches_input - input_nodes:
        edges = [(c, nr) for c, nr in node.next_functions if c is not None and c not in reaches_input]
        edges = [(c, nr) for c, nr in edges if c in reaches_param]
        if edges:
            frontier[node] = edges
    # how many weight edges reach each node below the input path
    reached_by: dict[object, int] = {}
    for edges in frontier.values():
        for child, _ in edges:
            for node in _subgraph(child, reaches_input):
                reached_by[node] = reached_by.get(node, 0) + 1
    shared: set[object] = set()
    for node, edges in frontier.items():
        clean = [(c, nr) for c, nr in edges if reached_by[c] == 1]
        for child, _ in edges:
            if reached_by[child] > 1:
                shared |= {n for n in _subgraph(child, reaches_input) if n in param_node}
        frontier[node] = clean
    early = [param_node[node] for node in shared]

    recorded: dict[object, tuple] = {}
    hooked = [node for node, edges in frontier.items() if edges]
    handles = [node.register_prehook(lambda grads, node=node: recorded.__setitem__(node, grads)) for node in hooked]
    try:
        targets = wanted + early
        results: list[torch.Tensor | None] = [None] * len(targets)
        if targets:
            results = list(
                torch.autograd.grad(list(outputs), targets, list(grad_outputs), retain_graph=True, allow_unused=True)
            )
    finally:
        for handle in handles:
            handle.remove()
    shared_ids = {id(p) for p in early}
    pending = PendingWeightGrad(params=[p for p in params if id(p) not in shared_ids])
    pending.ready = [(p, g) for p, g in zip(early, results[len(wanted) :]) if g is not None]
    for node in hooked:
        if node in recorded:
            pending.frontier.append((node, recorded[node], frontier[node]))
    for output, grad in zip(outputs, grad_outputs):
        if output.grad_fn is not None and output.grad_fn not in reaches_input and output.grad_fn in reaches_param:
            edge = get_gradient_edge(output)
            pending.roots.append((edge.node, edge.output_nr, grad))
    by_input = {id(x): g for x, g in zip(wanted, results[: len(wanted)])}
    return [by_input.get(id(x)) for x in inputs], pending


def backward_weight(pending: PendingWeightGrad) -> None:
    """``W``: accumulate the parameters' gradients into ``.grad`` from what `backward_input` recorded."""
    for param, grad in pending.ready:
        _accumulate(param, grad)
    param_of_node = {get_gradient_edge(p).node: p for p in pending.params}
    edge_grads: dict[tuple[object, int], torch.Tensor] = {}

    def add_edge(node: object, nr: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        if node in param_of_node:
            _accumulate(param_of_node[node], grad.sum_to_size(param_of_node[node].shape))
        elif (node, nr) in edge_grads:
            edge_grads[(node, nr)] = edge_grads[(node, nr)] + grad
        else:
            edge_grads[(node, nr)] = grad

    for node, recorded, edges in pending.frontier:
        outputs = [GradientEdge(node, k) for k, g in enumerate(recorded) if g is not None]
        grads = [g for g in recorded if g is not None]
        if not outputs:
            continue
        results = torch.autograd.grad(
            outputs, [GradientEdge(c, nr) for c, nr in edges], grads, retain_graph=True, allow_unused=True
        )
        for (child, nr), grad in zip(edges, results):
            add_edge(child, nr, grad)
    for node, nr, grad in pending.roots:
        add_edge(node, nr, grad)
    if edge_grads and pending.params:
        keys = list(edge_grads)
        results = torch.autograd.grad(
            [GradientEdge(node, nr) for node, nr in keys],
            pending.params,
            [edge_grads[key] for key in keys],
            allow_unused=True,
        )
        for param, grad in zip(pending.params, results):
            _accumulate(param, grad)
    pending.frontier.clear()
    pending.roots.clear()
    pending.ready.clear()
