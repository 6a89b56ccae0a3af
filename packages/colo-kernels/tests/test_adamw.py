"""The Triton multi-tensor AdamW (run by Triton's interpreter on CPU) equals the torch reference and
`torch.optim.AdamW`, step after step."""

import pytest
import torch

from colo.kernels.adamw import FusedAdamW, adamw_reference, fused_adamw
from colo.kernels.dispatch import UnsupportedKernelInput

SHAPES = [(37,), (5, 20), (3, 7, 11), (70001,)]  # odd sizes; the last spans two interpreter blocks
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}


def _tensors(dtype, generator):
    params = [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]
    exp_avgs = [torch.zeros(shape) for shape in SHAPES]
    exp_avg_sqs = [torch.zeros(shape) for shape in SHAPES]
    return params, exp_avgs, exp_avg_sqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference_at_every_step(dtype):
    generator = torch.Generator().manual_seed(0)
    state = _tensors(dtype, generator)
    for step in range(1, 4):
        grads = [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]
        expected_state = tuple([t.clone() for t in tensors] for tensors in state)  # the reference starts where we are
        adamw_reference(expected_state[0], grads, *expected_state[1:], step=step, **HYPER)
        fused_adamw(state[0], grads, *state[1:], step=step, backend="triton", **HYPER)
        for tensors, expected_tensors in zip(state, expected_state):
            for got, expected in zip(tensors, expected_tensors):
                assert got.dtype == expected.dtype
                if got.dtype == torch.bfloat16:
                    # the interpreter rounds bf16 stores toward zero, torch to nearest: one bf16 ulp apart
                    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-5)
                else:
                    # the same fp32 formula, the same order of operations
                    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_fused_adamw_optimizer_matches_torch_adamw():
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 3))
    twin.load_state_dict(model.state_dict())
    fused = FusedAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, backend="triton")
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(4):
        inputs = torch.randn(8, 13, generator=generator)
        for network, optimizer in ((model, fused), (twin, reference)):
            optimizer.zero_grad()
            network(inputs).pow(2).mean().backward()
            optimizer.step()
    for got, expected in zip(model.parameters(), twin.parameters()):
        # torch updates exp_avg with lerp, the kernel with beta1 * m + (1 - beta1) * g: fp32 rounding apart
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for got, expected in zip(fused.state.values(), reference.state.values()):
        assert float(got["step"]) == float(expected["step"]) == 4
        torch.testing.assert_close(got["exp_avg_sq"], expected["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_mixed_dtypes_in_one_call_and_params_without_grad_are_skipped():
    fp32_param = torch.nn.Parameter(torch.randn(9))
    bf16_param = torch.nn.Parameter(torch.randn(9).to(torch.bfloat16))
    frozen = torch.nn.Parameter(torch.randn(9))
    before = frozen.detach().clone()
    optimizer = FusedAdamW([fp32_param, bf16_param, frozen], lr=0.1, weight_decay=0.0, backend="triton")
    fp32_param.grad, bf16_param.grad = torch.ones(9), torch.ones(9, dtype=torch.bfloat16)
    start = fp32_param.detach().clone(), bf16_param.detach().float()
    optimizer.step()
    # the first AdamW step moves every element by lr (m / sqrt(v) = 1 after bias correction)
    torch.testing.assert_close(fp32_param.detach(), start[0] - 0.1)
    torch.testing.assert_close(bf16_param.detach().float(), start[1] - 0.1, rtol=2**-7, atol=2**-7)
    assert torch.equal(frozen.detach(), before) and frozen not in optimizer.state
    assert optimizer.state[bf16_param]["exp_avg"].dtype == torch.float32


def test_rejects_mismatched_lists_and_non_fp32_states_on_triton():
    param, grad = torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match="one of each"):
        fused_adamw([param], [grad], [], [], step=1, lr=0.1)
    with pytest.raises(ValueError, match="step"):
        fused_adamw([param], [grad], [torch.zeros(4)], [torch.zeros(4)], step=0, lr=0.1)
    half_state = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedKernelInput, match="float32"):
        fused_adamw([param], [grad], [half_state], [half_state], step=1, lr=0.1, backend="triton")
