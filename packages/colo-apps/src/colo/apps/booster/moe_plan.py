"""`HybridParallel`'s plan for `MoELlama`: the Llama plan (checkpoint names, data parallelism and ZeRO with the
experts replicated), refusing tensor, sequence and pipeline parallelism, which do not compose with mixture-of-experts
blocks yet. Expert parallelism is the `ExpertParallel` plugin."""

from __future__ import annotations

from torch import nn

from .llama_plan import LlamaPlan
from .parallel_dims import UnsupportedLayout


class MoELlamaPlan(LlamaPlan):
    """`LlamaPlan` for `MoELlama` with tp = sp = pp = 1 only (see the module docstring)."""

    def check(self, model: nn.Module, plugin) -> None:
        for name in ("tp", "sp", "pp"):
            size = getattr(plugin, name, 1)
            if size > 1:
                raise UnsupportedLayout(
                    f"HybridParallel.{name}={size}: {type(model).__name__} has mixture-of-experts blocks, which do not "
                    f"compose with tensor, sequence or pipeline parallelism yet; set {name}=1, and use the "
                    "ExpertParallel plugin (ep > 1) to split the experts",
                    field=name,
                )
        super().check(model, plugin)
