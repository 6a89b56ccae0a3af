"""`Layout`: one way to run a training step (plugin, parallel degrees, ZeRO stage, checkpointing, microbatches,
precision) as the planner models it, checked by the plugins' own rules before anything is modelled."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PLUGINS = ("ddp", "zero", "gemini", "hybrid", "expert")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A parallel layout of one training step, per data-parallel replica and per rank.

    ``plugin`` says which Booster plugin runs it: ``"ddp"`` (torch DDP), ``"zero"`` (`Zero`, ZeRO over every
    rank), ``"gemini"`` (`Gemini`, every chunk on the device), ``"hybrid"`` (`HybridParallel`: tp x pp x sp x dp
    with ZeRO 0-3) or ``"expert"`` (`ExpertParallel`: a mixture-of-experts model on a ``dp x ep`` mesh, its experts
    split over ``ep``, ZeRO 0-2 with the dense chunks sharded over ``dp x ep`` and the expert chunks over ``dp``).
    ``zero_stage`` is the ZeRO stage of ``zero``, ``hybrid`` and ``expert`` (3 for ``gemini``, ignored by ``ddp``).
    """

    plugin: str = "hybrid"
    """``ddp``, ``zero``, ``gemini``, ``hybrid`` or ``expert``."""
    dp: int = 1
    """Data-parallel degree (``expert``: the mesh's ``dp`` axis; the data ranks are ``dp * ep``)."""
    ep: int = 1
    """Expert-parallel degree (``expert`` or ``hybrid`` plugin): each MoE layer's experts split over ``ep`` data
    ranks (the data ranks are ``dp * ep``; under ``hybrid`` the mesh is ``(pp, dp, ep, sp, tp)``); it must divide
    the number of experts (checked with the model, `colo.apps.plan.memory.check_layout`)."""
    expert_tensor_parallel: bool = False
    """``hybrid`` with ``tp > 1`` and ``ep``: each expert's FFN split over tp too (`HybridParallel`'s field)."""
    tp: int = 1
    """Tensor-parallel degree (Megatron 1D; hybrid only)."""
    pp: int = 1
    """Pipeline stages (hybrid only)."""
    sp: int = 1
    """Sequence-parallel degree of Ulysses / ring attention (hybrid only; Megatron-SP runs on tp). A
    mixture-of-experts model takes Ulysses or ring with ``ep > 1`` and ``pp=1`` (mesh ``(dp, ep, sp, tp)``)."""
    sp_mode: str | None = None
    """``None``, ``"megatron"``, ``"ulysses"`` or ``"ring"``."""
    zero_stage: int = 1
    """ZeRO stage (0-3) of ``zero`` / ``hybrid``."""
    precision: str = "bf16"
    """Compute precision: ``fp32``, or ``bf16`` / ``fp16`` with fp32 masters."""
    activation_checkpointing: str | None = None
    """``None``, ``"full"``, ``"selective"`` or ``"offload"`` (every block)."""
    micro_batch_size: int = 1
    """Sequences per microbatch per data-parallel rank."""
    num_microbatches: int = 1
    """Microbatches per step (gradient accumulation; the pipeline's microbatches)."""
    schedule: str = "1f1b"
    """Pipeline schedule (a `colo.pipeline.GENERATORS` name)."""
    num_model_chunks: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B)."""
    chunk_numel: int | None = None
    """ZeRO chunk capacity (``None``: colo's padding search)."""
    offload_optimizer: bool = False
    """ZeRO-Offload (``zero`` plugin): masters, gradient shards and optimizer state on the host."""
    check_plugin: bool = dataclasses.field(default=True, compare=False, repr=False)
    """Run the plugin's own checks (``False`` models a layout colo does not run, such as a published FSDP2 run
    with selective checkpointing; `benchmarks/plan_validation.py` uses it)."""

    def __post_init__(self) -> None:
        if self.plugin not in PLUGINS:
            raise ValueError(f"Layout.plugin={self.plugin!r} is unknown; use one of {PLUGINS}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Layout.precision={self.precision!r} is unknown; use one of {PRECISIONS}")
        for name in ("dp", "ep", "tp", "pp", "sp", "micro_batch_size", "num_microbatches", "num_model_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name}={value!r} must be a positive integer")
        if self.plugin != "hybrid" and (self.tp, self.pp, self.sp) != (1, 1, 1):
            raise ValueError(
                f"Layout: tp/pp/sp need plugin='hybrid' (got plugin={self.plugin!r}); the expert plugin composes "
                "experts with data parallelism only (plugin='hybrid' with ep composes them with tp and pp)"
            )
        if self.ep > 1 and self.plugin not in ("expert", "hybrid"):
            raise ValueError(f"Layout.ep={self.ep} needs plugin='expert' or 'hybrid' (got plugin={self.plugin!r})")
        if self.expert_tensor_parallel and (self.plugin != "hybrid" or self.tp == 1):
            raise ValueError(
                "Layout.expert_tensor_parallel=True splits each expert's FFN over tp: it needs plugin='hybrid' and "
                f"tp > 1 (got plugin={self.plugin!r}, tp={self.tp}); set it False"
            )
        # the plugin's own checks (sizes, modes, unsupported combinations), naming the field; a pipeline checks its
        # schedule by building it, so a long step is checked at pp microbatches when that is equivalent (every
        # schedule accepts a multiple of pp that is at least pp)
        if not self.check_plugin:
            return
        microbatches = self.num_microbatches
        if self.pp > 1 and microbatches > self.pp and microbatches % self.pp == 0:
            microbatches = self.pp
        self.plugin_object(num_microbatches=microbatches)

    @property
    def world_size(self) -> int:
        """Ranks the layout runs on: ``dp * ep * tp * pp * sp``."""
        return self.dp * self.ep * self.tp * self.pp * self.sp

    @property
    def stage(self) -> int:
        """The ZeRO stage the chunk optimizer runs (``-1``: torch DDP, no chunks)."""
        return {"ddp": -1, "gemini": 3}.get(self.plugin, self.zero_stage)

    @property
    def data_ranks(self) -> int:
        """Ranks ZeRO shards the dense parameters over: ``dp * sp`` (Ulysses and ring attention replicate the weights
        over sp), ``dp * ep * sp`` under expert parallelism (the experts' chunks are sharded over ``dp * sp``)."""
        return self.dp * self.sp * self.ep

    @property
    def compute_bytes(self) -> int:
        """Bytes of one element in the compute precision."""
        return 4 if self.precision == "fp32" else 2

    def replace(self, **changes) -> Layout:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def plugin_fields(self) -> dict:
        """The run config's ``plugin`` section for this layout (`colo.apps.train.config`)."""
        common = {"precision": self.precision}
        if self.activation_checkpointing is not None:
            common["activation_checkpointing"] = self.activation_checkpointing
        if self.plugin == "ddp":
            return {"name": "ddp", **common}
        chunk = {} if self.chunk_numel is None else {"chunk_numel": self.chunk_numel}
        if self.plugin == "zero":
            offload = {"offload_optimizer": True} if self.offload_optimizer else {}
            return {"name": "zero", "stage": self.zero_stage, **offload, **chunk, **common}
        if self.plugin == "gemini":
            return {"name": "gemini", **chunk, **common}
        if self.plugin == "expert":
            return {"name": "expert", "ep": self.ep, "stage": self.zero_stage, **chunk, **common}
        fields = {"name": "hybrid", "tp": self.tp, "pp": self.pp, "sp": self.sp, "zero_stage": self.zero_stage}
        if self.sp_mode is not None:
            fields["sp_mode"] = self.sp_mode
        if self.ep > 1:
            fields["ep"] = self.ep
        if self.expert_tensor_parallel:
            fields["expert_tensor_parallel"] = True
        if self.pp > 1:
            fields.update(schedule=self.schedule, num_model_chunks=self.num_model_chunks)
        return {**fields, **chunk, **common}

    def plugin_object(self, *, num_microbatches: int | None = None):
        """The Booster plugin this layout describes (built, so its validation runs; no collective)."""
        from ..booster import DDP, ExpertParallel, Gemini, HybridParallel, Zero

        fields = self.plugin_fields()
        name = fields.pop("name")
        cls = {"ddp": DDP, "zero": Zero, "gemini": Gemini, "hybrid": HybridParallel, "expert": ExpertParallel}[name]
        if name == "hybrid":  # HybridParallel's dp counts every data rank, ep an inner factor of them
            fields["dp"] = self.dp * self.ep
        return cls(**fields, num_microbatches=num_microbatches or self.num_microbatches)

    def describe(self) -> str:
        """A short name: ``hybrid dp4 tp8 pp2 zero1 ckpt=full mb1x8 bf16``."""
        parts = [self.plugin, f"dp{self.dp}"]
        parts += [f"{axis}{getattr(self, axis)}" for axis in ("ep", "tp", "pp", "sp") if getattr(self, axis) > 1]
        if self.sp_mode:
            parts.append(self.sp_mode)
        if self.expert_tensor_parallel:
            parts.append("etp")
        if self.plugin in ("zero", "hybrid", "expert"):
            parts.append(f"zero{self.zero_stage}")
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.num_model_chunks}" if self.num_model_chunks > 1 else ""))
        if self.activation_checkpointing:
            parts.append(f"ckpt={self.activation_checkpointing}")
        parts.append(f"mb{self.micro_batch_size}x{self.num_microbatches}")
        parts.append(self.precision)
        return " ".join(parts)
