#!/usr/bin/env python3
"""A DeepSeek-V3-style MoE layer trained on CPU processes: colo's `MoEBlock` (grouped experts, expert parallelism)
against transformers' ``DeepseekV3MoE`` under torch DDP and DeepSpeed-MoE's ``deepspeed.moe.layer.MoE`` under its
engine, side by side in one run (issue 44).

The layer: hidden 256, 16 routed experts of width 128 (top-4, sigmoid scores with the aux-loss-free bias, 2 groups
with ``topk_group=1``, routed scaling 2.5) beside one shared expert of width 128; transformers' block is built from a
``DeepseekV3Config`` with those fields and seeded weights (normal, std 0.02), and colo's holds the same weights
(`colo.apps.hf.deepseek_io.use_colo_deepseek_blocks`). Each rank feeds ``--batch`` x ``--seq`` random activations
per step (seeded by step and rank, the same on every row; they require their gradient, as a layer's input inside a
network does, so the backward carries the gradient of the dispatched rows back), the loss is the mean square of the
layer's output, and ``torch.optim.AdamW(lr=1e-3)`` steps every parameter; fp32, gloo, one thread per rank,
``--world`` processes (2 or 4; 4 share the 2 cores of the usual CPU machine).

Rows, each in fresh processes (so the peak RSS is its own), interleaved over ``--repeats`` with the order rotating:

- ``colo_ep``: the block's experts split over ``ep = world`` (`shard_experts`: 16 / world per rank, tokens dispatched
  and combined by all-to-all, grouped matrix products); the dense parameters' gradients (router, shared expert)
  averaged over the ranks by one ``all_reduce`` of their flattened concatenation (DDP's bucket, by hand);
- ``colo_replicated``: colo's block with every expert on every rank, all gradients averaged (torch DDP);
- ``hf_ddp``: transformers' ``DeepseekV3MoE`` under torch DDP (every expert on every rank);
- ``deepspeed_ep``: DeepSpeed-MoE's ``MoE`` layer (``ep_size = world``, ``k=4``, ``drop_tokens=False``: no
  capacity, every assignment computed, as the other rows) with 16 experts of transformers' ``DeepseekV3MLP`` (width
  128) and one shared ``DeepseekV3MLP`` added to its output, under ``deepspeed.initialize`` (ZeRO stage 0, the same
  torch AdamW; the engine averages dense gradients over the data ranks and expert gradients over the expert-data
  ranks). Its gate is GShard's softmax top-k (no groups, no bias, no routed scaling) and its dispatch is the dense
  einsum over (experts x capacity) slots: the same expert count, widths, k and ep, but not the same routing, so its
  losses differ from the others'. DeepSpeed runs on CPU (its CPU accelerator, gloo; its shared-memory comm op is
  compiled on first use, before the timed steps). Skipped with a note when ``deepspeed`` is not importable
  (``pip install deepspeed``: source-only on PyPI, it builds a wheel).

Reported: tokens/s over all ranks (from the slowest rank's wall time over ``--steps`` timed steps after
``--warmup``), the median over repeats; peak RSS (max over ranks); parameter bytes a rank holds; the first step's
loss on each rank (colo's rows and transformers' agree to rounding on the same tokens: a check that the layers compute
the same thing); the CPU seconds a step of the busiest rank (user + system time of the process over the timed steps,
median over repeats: what the step costs apart from waiting, a figure a shared, loaded machine disturbs less than
wall time); the ratios of each colo row to each peer (tokens/s: medians of per-repeat ratios) and the best peer; and,
for ``colo_ep``, the all-to-all bytes of one forward + backward measured by `colo.comm.CommTracker` against the
analytic volume (`colo.tensor.moe.dispatch_bytes` of the step's routing plus the counts exchange), per token.

Run::

    python benchmarks/moe_layer_peers.py [--world 2] [--steps 8] [--warmup 2] [--repeats 3]

Writes ``benchmarks/results/moe_layer_peers_cpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, EXPERT_WIDTH, EXPERTS, TOP_K = 256, 128, 16, 4
ROWS = ("colo_ep", "colo_replicated", "hf_ddp", "deepspeed_ep")
COLO_ROWS = ("colo_ep", "colo_replicated")
PEER_ROWS = ("hf_ddp", "deepspeed_ep")


def _hf_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, moe_intermediate_size=EXPERT_WIDTH,
        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=64,
    )  # fmt: skip


def _blocks(row: str):
    """The row's layer: transformers' block, or colo's with the same weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = _hf_config()
    holder = torch.nn.Module()
    holder.config = config
    holder.mlp = DeepseekV3MoE(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in holder.mlp.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    if row == "hf_ddp":
        return holder.mlp
    from colo.apps.hf.deepseek_io import use_colo_deepseek_blocks

    use_colo_deepseek_blocks(holder)
    return holder.mlp


def _activations(step: int, rank: int, batch: int, seq: int) -> torch.Tensor:
    """The step's input, requiring its gradient as a layer's input inside a network does."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, seq, HIDDEN, generator=generator).requires_grad_(True)


def _analytic_bytes(block, group) -> int:
    """All-to-all bytes of one forward + backward of ``block`` on this rank from its last routing: the rows it sends
    and receives (dispatch and combine, forward and backward) plus the counts exchange."""
    import torch.distributed as dist

    from colo.tensor.moe import dispatch_bytes

    counts = block.stats["tokens_per_expert"].to(torch.int64)
    ep, rank = group.size, group.rank
    gathered = [torch.zeros_like(counts) for _ in range(ep)]
    dist.all_gather(gathered, counts)  # torch's, not colo's: the tracker sees only the layer's traffic
    local = EXPERTS // ep
    send = counts.view(ep, local).sum(dim=1).tolist()
    recv = [int(piece[rank * local : (rank + 1) * local].sum()) for piece in gathered]
    rows = dispatch_bytes(send, recv, rank=rank, hidden_size=HIDDEN, element_size=4, backward=True)
    return rows + 8 * (ep - 1) * EXPERTS // ep


def _deepspeed_layer(world: int) -> torch.nn.Module:
    """DeepSpeed-MoE's layer with transformers' SwiGLU experts and one shared expert (module docstring), seeded
    weights (normal, std 0.02)."""
    from deepspeed.moe.layer import MoE
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    config = _hf_config()

    class DeepSpeedMoEWithShared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            expert = DeepseekV3MLP(config, intermediate_size=EXPERT_WIDTH)
            self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=world, k=TOP_K, drop_tokens=False)
            self.shared_experts = DeepseekV3MLP(config, intermediate_size=EXPERT_WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            routed, _aux, _counts = self.moe(x)
            return routed + self.shared_experts(x)

    layer = DeepSpeedMoEWithShared()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return layer


def _cpu_seconds() -> float:
    """This process's user + system CPU seconds (every thread: gloo's included)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_rank(row: str, steps: int, warmup: int, batch: int, seq: int) -> dict:
    """One rank of one row: build, warm up, time ``steps`` steps."""
    import resource

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from colo.comm import CommTracker, Mesh, all_reduce

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    group, dense, engine = None, None, None
    if row == "deepspeed_ep":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # takes the process group colo.comm.launch started
        block = _deepspeed_layer(world)
        optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
        engine, _, _, _ = deepspeed.initialize(
            model=block, optimizer=optimizer,
            config={"train_micro_batch_size_per_gpu": batch, "zero_optimization": {"stage": 0}},
        )  # fmt: skip
        module = engine
    else:
        block = _blocks(row)
        if row == "colo_ep":
            from colo.tensor.moe import shard_experts

            mesh = Mesh(ep=world)
            group = mesh.group("ep")
            holder = torch.nn.Module()
            holder.mlp = block
            shard_experts(holder, mesh=mesh)
            dense = [p for name, p in block.named_parameters() if not name.startswith("experts.")]
            module = block
        else:
            module = DistributedDataParallel(block)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    param_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    losses, start, measured, analytic = [], None, None, None
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
            start, cpu_start = time.perf_counter(), _cpu_seconds()
        x = _activations(step, rank, batch, seq)
        tracker = CommTracker() if (row == "colo_ep" and step == 0) else None
        if tracker is not None:
            tracker.__enter__()
        loss = module(x).float().square().mean()
        if engine is not None:
            engine.backward(loss)
            engine.step()  # the engine's gradient averaging, then AdamW, then zeroing
        else:
            loss.backward()
            if tracker is not None:
                tracker.__exit__(None, None, None)
                measured = tracker.bytes("all_to_all", axis="ep")
                analytic = _analytic_bytes(block, group)
            if dense is not None:  # the experts saw every rank's tokens; their gradients are complete
                flat = torch.cat([p.grad.reshape(-1) for p in dense])
                all_reduce(flat, op="avg", group=group)
                for parameter, piece in zip(dense, flat.split([p.numel() for p in dense])):
                    parameter.grad.copy_(piece.view_as(parameter.grad))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    cpu = _cpu_seconds() - cpu_start  # before the closing barrier (a rank waiting there spends no CPU, but be exact)
    dist.barrier()
    return {
        "elapsed_s": time.perf_counter() - start,
        "cpu_s": cpu,
        "first_loss": losses[0],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "param_mb": param_bytes / 2**20,
        "all_to_all_bytes": measured,
        "analytic_bytes": analytic,
    }


def _deepspeed_missing() -> str | None:
    """Why the DeepSpeed row cannot run here, or ``None``."""
    try:
        import deepspeed  # noqa: F401
    except Exception as error:  # ImportError, or its import-time checks failing
        return f"deepspeed not importable ({type(error).__name__}: {error}); install it with `pip install deepspeed`"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, choices=(2, 4), help="processes (the ep size of ep rows)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS / "moe_layer_peers_cpu.json")
    args = parser.parse_args()
    from colo.comm import launch

    missing = _deepspeed_missing()
    row_names = tuple(row for row in ROWS if not (row == "deepspeed_ep" and missing))
    tokens = args.world * args.batch * args.seq * args.steps
    runs: dict[str, list[dict]] = {row: [] for row in row_names}
    for repeat in range(args.repeats):
        order = row_names[repeat % len(row_names) :] + row_names[: repeat % len(row_names)]
        for row in order:
            per_rank = launch(
                run_rank, args.world, row, args.steps, args.warmup, args.batch, args.seq, backend="gloo", threads=1,
                timeout=900,
            )  # fmt: skip
            runs[row].append(
                {
                    "tokens_per_s": tokens / max(r["elapsed_s"] for r in per_rank),
                    "cpu_s_per_step": max(r["cpu_s"] for r in per_rank) / args.steps,
                    "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
                    "param_mb": per_rank[0]["param_mb"],
                    "first_losses": [r["first_loss"] for r in per_rank],
                    "all_to_all_bytes": [r["all_to_all_bytes"] for r in per_rank],
                    "analytic_bytes": [r["analytic_bytes"] for r in per_rank],
                }
            )
            print(f"[repeat {repeat}] {row:>16}: {runs[row][-1]['tokens_per_s']:8.0f} tokens/s", flush=True)
    rows = {}
    for row, measured in runs.items():
        rows[row] = {
            "tokens_per_s": statistics.median(run["tokens_per_s"] for run in measured),
            "tokens_per_s_all": [run["tokens_per_s"] for run in measured],
            "cpu_s_per_step": statistics.median(run["cpu_s_per_step"] for run in measured),
            "peak_rss_mb": statistics.median(run["peak_rss_mb"] for run in measured),
            "param_mb_per_rank": measured[0]["param_mb"],
            "first_losses": measured[0]["first_losses"],
        }
    peers = [row for row in PEER_ROWS if row in runs]
    best_peer = max(peers, key=lambda row: rows[row]["tokens_per_s"])
    ratios = {}
    for mine in COLO_ROWS:
        for peer in peers:
            ratios[f"{mine} / {peer}"] = {
                "tokens_per_s": statistics.median(
                    a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[mine], runs[peer])
                ),
                "peak_rss": rows[mine]["peak_rss_mb"] / rows[peer]["peak_rss_mb"],
                "cpu_per_step": rows[peer]["cpu_s_per_step"] / rows[mine]["cpu_s_per_step"],
            }
    ep_run = runs["colo_ep"][0]
    per_token = 1 / (args.batch * args.seq)
    all_to_all = {
        "measured_bytes_per_rank": ep_run["all_to_all_bytes"],
        "analytic_bytes_per_rank": ep_run["analytic_bytes"],
        "measured_bytes_per_token": [b * per_token for b in ep_run["all_to_all_bytes"]],
        "exact": ep_run["all_to_all_bytes"] == ep_run["analytic_bytes"],
    }
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if not missing:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    report = {
        "benchmark": "moe_layer_peers: a DeepSeek-V3-style MoE layer, colo (ep / replicated) vs transformers "
        f"DeepseekV3MoE under DDP and DeepSpeed-MoE (ep), {args.world} CPU processes",
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), **versions},
        "layer": {"hidden": HIDDEN, "experts": EXPERTS, "expert_width": EXPERT_WIDTH, "top_k": TOP_K,
                  "shared_experts": 1, "groups": 2, "topk_group": 1, "routed_scaling_factor": 2.5},
        "settings": {key: getattr(args, key) for key in ("world", "steps", "warmup", "repeats", "batch", "seq")},
        "rows": rows,
        "best_peer": best_peer,
        "ratios": ratios,
        "all_to_all": all_to_all,
        "deepspeed": missing or "row deepspeed_ep (its own gate and dispatch: see the script's docstring)",
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for row, values in rows.items():
        losses = ", ".join(f"{v:.6f}" for v in values["first_losses"])
        print(
            f"{row:>16}: {values['tokens_per_s']:8.0f} tokens/s, {values['cpu_s_per_step'] * 1e3:.0f} ms CPU a step, "
            f"peak RSS {values['peak_rss_mb']:.0f} MiB, "
            f"{values['param_mb_per_rank']:.2f} MiB of parameters per rank, first losses {losses}"
        )
    for name, ratio in ratios.items():
        print(
            f"{name}: {ratio['tokens_per_s']:.2f}x tokens/s at {ratio['peak_rss']:.2f}x peak RSS; "
            f"{ratio['cpu_per_step']:.2f}x less CPU time per step"
        )
    print(f"best peer: {best_peer}" + (f"; {missing}" if missing else ""))
    print(f"all-to-all bytes per rank (one forward + backward): measured {all_to_all['measured_bytes_per_rank']}, "
          f"analytic {all_to_all['analytic_bytes_per_rank']}, exact: {all_to_all['exact']}")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
