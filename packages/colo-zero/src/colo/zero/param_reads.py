"""Reads of a module's parameters that wait for the overlapped parameter all-gather (stages 1/2).

With ``overlap_param_gather`` a step returns while the updated parameters are still being all-gathered into the
compute copies; colo's forward waits chunk by chunk. A read through ``model.parameters()`` /
``named_parameters()`` outside a forward (an EMA update, a weight norm logged, ``torch.save`` of the values) must
not see the previous step's values, so each module of the model gets its own ``named_parameters`` (which
``parameters`` calls) that first waits for the chunks of the module and its submodules. The module's class is left
as it is (``type(model) is Llama`` still holds). A read with nothing in flight costs a dictionary look-up; under
``torch.compile`` the forward pre-hooks already waited, so nothing is added to the graph. A parameter attribute read
directly (``model.lm_head.weight``) is not intercepted: read it after `ZeroOptimizer.wait_params` (the Booster's
``unwrap`` waits).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn


def _waiting_named_parameters(module: nn.Module, *args, **kwargs):
    """``named_parameters`` after waiting for the chunks it returns."""
    if not torch.compiler.is_compiling():
        module.__dict__["_colo_wait_subtree"]()
    return type(module).named_parameters(module, *args, **kwargs)


class ReadsWaitHandle:
    """Undoes `wait_on_parameter_reads` for one module (``remove``, like a hook handle)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("named_parameters", None)
        self.module.__dict__.pop("_colo_wait_subtree", None)


def wait_on_parameter_reads(module: nn.Module, *, subtree: Callable[[], None]) -> ReadsWaitHandle:
    """Make ``module.named_parameters()`` / ``module.parameters()`` call ``subtree`` (which waits for the chunks of the
    module and its submodules) first.

    Returns:
        A handle whose ``remove()`` restores the class's ``named_parameters``.
    """
    module.__dict__["_colo_wait_subtree"] = subtree
    module.__dict__["named_parameters"] = types.MethodType(_waiting_named_parameters, module)
    return ReadsWaitHandle(module)
