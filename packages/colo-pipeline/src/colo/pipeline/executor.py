"""`PipelineExecutor`: runs any valid `Schedule` on this rank's model chunks.

One training step: the batch is split into microbatches on the first stage's rank, the targets on the last
stage's rank; each rank then runs its action list. Communication actions are grouped into batches exactly as
`validate` and `simulate` see them: each batch's sends go out as one ``batch_send_recv`` over the mesh's
pipeline group and are left in flight until the end of the step, its receives as another that is waited for.
``B`` differentiates with respect to the stage's inputs only and ``W`` with respect to its weights (see
`colo.pipeline.backward`); ``BW`` is one ordinary backward. After the last action, gradients of parameters
tied across stages are summed over the ranks that hold them, then the user's ``on_backward_end`` callback
runs (data-parallel gradient sync goes there: ``W`` fires no gradient hooks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from colo.comm import Group, Mesh, P2POp, all_gather_object, all_reduce, batch_send_recv, broadcast, new_group
from colo.comm.regions import region

from .actions import Action, Schedule
from .backward import PendingWeightGrad, backward_input, backward_weight
from .p2p import META_BYTES, StageMeta, call_stage, empty_like_meta, flatten, split_microbatches, unflatten
from .validate import validate

_PHASES = {"F": "forward", "B": "backward", "BW": "backward", "W": "backward"}
"""What a compute action counts as in per-rank timing."""


@dataclass(frozen=True)
class PipelineStepResult:
    """What one `PipelineExecutor.step` did.

    Attributes:
        loss: mean of the microbatch losses (a 0-dim tensor) on the last stage's rank, and on every rank when
            the step ran with ``return_loss=True``; ``None`` elsewhere.
        actions: the actions this rank ran, in order (equal to the schedule's list for this rank).
        peak_live_activations: the most microbatch-chunks whose forward ran and whose weight gradient had not.
    """

    loss: torch.Tensor | None
    actions: tuple[Action, ...]
    peak_live_activations: int


@dataclass
class _Slot:
    """What one (microbatch, chunk) holds between its F and its W."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    meta: StageMeta | None = None
    pending: PendingWeightGrad | None = None


class PipelineExecutor:
    """Runs a pipeline `Schedule` on this rank's model chunks.

    Args:
        chunks: this rank's model chunk(s): one module, or ``schedule.num_chunks`` modules where chunk ``c``
            runs stage ``schedule.stages[pp_rank][c]``. A chunk is called as ``chunk(x)``, ``chunk(*tuple)`` or
            ``chunk(**dict)`` on what the previous stage returned (the first stage on a microbatch of the
            batch), and returns a tensor or a tuple, list or dict of tensors.
        schedule: the schedule; validated here, before any communication.
        mesh: the device mesh; the pipeline runs along ``axis``, whose size must be ``schedule.num_ranks``.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage's microbatch output (``loss_fn(output)``
            when the step gets no targets). Microbatch losses are averaged, so gradients equal those of the
            full batch for a mean-reduced loss. Required (on every rank, like every argument).
        axis: the mesh axis of the pipeline.
        tied_parameters: parameters shared between stages on different ranks, by name: ``{"embedding":
            wte.weight}`` on the first and the last stage. Every rank holding a name sums its gradient with the
            others after the step's last backward; their values are made equal (from the lowest rank) here.
        on_backward_end: called with no arguments after the step's last action and the tied-gradient sum:
            the place for data-parallel gradient sync (DDP, ZeRO).
        on_action: called with each action after it ran (for tests and profiling).
        device: where received tensors go; default: the device of the first chunk's first parameter, or CPU.
    """

    def __init__(
        self,
        chunks: nn.Module | Sequence[nn.Module],
        *,
        schedule: Schedule,
        mesh: Mesh,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        axis: str = "pp",
        tied_parameters: Mapping[str, nn.Parameter | Sequence[nn.Parameter]] | None = None,
        on_backward_end: Callable[[], None] | None = None,
        on_action: Callable[[Action], None] | None = None,
        device: torch.device | str | None = None,
    ):
        self.chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
        if axis not in mesh.axis_names:
            raise ValueError(f"axis={axis!r} is not an axis of the mesh, whose axes are {mesh.axis_names}")
        if mesh.size(axis) != schedule.num_ranks:
            raise ValueError(
                f"schedule {schedule.name!r} is for num_ranks={schedule.num_ranks} but the mesh axis {axis!r} has "
                f"size {mesh.size(axis)}; build the schedule with num_ranks={mesh.size(axis)}"
            )
        if len(self.chunks) != schedule.num_chunks:
            raise ValueError(
                f"got {len(self.chunks)} model chunk(s) but schedule {schedule.name!r} runs num_chunks="
                f"{schedule.num_chunks} per rank; pass one module per chunk"
            )
        validate(schedule)
        self.schedule = schedule
        self.rank = mesh.rank(axis)
        self.stages = schedule.stages[self.rank]
        self.last_stage = schedule.num_stages - 1
        if loss_fn is None:  # checked on every rank, so that no rank goes on to communicate alone
            raise ValueError(
                "loss_fn is required: pass loss_fn=lambda output, target: ... on every rank (the last stage runs it)"
            )
        self.loss_fn = loss_fn
        self.group = mesh.group(axis)
        self.on_backward_end = on_backward_end
        self.on_action = on_action
        if device is None:
            first = next(self.chunks[0].parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self._params = [[p for p in chunk.parameters() if p.requires_grad] for chunk in self.chunks]
        self._meta_recv: dict[int, StageMeta] = {}  # stage -> metadata of its input
        self._meta_sent: dict[int, StageMeta] = {}  # stage -> metadata of the input we send it
        self._ties = self._setup_ties(mesh, axis, tied_parameters or {})
        self.timer = None
        """An optional step timer (``timer.phase(kind, label)`` is a context timing its block as ``"forward"``,
        ``"backward"`` or ``"comm_wait"``), e.g. colo.apps's per-rank timing; ``None``: nothing is timed."""
        self.loss_scale = 1.0
        """The gradient the last stage's backward starts from (each microbatch's loss times ``loss_scale``): a
        dynamic loss scaler's current scale under fp16, set before each `step`; 1 otherwise."""

    # --- tied parameters ---------------------------------------------------------------------------------------

    def _setup_ties(
        self, mesh: Mesh, axis: str, tied: Mapping[str, Any]
    ) -> list[tuple[list[nn.Parameter], Group | None]]:
        local = {name: [p] if isinstance(p, torch.Tensor) else list(p) for name, p in tied.items()}
        for name, params in local.items():
            if any(p.shape != params[0].shape for p in params):
                raise ValueError(f"tied_parameters[{name!r}] holds parameters of different shapes on this rank")
        holders = all_gather_object(sorted(local), group=self.group)
        ties = []
        for name in sorted(local):
            members = [r for r, names in enumerate(holders) if name in names]
            params = list({id(p): p for p in local[name]}.values())
            group = None
            if len(members) == mesh.size(axis):
                group = self.group
            elif len(members) > 1:
                group = new_group([self.group.global_rank(r) for r in members], name=axis, local_synchronization=True)
            with torch.no_grad():
                if group is not None:
                    broadcast(params[0].data, src=0, group=group)
                for other in params[1:]:
                    other.data.copy_(params[0].data)
            if group is not None or len(params) > 1:
                ties.append((params, group))
        return ties

    def _sum_tied_grads(self) -> None:
        """Give every copy of a tied parameter the sum of all copies' gradients (here and on the other ranks)."""
        for params, group in self._ties:
            total = torch.zeros_like(params[0])
            for param in params:
                if param.grad is not None:
                    total += param.grad
            if group is not None:
                all_reduce(total, group=group)
            for param in params:
                param.grad = total.clone() if param.grad is None else param.grad.copy_(total)

    # --- one step -----------------------------------------------------------------------------------------------

    def step(self, inputs: Any = None, targets: Any = None, *, return_loss: bool = True) -> PipelineStepResult:
        """Run one training step's forwards and backwards (the optimizer step is the caller's).

        Args:
            inputs: the batch (tensor, tuple, list or dict of tensors, batch on dim 0); used on the first
                stage's rank, ignored elsewhere.
            targets: what ``loss_fn`` compares against, split like ``inputs``; used on the last stage's rank.
            return_loss: broadcast the loss from the last stage so every rank returns it.

        Returns:
            A `PipelineStepResult`. Gradients are accumulated into the chunks' parameters' ``.grad``.
        """
        m = self.schedule.num_microbatches
        self._microbatches: list[Any] | None = None
        self._targets: list[Any] | None = None
        # Split wherever the batch is given (every rank, in a typical SPMD script), so a bad batch fails on every
        # rank before any communication; only the first and the last stage use the pieces.
        if inputs is not None:
            self._microbatches = split_microbatches(inputs, m, name="inputs")
        elif 0 in self.stages:
            raise ValueError(f"pp rank {self.rank} runs the first stage: pass the batch as step(inputs=...)")
        if targets is not None:
            self._targets = split_microbatches(targets, m, name="targets")
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._inputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._losses: list[torch.Tensor] = []
        self._sends_in_flight: list[tuple[Any, list[P2POp]]] = []
        ran: list[Action] = []
        peak = 0
        with torch.enable_grad():
            for item in self.schedule.batches(self.rank):
                if isinstance(item, tuple):
                    with self._phase("comm_wait", item):
                        self._communicate(item)
                    done = list(item)
                else:
                    with self._phase(_PHASES[item.op], item):
                        self._compute(item)
                    done = [item]
                    peak = max(peak, len(self._slots))
                for action in done:
                    ran.append(action)
                    if self.on_action is not None:
                        self.on_action(action)
        for handle, _ in self._sends_in_flight:
            handle.wait()
        self._sends_in_flight = []
        if self._slots or self._inputs or self._grads_in or self._grads_out:
            raise RuntimeError(f"schedule {self.schedule.name!r} left work behind on pp rank {self.rank}")
        self._sum_tied_grads()
        if self.on_backward_end is not None:
            self.on_backward_end()
        loss = torch.stack(self._losses).sum() / m if self._losses else None
        if return_loss:
            holder = self.schedule.location_of(self.last_stage)[0]
            buffer = loss.detach().float().reshape(1) if loss is not None else torch.zeros(1, device=self.device)
            loss = broadcast(buffer.contiguous(), src=holder, group=self.group)[0]
        self._microbatches = self._targets = None
        return PipelineStepResult(loss=loss, actions=tuple(ran), peak_live_activations=peak)

    @torch.no_grad()
    def evaluate(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        """The mean loss of a batch, forward only: no gradients, no activations kept, parameters untouched.

        Each microbatch goes through the stages in order, its activations sent to the next stage's rank as soon as
        they are computed (metadata first, then the tensors); the stages do not overlap, which is fine for a
        held-out evaluation and not meant for throughput. Every rank returns the loss (broadcast from the last
        stage's rank).

        Args:
            inputs: the batch, split into the schedule's microbatches (used on the first stage's rank).
            targets: what ``loss_fn`` compares against, split the same way (used on the last stage's rank).

        Returns:
            The mean over microbatches of ``loss_fn``, a 0-d fp32 tensor.
        """
        m = self.schedule.num_microbatches
        total = torch.zeros((), dtype=torch.float32, device=self.device)

        def add(output: Any, target: Any) -> None:
            nonlocal total
            loss = self.loss_fn(output) if target is None else self.loss_fn(output, target)
            total += loss.detach().float().reshape(())

        self._forward_only(inputs, targets, m, add, what="evaluate")
        holder = self.schedule.location_of(self.last_stage)[0]
        return broadcast((total / m).reshape(1).contiguous(), src=holder, group=self.group)[0]

    @torch.no_grad()
    def forward_outputs(
        self,
        inputs: Any = None,
        targets: Any = None,
        *,
        output_fn: Callable[[Any, Any], Any],
        num_microbatches: int = 1,
    ) -> list[Any] | None:
        """What ``output_fn`` makes of the last stage's output, per microbatch, forward only (as `evaluate` runs:
        no gradients, no activations kept): e.g. per-sequence log-probs of a frozen reference or of the rollout.

        Args:
            inputs: the batch, split into ``num_microbatches`` (used on the first stage's rank).
            targets: what ``output_fn`` reads beside the output, split the same way (used on the last stage's
                rank); ``None``: ``output_fn(output, None)``.
            output_fn: ``output_fn(output, target)`` on the last stage's rank; its results are returned as they are.
            num_microbatches (int): how many microbatches the batch runs as (any number dividing its size; not the
                schedule's, which only training steps follow). Default: ``1``.

        Returns:
            On the last stage's rank the list of ``output_fn``'s results, one per microbatch; ``None`` elsewhere
            (the caller broadcasts what the other ranks need).
        """
        results: list[Any] = []
        self._forward_only(
            inputs,
            targets,
            num_microbatches,
            lambda output, target: results.append(output_fn(output, target)),
            what="forward_outputs",
        )
        return results if self.last_stage in self.stages else None

    def _forward_only(self, inputs: Any, targets: Any, m: int, on_last: Callable[[Any, Any], None], *, what: str):
        """Each of ``m`` microbatches through the stages in order, activations sent on as soon as computed
        (metadata first, then the tensors); ``on_last(output, target)`` on the last stage's rank."""
        if inputs is None and 0 in self.stages:
            raise ValueError(f"pp rank {self.rank} runs the first stage: pass the batch as {what}(inputs=...)")
        microbatches = split_microbatches(inputs, m, name="inputs") if inputs is not None else None
        split_targets = split_microbatches(targets, m, name="targets") if targets is not None else None
        for index in range(m):
            value = None
            for stage in range(self.schedule.num_stages):
                local = self._chunk_for_stage(stage)
                if local is None:
                    continue
                if stage == 0:
                    value = microbatches[index]
                elif self._peer(stage - 1) != self.rank:
                    value = self._receive_activation(self._peer(stage - 1))
                output = call_stage(self.chunks[local], value)
                if stage == self.last_stage:
                    on_last(output, None if split_targets is None else split_targets[index])
                elif self._peer(stage + 1) != self.rank:
                    self._send_activation(output, self._peer(stage + 1), stage)
                    value = None
                else:
                    value = output

    def forget_shapes(self) -> None:
        """Let the next step pass new shapes between stages: the metadata of every boundary is sent again at its
        first crossing (one small message per boundary). For batches whose shapes change from step to step by
        design (online RL: rollout rows of a new width each step); every rank of the pipeline must call it before
        the same step. Within a step every microbatch still passes the same shapes."""
        self._meta_sent.clear()
        self._meta_recv.clear()

    def _send_activation(self, output: Any, peer: int, stage: int) -> None:
        tensors, meta = flatten(output, what=f"output of stage {stage}")
        batch_send_recv([P2POp.send(meta.to_bytes(), peer)], group=self.group)
        batch_send_recv([P2POp.send(t.contiguous(), peer) for t in tensors], group=self.group)

    def _receive_activation(self, peer: int) -> Any:
        buffer = torch.empty(META_BYTES, dtype=torch.uint8)
        batch_send_recv([P2POp.recv(buffer, peer)], group=self.group)
        meta = StageMeta.from_bytes(buffer)
        tensors = empty_like_meta(meta, device=self.device)
        batch_send_recv([P2POp.recv(t, peer) for t in tensors], group=self.group)
        return unflatten(tensors, meta)

    # --- compute ------------------------------------------------------------------------------------------------

    def _phase(self, kind: str, item: Action | tuple[Action, ...]):
        """The context an action (or a batch of communication actions) runs in: a profiler range named after it
        (``colo.pp F mb3 chunk0``, ``colo.pp comm SEND_F mb0 chunk0, RECV_B mb0 chunk0``), timed as ``kind`` when
        a timer is set."""

        def name() -> str:
            actions = item if isinstance(item, tuple) else (item,)
            text = ", ".join(f"{a.op} mb{a.microbatch} chunk{a.chunk}" for a in actions)
            return f"colo.pp {'comm ' if isinstance(item, tuple) else ''}{text}"

        if self.timer is not None:
            return self.timer.phase(kind, name)
        return region(name)

    def _chunk_for_stage(self, stage: int) -> int | None:
        return self.stages.index(stage) if stage in self.stages else None

    def _compute(self, action: Action) -> None:
        key = (action.microbatch, action.chunk)
        stage = self.stages[action.chunk]
        if action.op == "F":
            self._forward(action, key, stage)
        elif action.op in ("B", "BW"):
            self._backward(action, key, stage)
        else:  # W
            slot = self._slots.pop(key)
            backward_weight(slot.pending)

    def _forward(self, action: Action, key: tuple[int, int], stage: int) -> None:
        if stage == 0:
            value, leaves = self._microbatches[action.microbatch], []
        else:
            leaves = self._inputs.pop(key)
            value = unflatten(leaves, self._meta_recv[stage])
        output = call_stage(self.chunks[action.chunk], value)
        meta = None
        if stage == self.last_stage:
            if self._targets is not None:
                loss = self.loss_fn(output, self._targets[action.microbatch])
            else:
                loss = self.loss_fn(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a scalar tensor (reduce the loss, e.g. with .mean())")
            self._losses.append(loss.detach().reshape(()))
            outputs = [loss.reshape(()) / self.schedule.num_microbatches]
        else:
            outputs, meta = flatten(output, what=f"output of stage {stage}")
            self._check_meta(stage + 1, meta)
            local = self._chunk_for_stage(stage + 1)
            if local is not None:  # the next stage runs here: hand over detached copies
                self._meta_recv[stage + 1] = meta
                self._inputs[(action.microbatch, local)] = [self._leaf(t) for t in outputs]
        self._slots[key] = _Slot(inputs=leaves, outputs=outputs, meta=meta)

    @staticmethod
    def _leaf(tensor: torch.Tensor, requires_grad: bool | None = None) -> torch.Tensor:
        leaf = tensor.detach()
        grad = tensor.requires_grad if requires_grad is None else requires_grad
        if grad and leaf.is_floating_point():
            leaf.requires_grad_(True)
        return leaf

    def _backward(self, action: Action, key: tuple[int, int], stage: int) -> None:
        slot = self._slots[key]
        if stage == self.last_stage:
            grads = [torch.full_like(slot.outputs[0], self.loss_scale)]
        else:
            grads = self._grads_in.pop(key)
        pairs = [(o, g) for o, g in zip([o for o in slot.outputs if o.requires_grad], grads)]
        outputs, grad_outputs = [o for o, _ in pairs], [g for _, g in pairs]
        if action.op == "BW":
            if outputs:
                torch.autograd.backward(outputs, grad_outputs)
            input_grads = [leaf.grad for leaf in slot.inputs]
            del self._slots[key]
        else:
            input_grads, slot.pending = backward_input(outputs, grad_outputs, slot.inputs, self._params[action.chunk])
        if stage > 0:
            grads_back = [
                g if g is not None else torch.zeros_like(leaf)
                for leaf, g in zip(slot.inputs, input_grads)
                if leaf.requires_grad
            ]
            local = self._chunk_for_stage(stage - 1)
            if local is not None:
                self._grads_in[(action.microbatch, local)] = grads_back
            else:
                self._grads_out[key] = grads_back

    # --- communication ------------------------------------------------------------------------------------------

    def _check_meta(self, stage: int, meta: StageMeta) -> None:
        cached = self._meta_sent.get(stage)
        if cached is None:
            return
        if cached != meta:
            raise ValueError(
                f"the input of stage {stage} changed from {cached} to {meta}; every microbatch and step must pass "
                f"the same shapes and dtypes between stages (pad to a fixed length, or build a new executor)"
            )

    def _peer(self, stage: int) -> int:
        return self.schedule.location_of(stage)[0]

    def _communicate(self, batch: tuple[Action, ...]) -> None:
        # First crossing of a boundary: its metadata travels in a batch of its own, in the same order.
        meta_ops, meta_buffers = [], {}
        for action in batch:
            stage = self.stages[action.chunk]
            if action.op == "SEND_F" and stage + 1 not in self._meta_sent:
                meta = self._slots[(action.microbatch, action.chunk)].meta
                self._meta_sent[stage + 1] = meta
                meta_ops.append(P2POp.send(meta.to_bytes(), self._peer(stage + 1)))
            elif action.op == "RECV_F" and stage not in self._meta_recv and stage not in meta_buffers:
                meta_buffers[stage] = torch.empty(META_BYTES, dtype=torch.uint8)
                meta_ops.append(P2POp.recv(meta_buffers[stage], self._peer(stage - 1)))
        if meta_ops:
            batch_send_recv(meta_ops, group=self.group)
            for stage, buffer in meta_buffers.items():
                self._meta_recv[stage] = StageMeta.from_bytes(buffer)

        sends, recvs = [], []
        for action in batch:
            key = (action.microbatch, action.chunk)
            stage = self.stages[action.chunk]
            if action.op == "SEND_F":
                sends += [P2POp.send(t.detach().contiguous(), self._peer(stage + 1)) for t in self._slots[key].outputs]
            elif action.op == "RECV_F":
                buffers = empty_like_meta(self._meta_recv[stage], device=self.device)
                self._inputs[key] = buffers
                recvs += [P2POp.recv(b, self._peer(stage - 1)) for b in buffers]
            elif action.op == "SEND_B":
                sends += [P2POp.send(g.contiguous(), self._peer(stage - 1)) for g in self._grads_out.pop(key)]
            else:  # RECV_B
                buffers = [torch.empty_like(o) for o in self._slots[key].outputs if o.requires_grad]
                self._grads_in[key] = buffers
                recvs += [P2POp.recv(b, self._peer(stage + 1)) for b in buffers]
        # Sends are posted first and waited for at the end of the step, so a rank never idles until its peer
        # has taken a message; receives are waited for now. (Messages between two ranks still match in order,
        # and `validate` proves the schedule deadlock-free even when every send blocks.)
        if sends:
            self._sends_in_flight.append((batch_send_recv(sends, group=self.group, async_op=True), sends))
        if recvs:
            batch_send_recv(recvs, group=self.group)
        for action in batch:
            if action.op == "RECV_F":
                key = (action.microbatch, action.chunk)
                meta = self._meta_recv[self.stages[action.chunk]]
                self._inputs[key] = [self._leaf(b, t.requires_grad) for b, t in zip(self._inputs[key], meta.tensors)]
