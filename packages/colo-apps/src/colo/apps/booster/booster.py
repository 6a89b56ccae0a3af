"""`Booster`: one object that applies a plugin's parallelism to a model and runs whole training steps."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

import torch

from colo.comm.debug import debug_checks, disagreement, exchange, fingerprint
from colo.comm.regions import region

from .plans import checkpoint_manifest
from .plugins.base import Engine, Plugin, StepResult

BOOSTER_KEY = "booster"


class Booster:
    """Applies a plugin (`DDP`, `Zero`, `HybridParallel`, ...) to a model and optimizer and runs training steps.

    Args:
        plugin: the parallelism and precision settings.

    Example::

        booster = Booster(Zero(stage=2, precision="bf16", max_grad_norm=1.0))
        model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
        for batch in batches:                      # dicts of tensors: {"input_ids": ..., "labels": ...}
            result = booster.train_step(batch)     # StepResult(loss, grad_norm, skipped, lr, num_microbatches)
        booster.save("checkpoints/step-100")
    """

    def __init__(self, plugin: Plugin) -> None:
        if not isinstance(plugin, Plugin):
            raise TypeError(f"Booster(plugin=...) needs a colo.apps plugin (DDP, Zero, ...), not {type(plugin)}")
        self.plugin = plugin
        self.engine: Engine | None = None
        self.lr_scheduler = None
        self.step_count = 0
        self._checkpointer = None  # the AsyncCheckpointer of asynchronous saves, created at the first one
        self._batch_checked = False  # whether a step checked that its batch is the same on the ranks sharing it

    def boost(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        criterion: Callable | None = None,
        dataloader=None,
        lr_scheduler=None,
        example_batch: Mapping[str, torch.Tensor] | None = None,
    ):
        """Wrap ``model`` and ``optimizer`` for the plugin.

        Args:
            model: the model, built the same way on every rank; its values need not agree: every plugin starts from
                rank 0's parameters and buffers (broadcast before anything is sharded, as DDP does), or, for a
                model on the meta device, from the values the plugin materializes (the same on every rank).
            optimizer: a fresh torch optimizer over the model's parameters.
            criterion: ``criterion(output, batch) -> loss``; ``None`` when the model returns its loss.
            dataloader: returned as is (build one with ``plugin.prepare_dataloader`` to shard the data).
            lr_scheduler: stepped after every optimizer step that was not skipped.
            example_batch: a batch the model runs on (``model(**batch)``): for the plugins that pack parameters
                into chunks (`Zero`, `Gemini`: ``packs_chunks``), one forward under ``torch.no_grad`` records the order
                in which modules use their parameters (`colo.zero.execution_order`, rank 0's, broadcast) and the
                chunks are packed in it, so a chunk's parameters are used together and ZeRO-3 / Gemini hold fewer
                chunks at once (registration order otherwise, which models such as diffusers' UNet do not run in).

        Returns:
            ``(model, optimizer, criterion, dataloader, lr_scheduler)``, wrapped where the plugin wraps them (the
            optimizer may be a `ZeroOptimizer` around the torch one).
        """
        if self.engine is not None:
            raise RuntimeError("this Booster already boosted a model; make one Booster per model")
        manifest = checkpoint_manifest(model)  # before a pipeline keeps only this rank's stages
        param_order = None
        if example_batch is not None and self.plugin.packs_chunks:
            param_order = _execution_order(model, example_batch)
        self.engine = self.plugin.configure(model, optimizer, criterion=criterion, param_order=param_order)
        self.engine.expected_names = manifest
        self.lr_scheduler = lr_scheduler
        return self.engine.model, self.engine.optimizer, criterion, dataloader, lr_scheduler

    @property
    def mesh(self):
        """The `colo.comm.Mesh` the plugin runs on (after `boost`)."""
        return self._require_engine().mesh

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("call booster.boost(model, optimizer, ...) first")
        return self.engine

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> StepResult:
        """Run one whole training step on ``batch`` (a dict of tensors split into microbatches on dim 0).

        Under ZeRO 1/2 (`Zero`, `HybridParallel`) the updated parameters' all-gather is still in flight when it
        returns (it overlaps the next forward); reads through the model wait for the chunks they return
        (``model.parameters()``, ``named_parameters()``, ``model.state_dict()``, ``model.lm_head.weight``,
        `unwrap`), as do `save` and `load`. Only a parameter reference kept from before the step reads the old values
        until the next forward: read it after `unwrap`, which waits.

        Ranks that split one batch's work (a tensor-, sequence- or pipeline-parallel group: every rank but those
        differing on the plugin's ``sample_axes``) must be given the same batch. The first step checks it (a hash of
        the batch's integer tensors, exchanged over the group; every step under ``COLO_DEBUG_CHECKS=1``) and raises
        a `ValueError` on every rank naming the group, the ranks and the fix.
        """
        engine = self._require_engine()
        if not self._batch_checked or debug_checks():
            _check_same_batch(batch, mesh=engine.mesh, sample_axes=self.plugin.sample_axes(engine.mesh))
            self._batch_checked = True
        loss, grad_norm, skipped = engine.train_step(batch)
        if not skipped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step_count += 1
        groups = engine.torch_optimizer.param_groups
        lr = float(groups[0]["lr"]) if groups and "lr" in groups[0] else None
        return StepResult(
            loss=loss, grad_norm=grad_norm, skipped=skipped, lr=lr, num_microbatches=self.plugin.num_microbatches
        )

    def set_step_timer(self, timer) -> None:
        """Time the phases of every later `train_step` on this rank (forward, backward, optimizer step,
        communication wait) into ``timer``, a `colo.apps.booster.timing.StepTimer` (``None``: stop timing). Off by
        default: nothing is timed."""
        self._require_engine().set_timer(timer)

    def memory_breakdown(self) -> dict[str, int]:
        """This rank's memory by kind, in bytes: the model state the plugin holds (`Engine.state_bytes`: ``params``,
        ``grads``, ``optimizer_states``; under Gemini each tier's use as ``tier_<name>``) and, on CUDA, the
        allocator's ``allocated``, ``cached`` (reserved but not allocated) and ``activations_estimate`` (the peak
        allocated since the last reset minus the model state: activations and temporaries, smaller than that when
        model state lives on the host)."""
        engine = self._require_engine()
        breakdown = dict(engine.state_bytes())
        device = next((p.device for p in engine.model.parameters() if p.device.type != "meta"), None)
        if device is not None and device.type == "cuda":
            allocated = torch.cuda.memory_allocated(device)
            model_state = sum(breakdown.get(kind, 0) for kind in ("params", "grads", "optimizer_states"))
            breakdown["allocated"] = allocated
            breakdown["cached"] = torch.cuda.memory_reserved(device) - allocated
            breakdown["activations_estimate"] = max(0, torch.cuda.max_memory_allocated(device) - model_state)
        return breakdown

    def unwrap(self) -> torch.nn.Module:
        """The boosted model without the plugin's wrapper (DDP's), its parameters current: a parameter all-gather
        still in flight after a step (ZeRO 1/2 overlap it with the next forward) has landed.

        ``train_step`` returns with that gather in flight; reads through the model `boost` returned wait for it
        themselves (``model.parameters()``, ``state_dict()``), direct attribute reads do not. With a pipeline it is this
        rank's stage (or a `ModuleList` of its model chunks); under ``Zero(stage=3)`` and `Gemini` the parameters
        live in shards outside a forward: read them from a checkpoint (`save`) instead.
        """
        return self._require_engine().unwrap()

    @torch.no_grad()
    def full_state_dict(self, *, to_rank: int | None = None) -> dict[str, torch.Tensor]:
        """The boosted model's whole weights, named as ``unwrap().state_dict()`` names them: the fp32 masters of the
        trainable parameters where the plugin keeps masters (mixed precision), the frozen ones as stored, and the
        persistent buffers. E.g. the weights to sample from, or to load into an unsharded copy of the model.

        Every rank calls it: where the plugin shards parameters over the data ranks (`Zero`, `Gemini`) the chunks
        are all-gathered one at a time, so besides the result a rank holds at most one gathered chunk.

        Args:
            to_rank (int | None): only this global rank keeps the weights (the others return ``{}`` and never hold
                more than one chunk); ``None``: every rank gets them. Default: ``None``.

        Returns:
            dict[str, torch.Tensor]: fresh tensors (not views of the model's), on the compute device.

        Raises:
            ValueError: the plugin splits the model itself (tensor, pipeline or expert parallelism): each rank
                holds pieces; read the weights from a checkpoint (`save`) instead.
        """
        import torch.distributed as dist

        from colo.comm import all_gather
        from colo.zero import ChunkOptimizer

        engine = self._require_engine()
        mesh, optimizer = engine.mesh, engine.optimizer
        data_axes = self.plugin.data_axes(mesh)
        split = [f"{axis}={size}" for axis, size in mesh.shape.items() if size > 1 and axis not in data_axes]
        if split or not isinstance(optimizer, ChunkOptimizer | torch.optim.Optimizer):
            layout = ", ".join(split) or type(optimizer).__name__
            raise ValueError(
                f"Booster.full_state_dict: under {type(self.plugin).__name__} ({layout}) each rank holds pieces of "
                "the model; save a checkpoint (booster.save) and read it with colo.tensor.checkpoint.load_checkpoint"
            )
        keep = to_rank is None or dist.get_rank() == to_rank
        module = engine.unwrap()  # waits for a parameter all-gather in flight (ZeRO 1/2)
        result: dict[str, torch.Tensor] = {}
        if isinstance(optimizer, ChunkOptimizer):
            optimizer.before_checkpoint()
            for chunk in optimizer.chunks:
                shard = optimizer.shard_tensors(chunk)["master"].to(optimizer.device).contiguous()
                full = shard if optimizer.num_shards == 1 else all_gather(shard, group=optimizer.group)
                if keep:
                    for slot in chunk.slots:
                        result[slot.name] = chunk.slot_view(full, slot).clone()
        elif keep:
            result = {name: param.detach().clone() for name, param in module.named_parameters()}
        if keep:
            for prefix, owner in module.named_modules():
                for name, buffer in owner.named_buffers(recurse=False):
                    if name not in owner._non_persistent_buffers_set:
                        result[f"{prefix}.{name}" if prefix else name] = buffer.detach().clone()
        return result

    @torch.no_grad()
    def eval_step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The loss of ``batch`` (this data-parallel rank's rows), forward only, for every plugin: the model's own
        forward and loss (or the boost ``criterion``) weighted as a training step weights it, and with a pipeline
        the stages' forward-only schedule (every rank of the pipeline gets the loss; the batch's size must divide
        by `eval_microbatches`). Average it over the data ranks with `mean_over_data_ranks`."""
        return self._require_engine().eval_loss(dict(batch))

    @property
    def eval_microbatches(self) -> int:
        """What the size of an `eval_step` batch must divide by (a pipeline's ``num_microbatches``, else 1)."""
        return self._require_engine().eval_microbatches

    def forward(self, batch: Mapping[str, torch.Tensor]):
        """The boosted model's output on one microbatch, as a training step calls it. For criteria-driven evaluation
        (reward models, DPO) that needs the raw output. With pp > 1 the boost criterion must run under a pipeline
        (`colo.apps.booster.PipelineCriterion`): the stages run forward only and every rank gets the criterion's
        ``pipeline_outputs`` (else use `eval_step`)."""
        return self._require_engine().forward(dict(batch))

    def frozen_copy(
        self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None
    ) -> torch.nn.Module:
        """``model`` laid out as the boosted model is, loaded with ``state_dict`` and frozen: e.g. the frozen
        reference policy of GRPO and PPO, which must compute with the same shards as the policy it is compared with.

        ``model`` is built as the boosted model was before `boost` (unsharded; on the meta device for a plugin that
        materializes meta models, `HybridParallel`). Under a plugin with a model plan the plan is applied on the
        booster's mesh (each rank materializes only its tensor-parallel shards); other plugins keep it whole. No
        optimizer and no data-parallel sharding: every data-parallel rank holds its whole copy (of its shards).

        Args:
            model (torch.nn.Module): the unsharded model, changed in place.
            state_dict (Mapping[str, torch.Tensor] | None): the values to load, in the boosted model's layout (e.g.
                `colo.apps.generation.RolloutEngine.full_state_dict`, or a file of them); ``None``: keep the values
                the plan materialized. Default: ``None``.

        Returns:
            torch.nn.Module: ``model``, with no parameter requiring gradients, in eval mode.

        Under a pipeline (``pp > 1``) the copy is pipelined too: this rank's stages of ``model``, cut and laid out by
        the plan as the policy's are, loaded with their part of ``state_dict`` (the whole model's names), and run
        forward only through the stages by an executor of their own (`FrozenPipeline`): called like the boosted
        model, it returns the boost criterion's ``pipeline_outputs`` on every rank (e.g. a frozen reference's
        per-token log-probs).

        Raises:
            ValueError: a pipeline whose boost criterion is not a `PipelineCriterion`, or a meta-device model under a
                plugin that does not materialize one.
        """
        engine = self._require_engine()
        plan = getattr(engine, "plan", None)
        if getattr(self.plugin, "pp", 1) > 1:
            from .frozen_pipeline import frozen_pipeline

            return frozen_pipeline(engine, model, state_dict)
        if plan is not None:
            plan.apply(model, mesh=engine.mesh, plugin=self.plugin)
        elif any(p.is_meta for p in model.parameters()):
            raise ValueError(
                f"Booster.frozen_copy: {type(self.plugin).__name__} does not materialize a meta-device model; build "
                "the copy on a real device"
            )
        if state_dict is not None:
            model.load_state_dict(state_dict)
        model.requires_grad_(False)
        return model.eval()

    def mean_over_data_ranks(self, value: torch.Tensor | float) -> float:
        """The mean of a scalar over the data-parallel ranks (one tiny all-reduce; every rank calls it)."""
        return self._require_engine().mean_over_data_ranks(torch.as_tensor(value, dtype=torch.float64))

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the plugin (loss scaling, gradient hooks) for a hand-written loop without pipelines."""
        self._require_engine().backward(loss)

    def no_sync(self):
        """A context in which backward accumulates gradients without communication."""
        return self._require_engine().no_sync()

    # --- checkpoints ------------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike, *, metadata: dict | None = None, asynchronous: bool = False):
        """Save model, optimizer, LR scheduler and step count to the new checkpoint directory ``path``.

        Every rank calls it; each writes only what it owns (colo.tensor.checkpoint's format), so the checkpoint
        loads under another plugin or layout. With ``asynchronous`` the state is copied to host staging buffers and
        written and committed (renamed into place) by a background thread while training goes on
        (`colo.tensor.checkpoint.AsyncCheckpointer`, on a process group of its own): the call returns a
        `SaveHandle`; at most one save is in flight (the next one waits for it), a background failure is raised by
        the next `save` or by `wait_for_saves`, and `load` waits first. Call `wait_for_saves` before reading the
        checkpoint or ending the job.
        """
        engine = self._require_engine()
        checkpointer = None
        if asynchronous:
            if self._checkpointer is None:  # every rank gets here at the same save: it creates a process group
                from colo.tensor.checkpoint import AsyncCheckpointer

                self._checkpointer = AsyncCheckpointer()
            checkpointer = self._checkpointer
        booster_state = {"step": self.step_count, "plugin": type(self.plugin).__name__}
        if self.lr_scheduler is not None:
            state = self.lr_scheduler.state_dict()
            try:
                json.dumps(state)
            except (TypeError, ValueError) as error:
                raise TypeError(
                    f"the LR scheduler's state_dict is not JSON ({error}); colo checkpoints hold no pickle: use a "
                    "scheduler whose state is numbers and lists (LambdaLR with plain functions drops them)"
                ) from None
            booster_state["lr_scheduler"] = state
        with region(lambda: f"colo.checkpoint save{' (async copy)' if asynchronous else ''}"):
            return engine.save(
                os.fspath(path), metadata={**(metadata or {}), BOOSTER_KEY: booster_state}, checkpointer=checkpointer
            )

    def wait_for_saves(self) -> None:
        """Wait until the background save in flight (if any) is committed, and close the background checkpointer
        (raises the save's error, if it failed). Every rank calls it; a later asynchronous save starts a new one."""
        if self._checkpointer is not None:
            checkpointer, self._checkpointer = self._checkpointer, None
            checkpointer.close()

    def load(self, path: str | os.PathLike) -> dict:
        """Load a checkpoint written by `save` (under any plugin or layout); returns its metadata."""
        self.wait_for_saves()
        engine = self._require_engine()
        metadata = engine.load(os.fspath(path))
        booster_state = metadata.get(BOOSTER_KEY, {})
        self.step_count = booster_state.get("step", 0)
        if self.lr_scheduler is not None and "lr_scheduler" in booster_state:
            self.lr_scheduler.load_state_dict(booster_state["lr_scheduler"])
        return metadata


def _check_same_batch(batch: Mapping[str, torch.Tensor], *, mesh, sample_axes: tuple[str, ...]) -> None:
    """Raise a `ValueError` on every rank unless the ranks that share samples (equal coordinates on
    ``sample_axes``) hold the same batch: its integer and boolean tensors (token ids, labels, masks, positions),
    compared by shape, dtype and `colo.comm.debug.fingerprint` in one exchange over their group. Float tensors
    (features computed on each rank) are left out."""
    axes = tuple(axis for axis in mesh.axis_names if axis not in sample_axes and mesh.size(axis) > 1)
    if not axes or not isinstance(batch, Mapping):
        return
    group = mesh.group(*axes)
    summary = {
        key: (tuple(value.shape), str(value.dtype), fingerprint(value))
        for key, value in sorted(batch.items())
        if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex())
    }
    everyone = exchange(summary, group, "Booster.train_step batch check")
    differing = {}
    for key in sorted(set().union(*everyone)):
        differ = disagreement([summary.get(key) for summary in everyone], group)
        if differ is not None:
            differing[key] = differ
    if not differing:
        return
    shown = "; ".join(f"{key!r}: {differ}" for key, differ in differing.items())
    kind = "/".join(axes)
    raise ValueError(
        f"Booster.train_step: the ranks of the {kind} group {group.describe()} split the work of one batch and must "
        f"all be given the same one, but they got different batches ({shown}). Give every rank of a {kind} group "
        "the same batch: draw it with the same seed on each rank, or load it on the group's first rank and "
        f"broadcast it (colo.comm.broadcast); only ranks that differ on {'/'.join(sample_axes)} take different "
        "batches (plugin.prepare_dataloader shards a dataset that way)"
    )


def _execution_order(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> list[str]:
    """`colo.zero.execution_order` of ``model`` on ``batch``, rank 0's on every rank (chunks must be packed alike)."""
    from colo.comm import broadcast_object, init_distributed
    from colo.zero import execution_order

    if any(param.is_meta for param in model.parameters()):
        raise ValueError("Booster.boost(example_batch=...) runs the model once: build it on a real device, not meta")
    init_distributed()
    return broadcast_object(execution_order(model, **batch), src=0)
