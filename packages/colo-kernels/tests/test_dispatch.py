"""`COLO_KERNELS`, `use_backend` and ``backend=`` choose which implementation of an op runs; ``auto`` picks the
torch reference for CPU tensors; unknown names and impossible choices fail with a message."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from colo.kernels.dispatch import UnsupportedKernelInput, resolve_backend, use_backend
from colo.kernels.rms_norm import rms_norm
from colo.kernels.swiglu import swiglu


class _RecordBackends(TorchDispatchMode):
    """Records the backend argument (the last) of every ``torch.ops.colo`` operator that runs."""

    def __init__(self):
        super().__init__()
        self.backends = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "colo":
            self.backends.append(args[-1])
        return func(*args, **(kwargs or {}))


def _ran(op, *args, **kwargs) -> str:
    """Which implementation ``op(*args, **kwargs)`` ran: the backend its colo operator was given."""
    with _RecordBackends() as recorder:
        op(*args, **kwargs)
    (backend,) = recorder.backends
    return backend


def _rms_norm_backend(**kwargs) -> str:
    return _ran(rms_norm, torch.randn(2, 8, requires_grad=True), torch.ones(8), **kwargs)


def test_auto_on_cpu_picks_the_reference(monkeypatch):
    monkeypatch.delenv("COLO_KERNELS", raising=False)
    assert resolve_backend("rms_norm", torch.zeros(1)) == "torch"
    assert _rms_norm_backend() == "torch"
    with use_backend("auto"):
        assert _rms_norm_backend() == "torch"


def test_environment_variable_selects_the_backend(monkeypatch):
    monkeypatch.setenv("COLO_KERNELS", "triton")
    assert _rms_norm_backend() == "triton"
    monkeypatch.setenv("COLO_KERNELS", "torch")
    assert _rms_norm_backend() == "torch"


def test_use_backend_overrides_the_environment_and_backend_argument_overrides_both(monkeypatch):
    monkeypatch.setenv("COLO_KERNELS", "torch")
    with use_backend("triton"):
        assert _rms_norm_backend() == "triton"
        assert _ran(swiglu, torch.randn(4, requires_grad=True), torch.randn(4)) == "triton"
        assert _rms_norm_backend(backend="torch") == "torch"
        with use_backend("torch"):
            assert _rms_norm_backend() == "torch"
        assert _rms_norm_backend() == "triton"  # the inner block's choice ended with it
    assert _rms_norm_backend() == "torch"
    assert _rms_norm_backend(backend="triton") == "triton"


def test_unknown_backend_names_raise(monkeypatch):
    with pytest.raises(ValueError, match="unknown"):
        rms_norm(torch.randn(2, 8), torch.ones(8), backend="cuda")
    with pytest.raises(ValueError, match="unknown"), use_backend("tritonn"):
        pass
    monkeypatch.setenv("COLO_KERNELS", "fast")
    with pytest.raises(ValueError, match="COLO_KERNELS"):
        rms_norm(torch.randn(2, 8), torch.ones(8))


def test_forcing_triton_on_cpu_without_the_interpreter_says_how_to_fix_it(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UnsupportedKernelInput, match="TRITON_INTERPRET=1"):
        rms_norm(torch.randn(2, 8), torch.ones(8), backend="triton")
