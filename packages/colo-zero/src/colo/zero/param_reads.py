"""Reads of a module's parameters that wait for the overlapped parameter all-gather (stages 1/2).

With ``overlap_param_gather`` a step returns while the updated parameters are still being all-gathered into the
compute copies; colo's forward waits chunk by chunk. A read outside a forward (an EMA update over
``model.parameters()``, a weight norm logged, ``model.lm_head.weight`` inspected) must not see the previous step's
values, so each module of the model gets a subclass of its own class (as torch's ``fully_shard`` swaps a module's
class) whose ``named_parameters`` (and so ``parameters``) and parameter attributes wait first for the chunks they
return. A read with nothing in flight costs a dictionary look-up; under ``torch.compile`` the forward pre-hooks
already waited, so nothing is added to the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

_WAITING_CLASSES: dict[type, type] = {}


def _waiting_class(cls: type) -> type:
    """``cls`` with parameter reads that wait (one subclass per class, reused)."""
    waiting = _WAITING_CLASSES.get(cls)
    if waiting is None:

        def named_parameters(self, *args, **kwargs):
            if not torch.compiler.is_compiling():
                self.__dict__["_colo_wait_subtree"]()
            return cls.named_parameters(self, *args, **kwargs)

        def __getattr__(self, name: str):
            value = cls.__getattr__(self, name)
            if isinstance(value, nn.Parameter) and not torch.compiler.is_compiling():
                self.__dict__["_colo_wait_own"]()
            return value

        waiting = type(
            cls.__name__,
            (cls,),
            {"named_parameters": named_parameters, "__getattr__": __getattr__, "_colo_waits_on_reads": cls},
        )
        _WAITING_CLASSES[cls] = waiting
    return waiting


class ReadsWaitHandle:
    """Undoes `wait_on_parameter_reads` for one module (``remove``, like a hook handle)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        original = getattr(type(self.module), "_colo_waits_on_reads", None)
        if original is not None:
            self.module.__class__ = original
            self.module.__dict__.pop("_colo_wait_own", None)
            self.module.__dict__.pop("_colo_wait_subtree", None)


def wait_on_parameter_reads(
    module: nn.Module, *, own: Callable[[], None], subtree: Callable[[], None]
) -> ReadsWaitHandle:
    """Make ``module``'s parameter reads wait: ``module.weight`` calls ``own`` (its own chunks) first,
    ``module.named_parameters()`` / ``module.parameters()`` call ``subtree`` (the chunks of it and its submodules).

    Returns:
        A handle whose ``remove()`` restores the module's class.
    """
    if not hasattr(type(module), "_colo_waits_on_reads"):
        module.__class__ = _waiting_class(type(module))
    module.__dict__["_colo_wait_own"] = own
    module.__dict__["_colo_wait_subtree"] = subtree
    return ReadsWaitHandle(module)
