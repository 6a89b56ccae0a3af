"""The test model, data, budgets and helpers shared by colo-gemini's tests.

Loaded by path with `colo.comm.testing.load_beside` (once per process, shared by the test files and their ranks).
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import Mesh
from colo.gemini import GeminiConfig, GeminiOptimizer

VOCAB, DIM, HIDDEN, NUM_BLOCKS = 32, 32, 64, 8
ROWS_PER_RANK, SEQ = 2, 2
CHUNK_NUMEL = 2048
FP32 = {"rtol": 1e-5, "atol": 1e-5}


class Block(nn.Module):
    """Pre-norm MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TinyLM(nn.Module):
    """Embedding -> frozen linear -> MLP blocks -> lm_head tied to the embedding: parameters outweigh activations."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(NUM_BLOCKS))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.1)  # small logits: a stable loss near log(VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(tokens)))
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def param_groups(model: nn.Module, *, lr: float = 1e-2) -> list[dict]:
    """Weights decay at 0.1 with ``lr``; biases and norms do not decay and use ``2 * lr``."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1, "lr": lr},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2 * lr},
    ]


def make_models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The same initial model twice: one for Gemini, one as the single-process reference."""
    torch.manual_seed(seed)
    model = TinyLM()
    return model, copy.deepcopy(model)


def batch(step: int, *, rows: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (identical on every rank), on ``device``: where the model under test computes
    (``gemini.device``: a GPU when each rank has one), or the CPU for the single-process reference."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    return tokens.to(device), targets.to(device)


def param_bytes(dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the model's parameters (tied weight once)."""
    model, _ = make_models()
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()


BUDGETS = {
    # everything on the device: ZeRO-3 on one tier
    "all_device": {},
    # a device budget below the parameters (144 KiB); the host holds the rest of them and the optimizer state
    "host_offload": {
        "param_fractions": {"device": 0.25, "host": 0.75},
        "optim_fractions": {"host": 1.0},
        "device_capacity": "96KiB",
    },
    # everything homed on the host and a device that just holds the chunks in use
    "tight_device": {"param_fractions": {"host": 1.0}, "optim_fractions": {"host": 1.0}, "device_capacity": "64KiB"},
    # a disk tier holding half the parameters and most optimizer state; the device holds the working set only
    "disk": {
        "param_fractions": {"host": 0.5, "disk": 0.5},
        "optim_fractions": {"host": 0.4, "disk": 0.6},
        "disk_dir": "TMP",
    },
    # auto with a device budget below the parameters: the warm-up decides the rest
    "auto_small_device": {"placement": "auto", "device_capacity": "112KiB"},
    # auto with a host too small for everything: optimizer state spills to disk
    "auto_disk": {"placement": "auto", "device_capacity": "112KiB", "host_capacity": "384KiB", "disk_dir": "TMP"},
}


def config(budget: str, **extra) -> GeminiConfig:
    fields = dict(BUDGETS[budget], chunk_numel=CHUNK_NUMEL, **extra)
    if fields.get("disk_dir") == "TMP":  # each optimizer makes (and on close removes) its own directory in it
        fields["disk_dir"] = os.path.join(tempfile.gettempdir(), "colo-gemini-tests")
    return GeminiConfig(**fields)


def train_steps(model, gemini, steps, *, num_shares, share):
    """Train on ``steps``; this process takes share ``share`` of ``num_shares`` of each global batch."""
    losses = []
    for step in steps:
        tokens, targets = batch(step, rows=2 * ROWS_PER_RANK, device=gemini.device)  # a 2-rank run's global batch
        rows = 2 * ROWS_PER_RANK // num_shares
        mine = slice(share * rows, (share + 1) * rows)
        loss = model(tokens[mine], targets[mine])
        gemini.backward(loss)
        gemini.step()
        gemini.zero_grad()
        losses.append(loss.item())
    return losses


def build(budget, *, seed=0):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, _ = make_models(seed)
    gemini = GeminiOptimizer(model, torch.optim.AdamW(param_groups(model)), mesh=mesh, config=config(budget))
    return model, gemini, mesh.size("dp"), mesh.rank("dp")
