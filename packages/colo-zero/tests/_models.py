"""A tiny language model with uneven, tied, frozen and no-decay parameters, shared by colo-zero's tests.

Loaded by path with `colo.comm.testing.load_beside` (once per process, shared by the test files and their ranks).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN = 11, 6, 10


class TinyLM(nn.Module):
    """Embedding -> (frozen linear) -> MLP block -> lm_head tied to the embedding."""

    def __init__(self, *, frozen: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.up = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.frozen is not None:
            h = torch.tanh(self.frozen(h))
        h = h + self.down(F.gelu(self.norm(self.up(h))))
        logits = self.lm_head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def param_groups(model: nn.Module) -> list[dict]:
    """Weights decay at 0.1 with lr 1e-2; biases and norms do not decay and use lr 2e-2."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2}]


def make_models(*, frozen: bool = True, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The same initial model twice: one to shard, one as the single-process reference."""
    torch.manual_seed(seed)
    model = TinyLM(frozen=frozen)
    return model, copy.deepcopy(model)


def batch(step: int, *, rows: int, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (identical on every rank)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (rows, seq), generator=generator)
    targets = torch.randint(0, VOCAB, (rows, seq), generator=generator)
    return tokens, targets
