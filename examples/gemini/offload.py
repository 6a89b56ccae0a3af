"""Gemini on 2 data-parallel ranks: parameters and optimizer state spread over device, host and disk tiers."""

import os
import tempfile

import torch
from torch import nn

from colo.comm import Mesh, launch
from colo.gemini import GeminiConfig, GeminiOptimizer


def make_model():
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)], nn.Linear(32, 1))


def batch(rank):  # this rank's half of a global batch of 16 rows
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    return x[8 * rank : 8 * (rank + 1)], x.sum(dim=1, keepdim=True)[8 * rank : 8 * (rank + 1)]


def train(disk_dir, num_steps=3):
    model, mesh = make_model(), Mesh(dp=2)
    config = GeminiConfig(
        placement="static",  # or "auto": a warm-up step records the access order, then the device is a cache
        param_fractions={"device": 0.5, "host": 0.5},
        optim_fractions={"host": 0.5, "disk": 0.5},  # masters, moments and gradient shards
        device_capacity="1MiB",
        disk_dir=disk_dir,  # each rank writes a subdirectory of its own, removed by close()
        chunk_numel=1024,
        device="cpu",  # the device tier emulated in host memory; default: the CUDA device when there is one
    )
    gemini = GeminiOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh=mesh, config=config)
    x, y = batch(mesh.rank("dp"))
    for _ in range(num_steps):
        gemini.backward(nn.functional.mse_loss(model(x), y))
        gemini.clip_grad_norm_(1.0)
        gemini.step()
        gemini.zero_grad()
    report = gemini.memory_report()  # per tier: capacity, use, high-water; per step: bytes moved, prefetch hits
    params = gemini.full_params()  # the fp32 masters, gathered
    gemini.close()  # finishes transfers and deletes the disk tier's files
    return params, report.tiers["disk"].used > 0, str(report)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as disk_dir:
        (params, used_disk, report), _ = launch(train, 2, disk_dir, backend="gloo")  # 2 CPU processes
        assert used_disk and os.listdir(disk_dir) == [], "the disk tier was not used, or not cleaned up"
    reference = make_model()  # one process, torch's AdamW on the whole batch: what Gemini must compute
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x, y = torch.cat([batch(0)[0], batch(1)[0]]), torch.cat([batch(0)[1], batch(1)[1]])
    for _ in range(3):
        nn.functional.mse_loss(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    for name, param in reference.named_parameters():  # not bit-identical: gradients summed in another order
        torch.testing.assert_close(params[name], param.detach(), rtol=1e-5, atol=1e-5)
    print(report)
    print("ok: Gemini over device, host and disk on dp=2 matches torch AdamW in one process")
