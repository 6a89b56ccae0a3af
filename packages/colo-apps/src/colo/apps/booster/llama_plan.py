"""`HybridParallel`'s plan for colo's native `Llama`: tensor parallelism by `parallelize_llama`, pipeline stages by
`llama_pipeline_stages`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from colo.comm import Mesh

from ..models.llama import Llama, llama_pipeline_stages, parallelize_llama
from ..models.llama.loss import causal_lm_loss
from ..models.llama.parallelize import check_tp_size
from .plans import ModelPlan, PipelinePart, register_plan


def _materialize_device(model: nn.Module) -> torch.device | None:
    """Where to initialize a meta-device model (the current CUDA device, else the CPU); ``None`` for a real one."""
    if not any(p.is_meta for p in model.parameters()):
        return None
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class LlamaPlan(ModelPlan):
    """Tensor parallelism over ``tp`` (vocabulary-parallel loss without a pipeline) and a layer-range pipeline."""

    def check(self, model: Llama, plugin) -> None:
        config = model.config
        if plugin.tp > 1:
            check_tp_size(config, plugin.tp)
        num_stages = plugin.pp * plugin.num_model_chunks
        if num_stages > config.num_hidden_layers:
            raise ValueError(
                f"HybridParallel: pp={plugin.pp} x num_model_chunks={plugin.num_model_chunks} = {num_stages} stages "
                f"but the model has num_hidden_layers={config.num_hidden_layers}; use at most that many stages"
            )

    def apply(self, model: nn.Module, *, mesh: Mesh, plugin) -> nn.Module:
        device = _materialize_device(model)
        if plugin.tp > 1:
            # a pipeline's last stage outputs logits for the executor's loss, so they are gathered there
            parallelize_llama(model, mesh=mesh, loss_parallel=plugin.pp == 1, materialize=device, seed=plugin.seed)
        elif device is not None:
            model.to_empty(device=device)
            model.init_weights(plugin.seed)
        return model

    def pipeline(self, model: Llama, *, mesh: Mesh, plugin, stage_ids: list[int]) -> PipelinePart:
        stages = llama_pipeline_stages(model, plugin.pp * plugin.num_model_chunks)
        chunks = [self.apply(stages[i], mesh=mesh, plugin=plugin) for i in stage_ids]
        tied: dict[str, nn.Parameter] = {}
        for chunk in chunks:
            tied.update(chunk.tied_parameters())
        return PipelinePart(chunks=chunks, loss_fn=causal_lm_loss, tied_parameters=tied)

    def pipeline_batch(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(f"a Llama pipeline batch needs 'input_ids' and 'labels'; got keys {sorted(batch)}")
        return batch["input_ids"], batch["labels"]


register_plan(Llama, LlamaPlan())
