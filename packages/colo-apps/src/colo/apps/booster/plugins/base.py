"""What every plugin shares: its common settings, and the `Engine` it builds to run steps for the `Booster`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from colo.comm import Group, Mesh, all_reduce, init_distributed
from colo.comm import traced as traced_collectives
from colo.comm.algorithms import current_table
from colo.tensor.checkpoint import save_checkpoint

from ...checkpointing import MODES as CHECKPOINTING_MODES
from ...checkpointing import apply_activation_checkpointing, find_blocks
from ..precision import check_precision
from ..replicas import comm_device
from ..timing import StepTimer, phase
from .runner import MicrobatchRunner


@dataclass(frozen=True)
class StepResult:
    """What `Booster.train_step` did.

    Attributes:
        loss: the step's loss: the mean over microbatches and data-parallel ranks.
        grad_norm: the global gradient norm before clipping (``inf`` when the step overflowed).
        skipped: whether the optimizer step was skipped (an fp16 overflow); the LR scheduler did not step either.
        lr: the learning rate of the first param group after the step.
        num_microbatches: how many microbatches the batch was split into.
    """

    loss: float
    grad_norm: float | None
    skipped: bool
    lr: float | None
    num_microbatches: int


LOSS_WEIGHTINGS = ("microbatch", "token")


@dataclass(kw_only=True)
class Plugin:
    """Settings every plugin has; subclasses add their own and build an `Engine` in `configure`."""

    materializes_meta_models: ClassVar[bool] = False
    """Whether `configure` takes a model built on the meta device and materializes only this rank's shards (from
    the plugin's seed or the plan's materialize function); other plugins need the whole model in memory."""
    packs_chunks: ClassVar[bool] = False
    """Whether `configure` packs parameters into chunks (ZeRO-3 / Gemini gather them per chunk): then
    `Booster.boost(example_batch=...)` records the order a forward uses them and passes it as ``param_order``."""

    precision: str = "fp32"
    """Compute precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (fp16 with dynamic loss scaling)."""
    num_microbatches: int = 1
    """Microbatches per `Booster.train_step`: gradient accumulation, or the pipeline's microbatches."""
    max_grad_norm: float | None = None
    """Clip gradients to this global norm (``None``: no clipping; the norm is still reported)."""
    compile_blocks: bool = False
    """`torch.compile` every block of the model (the children of its ``layers``, or its stacks of same-typed blocks
    as `colo.apps.checkpointing.find_blocks` finds them: the diffusion transformer's), after parallelization, with
    ``fullgraph=True`` wherever a block is one graph, so that a graph break is an error rather than a silent
    slowdown: colo.kernels' ops are torch operators (``torch.ops.colo.*``) and, in compiled code, colo.comm's
    collectives are torch's functional collectives (`colo.comm.traced`), so a block with tensor parallelism (1D or
    the 2D / 2.5D / 3D grids), Megatron sequence parallelism or Ulysses inside is one graph too. Two keep
    ``fullgraph=False`` and run as graphs between eager steps: ring attention (its point-to-point exchanges, which
    dynamo traces only behind an experimental switch) and Gemini (its chunk hooks move parameters between tiers).
    ZeRO-3's per-block gathers cannot be traced: `Zero` and `HybridParallel` refuse it with stage 3."""
    compile_options: dict | None = None
    """Keyword arguments for `torch.compile` (``{"backend": "aot_eager"}``, ``{"mode": "max-autotune"}``...);
    ``"fullgraph"`` given here overrides the choice above."""
    activation_checkpointing: str | None = None
    """Activation checkpointing of the model's blocks (`colo.apps.apply_activation_checkpointing`), after
    parallelization and before compilation: ``"full"`` (keep block inputs, recompute the block), ``"selective"``
    (keep matmul and attention outputs too), ``"offload"`` (keep saved activations in host memory); ``None``: off."""
    activation_checkpointing_every: int = 1
    """Checkpoint every k-th block only (``1``: every block)."""
    loss_weighting: str = "microbatch"
    """How a step's microbatch losses combine: ``"microbatch"`` (every microbatch's mean weighs the same, on every
    data-parallel rank) or ``"token"`` (every labelled token of the step weighs the same: each microbatch's mean is
    weighted by its count of labelled next-token targets over the step's total on all data-parallel ranks, one
    all-reduce of a scalar per step; for padded or masked rows such as SFT). ``"token"`` needs ``labels`` in the
    batch (``labels[:, 1:]`` are the targets, ``-100`` ignored) and a model without a pipeline."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        self.compute_dtype = check_precision(name, self.precision)
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ValueError(f"{name}.num_microbatches={self.num_microbatches!r} must be a positive integer")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"{name}.max_grad_norm={self.max_grad_norm!r} must be positive, or None for no clipping")
        if self.activation_checkpointing not in (None, *CHECKPOINTING_MODES):
            raise ValueError(
                f"{name}.activation_checkpointing={self.activation_checkpointing!r} is unknown; use one of "
                f"{CHECKPOINTING_MODES} or None"
            )
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"{name}.loss_weighting={self.loss_weighting!r} is unknown; use one of {LOSS_WEIGHTINGS}")
        every = self.activation_checkpointing_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"{name}.activation_checkpointing_every={every!r} must be a positive integer")

    def maybe_checkpoint_activations(self, model: torch.nn.Module) -> None:
        """Apply ``activation_checkpointing`` to ``model``'s blocks in place, when set (before `maybe_compile`)."""
        if self.activation_checkpointing is not None:
            apply_activation_checkpointing(
                model, mode=self.activation_checkpointing, every=self.activation_checkpointing_every
            )

    def maybe_compile(self, model: torch.nn.Module) -> None:
        """Compile each block of ``model`` in place when ``compile_blocks`` is set (torchtitan's per-block compile:
        one graph per block type, reused by every layer, with the parallel layers' collectives inside)."""
        if not self.compile_blocks:
            return
        layers = getattr(model, "layers", None)
        if isinstance(layers, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            blocks = list(layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers)
        else:  # another model's stack of same-typed blocks (the diffusion transformer's transformer_blocks)
            blocks = [block for _, block in find_blocks(model)]
        if not blocks:
            raise ValueError(
                f"{type(self).__name__}.compile_blocks needs the model's blocks in a `layers` ModuleList or "
                "ModuleDict, or a stack of same-typed blocks (`colo.apps.checkpointing.find_blocks`); "
                f"{type(model).__name__} has none: compile the model yourself before boosting it"
            )
        # a block is one graph, the plan's collectives inside it included, unless ring attention exchanges its
        # key/value chunks point to point inside it (dynamo breaks the graph at each P2POp unless
        # torch._dynamo.config.enable_p2p_compilation, experimental, is set) or the plugin's parameter hooks inside
        # it must run eagerly (Gemini)
        fullgraph = self.blocks_trace_whole and getattr(self, "sp_mode", None) != "ring"
        if not traced_collectives.TRACEABLE:  # older torch: the plan's collectives break the graph (eager)
            fullgraph = fullgraph and getattr(self, "tp", 1) == 1 and getattr(self, "sp", 1) == 1
        options = {"fullgraph": fullgraph, **(self.compile_options or {})}
        current_table()  # the collectives' algorithm table, loaded now: compiled code only reads it
        for block in blocks:
            block.compile(**options)

    blocks_trace_whole: ClassVar[bool] = True
    """Whether a block, hooks included, can be one graph (`maybe_compile`); ``False`` where the plugin's parameter
    hooks inside the blocks must run eagerly, between graphs."""

    def mesh_shape(self, world_size: int) -> dict[str, int]:
        """The mesh axes and sizes this plugin runs on (validated against ``world_size`` before any collective)."""
        return {"dp": world_size}

    def build_mesh(self) -> Mesh:
        """Initialise torch.distributed if needed and build the plugin's mesh."""
        init_distributed()
        return Mesh(**self.mesh_shape(dist.get_world_size()))

    def configure(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, criterion=None, param_order=None
    ) -> Engine:
        """Wrap ``model`` and ``optimizer`` for this plugin; returns the engine that runs steps. ``param_order``
        (parameter names in the order a forward uses them, `colo.zero.execution_order`) is the chunk packing order
        of the plugins that pack chunks (`Zero`, `Gemini`); the others ignore it."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure()")

    def prepare_dataloader(self, dataset, *, batch_size: int, shuffle: bool = True, seed: int = 0, **kwargs):
        """A `DataLoader` whose `DistributedSampler` gives each data-parallel rank its own part of ``dataset``."""
        from torch.utils.data import DataLoader, DistributedSampler

        mesh = self.build_mesh()
        group = mesh.group(*self.sample_axes(mesh))
        sampler = DistributedSampler(
            dataset, num_replicas=group.size, rank=group.rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)

    def data_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """The mesh axes gradients and the reported loss are averaged over."""
        return ("dp",)

    def sample_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """The mesh axes over which ranks get different samples (sequence-parallel ranks share theirs)."""
        return self.data_axes(mesh)


class Engine:
    """Runs steps for one plugin: an optimizer driver (backward, gradient sync, clipping, the optimizer step,
    checkpoint state) and a runner (`runner`: what turns a step's batch into forwards and backwards).

    Subclasses implement `backward`, `no_sync`, `step`, `zero_grad`, `checkpoint_state` and `load` (the chunk
    optimizers' through `OptimizerDriver`); `train_step` runs ``runner.forward_backward`` and then `step`, whatever
    the runner (the microbatch loop by default, a pipeline schedule for ``pp > 1``).
    """

    def __init__(
        self,
        plugin: Plugin,
        *,
        model: torch.nn.Module,
        optimizer,
        mesh: Mesh,
        criterion: Callable | None,
        sync_every_microbatch: bool,
    ) -> None:
        self.plugin = plugin
        self.model = model
        self.optimizer = optimizer
        self.mesh = mesh
        self.criterion = criterion
        self.sync_every_microbatch = sync_every_microbatch
        self.data_group: Group = mesh.group(*plugin.data_axes(mesh))
        self.expected_names: list[str] | None = None
        """The checkpoint names of the whole model (`colo.apps.booster.checkpoint_manifest`, set by the Booster):
        every checkpoint must hold them, whichever ranks hold which parameters."""
        self.runner = MicrobatchRunner(self)
        """What a step runs before the optimizer step (`colo.apps.booster.plugins.runner`): the microbatch loop here;
        a pipeline engine puts a `PipelineRunner` in its place."""
        self.timer: StepTimer | None = None
        """Times the phases of each step when set (`set_timer`); ``None``: nothing is timed."""

    def set_timer(self, timer: StepTimer | None) -> None:
        """Time every later step's phases with ``timer`` (``None``: stop timing), the pipeline's actions too."""
        self.timer = timer
        executor = getattr(self.runner, "executor", None)
        if executor is not None:
            executor.timer = timer

    # --- per plugin ---------------------------------------------------------------------------------------------

    def forward(self, micro: Mapping[str, torch.Tensor]):
        """Call the model on one microbatch (``model(**micro)``)."""
        return self.model(**micro)

    @property
    def eval_microbatches(self) -> int:
        """How many microbatches `eval_loss` splits a batch into (a batch's size must divide by it)."""
        return self.runner.eval_microbatches

    def eval_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of ``batch`` on this rank, forward only (the caller disables gradients), as the runner computes
        it (`MicrobatchRunner.evaluate`, `PipelineRunner.evaluate`)."""
        return self.runner.evaluate(batch)

    def prepare_micro(self, micro: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
        """This rank's part of a microbatch and the weight of its loss (sequence parallelism splits sequences)."""
        return micro, 1.0

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def no_sync(self):
        raise NotImplementedError

    def step(self) -> tuple[float | None, bool]:
        """Sync what is left, clip to ``plugin.max_grad_norm``, step; returns ``(grad norm, skipped)``."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def checkpoint_state(self) -> tuple[dict, dict]:
        raise NotImplementedError

    def save(self, path: str, *, metadata: dict, checkpointer=None):
        """Save model and optimizer state with ``metadata`` through `colo.tensor.checkpoint` (every rank): in the
        foreground, or with a `colo.tensor.checkpoint.AsyncCheckpointer` in its background thread (then the
        `SaveHandle` is returned once this rank's pieces are copied)."""
        tensors, own = self.checkpoint_state()
        if checkpointer is not None:
            return checkpointer.save(path, tensors, metadata={**metadata, **own}, expected_names=self.expected_names)
        save_checkpoint(path, tensors, metadata={**metadata, **own}, expected_names=self.expected_names)
        return None

    def load(self, path: str) -> dict:
        raise NotImplementedError

    def wait_params(self) -> None:
        """Wait for parameter updates still in flight after a step (none here; ZeRO 1/2 overlap their gather)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, by kind (each storage counted once): ``params`` (the module's
        parameters), ``grads`` (their gradients: under DDP the reducer's buckets they are views of) and
        ``optimizer_states`` (the torch optimizer's state tensors). The chunk optimizers' engines report their own
        buffers (`OptimizerDriver.state_bytes`)."""
        seen: set[int] = set()

        def nbytes(tensors) -> int:
            total = 0
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if tensor.device.type != "meta" and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        params = list(self.model.parameters())
        states = [
            value
            for state in self.torch_optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        return {
            "params": nbytes(params),
            "grads": nbytes(p.grad for p in params if p.grad is not None),
            "optimizer_states": nbytes(states),
        }

    def unwrap(self) -> torch.nn.Module:
        """The model without the plugin's wrapper, its parameters current (`wait_params`)."""
        self.wait_params()
        model = self.model
        return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer whose param groups carry the learning rates."""
        return self.optimizer

    # --- shared -------------------------------------------------------------------------------------------------

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> tuple[float, float | None, bool]:
        """One optimizer step over ``batch``: the runner's forwards and backwards, then the driver's step; returns
        ``(mean loss over data ranks, grad norm, skipped)``."""
        loss = self.runner.forward_backward(batch)
        with phase(self.timer, "optimizer"):
            grad_norm, skipped = self.step()
            self.zero_grad()
        with phase(self.timer, "comm_wait", "colo.loss all-reduce"):
            return self.mean_over_data_ranks(loss), grad_norm, skipped

    def mean_over_data_ranks(self, value: torch.Tensor) -> float:
        """The mean of a scalar over the data-parallel ranks (one tiny all-reduce)."""
        if self.data_group.size == 1:
            return float(value)
        reduced = value.reshape(1).to(comm_device(self.data_group))
        all_reduce(reduced, group=self.data_group)
        return float(reduced.item()) / self.data_group.size
