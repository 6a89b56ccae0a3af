"""`Trainer`: one training run from a `RunConfig`, on every rank of a torchrun / `colo launch` job; the one loop
every ``data.task`` runs in.

It builds the task ``data.task`` names (`colo.apps.train.task`: language modelling, preference training, online RL,
diffusion), the plugin and `Booster`, the task's model, optimizer (AdamW with its groups; `optim.py`), schedule
(warmup + cosine) and data; then loops over steps with a progress bar and metrics (loss, throughput, memory, the
task's own) to the console, JSONL and TensorBoard, under the resilience guard (SIGTERM checkpoints and exits 75,
a hang watchdog, checkpoints every N minutes; `resilience.py`), refuses a non-finite loss, evaluates as the task
does, checkpoints every N steps in the background (keeping the last K) and, at the end, shows the task's samples.

Resuming (``checkpoint.resume: auto``) continues from the newest complete checkpoint with the same data position
(the sampler's state) and RNG states, so a run resumed in the layout that saved it reproduces the uninterrupted
loss trajectory bit for bit in fp32. Resuming into another layout (other plugin or sizes) works and is warned
about: the weights are the same, later losses agree only to rounding (reduction order changes).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colo.comm import all_gather_object, barrier, init_distributed
from colo.tensor.checkpoint import read_index

from ..runs import RUN_KEY
from .config import RunConfig
from .metrics import MetricsLogger, format_bytes, memory_bytes, step_line, throughput_text
from .profiling import build_profiler
from .rank_timing import RankTiming, timing_text
from .resilience import RunGuard
from .state import checkpoint_path, pick_device, prune_checkpoints, resolve_resume, rng_state, set_rng_state
from .task import TaskContext, build_task
from .trackers import require_trackers


@dataclass
class TrainResult:
    """What a run did (the same on every rank, except ``sample``, which rank 0 generates).

    Attributes:
        losses: ``{step: loss}`` of the steps this run executed (the mean over data-parallel ranks).
        eval_losses: ``{step: held-out loss}``.
        start_step: the step the run started after (0, or the resumed checkpoint's).
        last_step: the last step executed.
        resumed_from: the checkpoint the run resumed from, if any.
        checkpoints: the checkpoints this run wrote.
        sample: the generated sample (rank 0), or ``None``.
        seconds: wall time of the training loop.
        preempted: the run stopped on SIGTERM after checkpointing ``last_step`` (exit with
            `colo.apps.train.resilience.PREEMPTED_EXIT_CODE`; the next run resumes there).
    """

    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    start_step: int = 0
    last_step: int = 0
    resumed_from: str | None = None
    checkpoints: list[str] = field(default_factory=list)
    sample: str | None = None
    seconds: float = 0.0
    preempted: bool = False


class Trainer:
    """Runs the task ``config.data.task`` names (a `colo.apps.train.task.TrainTask`); call `fit` on every rank.

    Args:
        config: the validated run config.

    Example::

        result = Trainer(load_config(preset="tiny-llama")).fit()
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        require_trackers(config.logging.report_to)  # a missing extra: one error on every rank, before any collective
        init_distributed()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.rank, self.world_size = rank, world_size
        log = MetricsLogger(
            config.output_dir,
            total_steps=config.schedule.total_steps,
            jsonl=config.logging.jsonl,
            tensorboard=config.logging.tensorboard,
            progress_bar=config.logging.progress_bar,
            report_to=config.logging.report_to,
            project=config.logging.project,
            enabled=rank == 0,
        )
        torch.manual_seed(config.seed)
        self.task = build_task(config)  # reads the tokenizer and checks the model against it: before any collective
        plugin = config.plugin.build(num_microbatches=config.schedule.num_microbatches, seed=config.seed)
        if config.plugin.name == "expert" and world_size % config.plugin.ep:  # before any collective
            raise ValueError(
                f"plugin.ep={config.plugin.ep} does not divide the world size {world_size} (processes): each "
                f"group of ep ranks splits the experts; choose plugin.ep dividing {world_size}"
            )
        ctx = self.ctx = TaskContext(
            config=config,
            rank=rank,
            world_size=world_size,
            device=pick_device(config.device),
            log=log,
            plugin=plugin,
            _task=self.task,
            _save=lambda step, path: self.save(step, path),
        )
        self.profiler = build_profiler(config.profile, output_dir=config.output_dir, rank=rank, device=ctx.device)
        model = self.task.build_model(ctx)
        self.task.prepare_model(model)
        optimizer = self.task.build_optimizer(ctx, model)
        scheduler = self.task.build_scheduler(ctx, optimizer)
        example = self.task.example_batch(ctx) if plugin.packs_chunks else None
        ctx.boost(model, optimizer, criterion=self.task.criterion, lr_scheduler=scheduler, example_batch=example)
        ctx.data = self.task.build_data(ctx)
        self.rank_timing = RankTiming(ctx.booster, device=ctx.device) if config.logging.rank_timing else None
        self.layout = {
            "plugin": config.plugin.model_dump(mode="json"),
            "mesh": dict(ctx.mesh.shape),
            "world": world_size,
        }
        mesh = ", ".join(f"{axis}={size}" for axis, size in ctx.mesh.shape.items())
        header = (
            f"colo train: {config.name} | {world_size} process(es) on {ctx.device.type} | plugin "
            f"{config.plugin.name} ({config.plugin.precision}) | mesh {mesh}"
        )
        log.print("\n".join([header, *self.task.describe(ctx)]))

    @property
    def model(self):
        """The boosted model being trained."""
        return self.ctx.model

    @property
    def booster(self):
        """The `Booster` of the model being trained."""
        return self.ctx.booster

    @property
    def log(self):
        return self.ctx.log

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def save(self, step: int, path: str | None = None) -> str:
        """Checkpoint after ``step`` (every rank): Booster state plus the run's metadata (JSON; no pickle). With
        ``path``, a checkpoint of the model at that step kept apart from the run's (not pruned, not resumed from;
        e.g. a reward model's SFT'd policy), written synchronously."""
        booster = self.ctx.booster
        if path is not None:
            booster.save(path, metadata={"step": step, RUN_KEY: self._run_metadata(step)})
            return path
        path = checkpoint_path(self.config.checkpoint_dir, step)
        self.task.save_beside(self.ctx, step, path)  # e.g. a separate critic, an EMA: before this one commits
        run = self._run_metadata(step)
        # asynchronous: returns once the state is copied; the pruning keeps keep_last *committed* checkpoints, so the
        # newest one stays until this one has committed too
        booster.save(path, metadata={"step": step, RUN_KEY: run}, asynchronous=self.config.checkpoint.async_save)
        if self.rank == 0:
            prune_checkpoints(self.config.checkpoint_dir, self.config.checkpoint.keep_last)
        return path

    def _run_metadata(self, step: int) -> dict:
        """The run's part of a checkpoint's metadata: step, config, layout, every rank's RNG, the data position
        (rank 0's), the task's state and what the task adds (collective: every rank calls it)."""
        ctx = self.ctx
        per_rank = all_gather_object({"rng": rng_state(), "data": self.task.data_state(ctx)})
        return {
            "step": step,
            "config": self.config.model_dump(mode="json"),
            "layout": self.layout,
            "rng": [state["rng"] for state in per_rank],
            **({"sampler": per_rank[0]["data"]} if per_rank[0]["data"] is not None else {}),
            **self.task.run_metadata(ctx),
            **({self.task.state_key: state} if (state := self.task.state()) is not None else {}),
        }

    def resume(self) -> tuple[int, str | None]:
        """Load the checkpoint ``checkpoint.resume`` selects, if any; returns ``(its step, its path)``. With
        ``resume: auto``, rank 0 first removes the partial saves an earlier run left when it died (a preempted run
        restarted many times would otherwise fill the disk), before anything saves."""
        ctx = self.ctx
        if self.config.checkpoint.resume == "auto" and self.rank == 0:
            removed = prune_checkpoints(self.config.checkpoint_dir, None)
            if removed:
                self.log.print(f"removed {len(removed)} partial saves an earlier run left: {', '.join(removed)}")
        path = resolve_resume(self.config.checkpoint.resume, self.config.checkpoint_dir)
        if path is None:
            return 0, None
        self.task.before_resume(ctx, int(read_index(path).metadata.get("step", 0)))
        metadata = ctx.booster.load(path)
        run = metadata.get(RUN_KEY, {})
        step = int(metadata.get("step", ctx.booster.step_count))
        if run.get("layout") != self.layout:
            self.log.print(
                f"warning: resuming from {path}, saved with layout {run.get('layout')}, into {self.layout}: the "
                "weights and data position carry over; losses will match the uninterrupted run only to rounding"
            )
        self.task.load_data_state(ctx, run.get("sampler"))
        self.task.load_state(ctx, run.get(self.task.state_key))
        self.task.after_resume(ctx, path, step)
        states = run.get("rng") or []  # last: what the task built on resuming does not move the run's streams
        if len(states) == self.world_size:
            set_rng_state(states[self.rank])
        elif states:
            set_rng_state(states[0])
        self.log.print(f"resumed from {path} at step {step}")
        return step, path

    # --- the loop -------------------------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Train to ``schedule.total_steps`` (or ``schedule.stop_at_step``, or a SIGTERM); returns what happened.

        Failure handling (`colo.apps.train.resilience`): on SIGTERM every rank stops at the same step, checkpoints
        and returns with ``preempted`` set; a watchdog ends a rank that makes no progress; a restarted attempt logs
        how the previous one ended.
        """
        config = self.config
        guard = self.guard = RunGuard(
            config.output_dir,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            every_minutes=config.checkpoint.every_minutes,
            watchdog_seconds=config.resilience.watchdog_seconds,
        )
        report = guard.restart_report()
        if report is not None:
            self.log.print(f"restarted (torchrun restart {guard.attempt}) after a failure: {report}")
        try:
            resuming = config.checkpoint.enabled and resolve_resume(config.checkpoint.resume, config.checkpoint_dir)
            self.log.start_trackers(config.model_dump(mode="json"), run_name=config.name, resuming=bool(resuming))
            with self.profiler:  # profile.*: stops it (and writes a memory snapshot on CUDA out-of-memory)
                result = self._fit(guard)
        except BaseException as error:
            guard.finished("failed", error)
            self.log.close(status="failed")  # the trackers' runs end as failed (a no-op once `_fit` closed it)
            raise
        finally:
            self.task.close(self.ctx)  # e.g. a streamed corpus's reading thread
        guard.finished("preempted" if result.preempted else "done")
        return result

    def _fit(self, guard: RunGuard) -> TrainResult:
        """`fit`'s loop: train to ``schedule.total_steps`` (or ``schedule.stop_at_step``); returns what happened."""
        config, ctx, task = self.config, self.ctx, self.task
        total = config.schedule.total_steps
        end = config.schedule.stop_at_step or total
        start, resumed = self.resume() if config.checkpoint.enabled else (0, None)
        result = TrainResult(start_step=start, last_step=start, resumed_from=resumed)
        if self.log.progress is not None:
            self.log.advance(start, "")
        began = window_start = time.perf_counter()
        window_units = 0
        step = start
        self.profiler.start(start)
        while step < end:
            guard.step_begins(step + 1)
            task.before_step(ctx, step)
            outcome, units = task.train_step(ctx, step)
            step += 1
            if self.rank_timing is not None:
                self.rank_timing.step_done()
            window_units += units
            result.losses[step] = outcome.loss
            result.last_step = step
            if not math.isfinite(outcome.loss):
                raise FloatingPointError(
                    f"the loss is {outcome.loss} at step {step}; lower optimizer.lr or set plugin.max_grad_norm"
                )
            agreed = guard.agree(step)  # SIGTERM anywhere / time-based checkpoint due: the same answer on every rank
            if step % config.logging.every_steps == 0 or step == end:
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
                throughput = task.throughput(ctx, units=window_units, seconds=time.perf_counter() - window_start)
                memory, _ = memory_bytes(ctx.device)
                record = {
                    "step": step,
                    "loss": outcome.loss,
                    "lr": outcome.lr,
                    "grad_norm": outcome.grad_norm,
                    **throughput,
                    "memory_bytes": memory,
                    **{f"memory/{kind}": value for kind, value in ctx.booster.memory_breakdown().items()},
                    "skipped": outcome.skipped,
                    **guard.straggler_metrics(),
                    **task.take_metrics(ctx),
                    **(self.rank_timing.gather() if self.rank_timing is not None else {}),
                }
                self.log.log(record)
                self.log.print(step_line(record, total_steps=total) + timing_text(record))
                self.log.advance(step, f"loss {outcome.loss:.3f} | {throughput_text(throughput)}")
                window_start, window_units = time.perf_counter(), 0
            else:
                self.log.advance(step, f"loss {outcome.loss:.3f}")
            if config.eval.every_steps and step % config.eval.every_steps == 0:
                evaluated = task.evaluate(ctx, step)
                if evaluated is not None:
                    result.eval_losses[step] = evaluated
            every = config.checkpoint.every_steps
            if config.checkpoint.enabled and ((every and step % every == 0) or agreed.save or agreed.stop):
                result.checkpoints.append(self.save(step))
                guard.saved()
            self.profiler.step(step)
            if agreed.stop:
                result.preempted = True
                break
        result.seconds = time.perf_counter() - began
        reached_end = step == total
        if config.checkpoint.enabled and config.checkpoint.save_final and reached_end and step > start:
            if not result.checkpoints or not result.checkpoints[-1].endswith(f"step-{step:08d}"):
                result.checkpoints.append(self.save(step))
        ctx.booster.wait_for_saves()  # the last background save is committed before the run reports it
        if config.checkpoint.enabled and config.checkpoint.async_save and self.rank == 0:  # now it counts as kept
            prune_checkpoints(config.checkpoint_dir, config.checkpoint.keep_last)
        if result.preempted:
            saved = f"checkpoint {result.checkpoints[-1]}" if result.checkpoints else "no checkpoint (it is off)"
            self.log.print(
                f"preempted ({guard.signalled or 'SIGTERM on another rank'}): stopped after step {step} of {total} "
                f"with {saved}; run the same command again to resume (checkpoint.resume=auto)"
            )
        elif not reached_end:
            self.log.print(f"stopped after step {step} of {total} (schedule.stop_at_step); resume with resume=auto")
        else:
            final = result.checkpoints[-1] if result.checkpoints else resumed
            result.sample = task.finish(ctx, final_checkpoint=final)
        self.log.close("preempted" if result.preempted else "finished")
        self.log.print(self._summary(result))
        barrier()
        return result

    def _summary(self, result: TrainResult) -> str:
        steps = sorted(result.losses)
        if not steps:
            return "no steps run (the checkpoint is already at the end; raise schedule.total_steps to go on)"
        memory, what = memory_bytes(self.device)
        first, last = result.losses[steps[0]], result.losses[steps[-1]]
        saved = result.checkpoints[-1] if result.checkpoints else "none"
        return (
            f"done: steps {steps[0]}-{steps[-1]} in {result.seconds:.1f} s | loss {first:.4f} -> {last:.4f} | "
            f"{what} {format_bytes(memory)} | last checkpoint {saved}"
        )


def train(config: RunConfig) -> TrainResult:
    """Run `Trainer(config).fit()` on every rank of the job."""
    return Trainer(config).fit()
