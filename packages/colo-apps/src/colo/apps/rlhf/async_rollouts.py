"""One-step off-policy rollouts (``grpo.max_staleness=1``): the rollout of step ``k + 1`` is generated in a background
thread from a copy of the weights taken before update ``k``, while update ``k`` runs (verl's one-step off-policy
recipe, in the training processes themselves).

Design (one `BackgroundRollouts` per rank):

- **The rollout copy**: a second, frozen model laid out as the policy (`Booster.frozen_copy`), built once and
  refreshed before each launch from `RolloutEngine.full_state_dict` (the trained weights in place, or gathered chunk
  by chunk under ZeRO-3 / Gemini). The trained weights change under the update while the thread generates, so the
  thread never reads them: it reads only its copy. Cost: one resident copy of the weights (plus its KV cache).
- **The worker** (``grpo.rollout_worker``) runs `colo.apps.generation.generate` on the copy with the step's own
  sampling seed, while the main thread scores the previous rollout, runs the reference forward and the update:

  - ``"thread"``: a thread of the rank's process (`concurrent.futures.ThreadPoolExecutor`). torch's kernels release
    the GIL, so the two overlap as far as the cores and the Python-side work of each allow: well with kernels of a
    millisecond or more (real models; CUDA, where the worker generates on a side stream that first waits for the
    copy's refresh), badly with a tiny CPU model whose steps are mostly Python (the two threads then queue for the
    GIL at every op).
  - ``"process"`` (CPU only): a child process per rank (spawned once, with ``torch.multiprocessing``) that holds the
    rollout copy in shared memory: the refresh writes the weights there, the child generates from them, and the
    rollout comes back through a queue (its tensors in shared memory). No GIL is shared; the child starts in a few
    seconds (it imports torch and colo) on the first launch.

  The worker runs no collective (hence data-parallel layouts only: tensor and sequence parallel generation
  broadcast tokens at every decode step, which would interleave with the update's collectives on the same groups).
- **Determinism and resume**: each rollout is sampled with the generator seeded by ``(seed, step, rank)`` of the step
  it is for, from weights fixed at launch, with the main thread's number of intra-op threads, so a run is
  reproducible, and the thread and the process give the same rollouts. A checkpoint after step ``k`` waits for the
  in-flight rollout of step ``k + 1`` and *saves* it (its prompts' dataset indices and the `Rollout` tensors, one
  safetensors file per rank under ``checkpoint_dir/grpo-pending/``): the weights that generated it (before update
  ``k``) are not in the checkpoint, so it could not be regenerated. A resumed run trains on the saved rollout, so it
  reproduces the uninterrupted run bit for bit.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from ..generation import Rollout, SamplingParams, generate

PENDING_DIR = "grpo-pending"
"""The folder under ``checkpoint_dir`` of the saved in-flight rollouts."""

_ROLLOUT_TENSORS = ("input_ids", "attention_mask", "response_mask", "logprobs", "prompt_index")


@dataclass
class PendingRollout:
    """A rollout generated ahead of the step that trains on it.

    Attributes:
        step: the step (the trainer's ``step`` argument) it is for.
        indices: the dataset indices of its prompts, in order (its records are ``dataset[i]``).
        rollout: the completions, with the log-probs of the weights that sampled them (the behaviour policy).
        generate_seconds: wall time of its generation in the background thread (0 for a loaded one).
    """

    step: int
    indices: list[int]
    rollout: Rollout
    generate_seconds: float = 0.0


class BackgroundRollouts:
    """Generate the next step's rollout in the background from a snapshot of the weights (module docstring).

    Args:
        build_copy (Callable[[dict], nn.Module]): builds the frozen rollout copy from a full state dict (called
            once, on the main thread).
        device (torch.device): where the model lives.
        worker (str): ``"thread"`` or ``"process"`` (CPU only). Default: ``"thread"``.
        autocast_dtype (torch.dtype | None): generate under ``torch.autocast`` with this dtype (the DDP plugin's
            bf16/fp16 compute), or ``None``. Default: ``None``.
    """

    def __init__(self, build_copy, *, device: torch.device, worker: str = "thread", autocast_dtype=None) -> None:
        if worker not in ("thread", "process"):
            raise ValueError(f"grpo.rollout_worker={worker!r} is unknown; use 'thread' or 'process'")
        if worker == "process" and device.type != "cpu":
            raise ValueError(
                f"grpo.rollout_worker='process' generates on the CPU; the run is on {device}: set "
                "grpo.rollout_worker='thread' (on CUDA it generates on a side stream)"
            )
        self._build_copy, self.device, self.worker = build_copy, device, worker
        self.autocast_dtype = autocast_dtype
        self.copy: nn.Module | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._process = None
        self._future: Future | None = None
        self._in_flight: tuple[int, list[int]] | None = None
        self._loaded: PendingRollout | None = None
        self._threads = torch.get_num_threads()  # the worker computes with the main thread's intra-op threads

    def launch(
        self,
        state: dict[str, torch.Tensor],
        prompts: list[list[int]],
        params: SamplingParams,
        seed: int,
        *,
        step: int,
        indices: list[int],
    ) -> None:
        """Refresh the rollout copy from ``state`` (the weights now, on this thread) and start generating
        ``prompts`` in the background for ``step``, sampling with a generator seeded by ``seed``. The previous
        rollout must have been taken (`take`)."""
        if self.pending:
            raise RuntimeError("BackgroundRollouts.launch: the previous rollout was not taken")
        if self.copy is None:
            self.copy = self._build_copy(state)
            if self.worker == "process":
                self.copy.share_memory()  # the child reads the weights the refreshes write
        else:
            with torch.no_grad():
                for name, tensor in self.copy.state_dict().items():
                    tensor.copy_(state[name])
        indices = list(indices)
        if self.worker == "process":
            process = self._child()
            process.jobs.put((prompts, params, seed, step, indices))
            self._in_flight = (step, indices)
            return
        stream = None
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the refresh above is on the main stream
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colo-rollout")
        self._future = self._executor.submit(self._generate, prompts, params, seed, stream, step, indices)

    def _generate(self, prompts, params, seed, stream, step, indices) -> PendingRollout:
        torch.set_num_threads(self._threads)
        started = time.perf_counter()
        generator = torch.Generator(device=self.device).manual_seed(seed)
        streamed = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with torch.no_grad(), streamed, _autocast(self.device.type, self.autocast_dtype):
            rollout = generate(self.copy, prompts, params, generator=generator)
        if stream is not None:
            stream.synchronize()
        return PendingRollout(step, indices, rollout, time.perf_counter() - started)

    def _child(self):
        """The rollout process (started on first use), holding the shared-memory copy."""
        if self._process is None:
            import torch.multiprocessing as mp

            context = mp.get_context("spawn")
            jobs, results = context.Queue(), context.Queue()
            args = (self.copy, jobs, results, self._threads, self.autocast_dtype)
            process = context.Process(target=_process_main, args=args, name="colo-rollout", daemon=True)
            process.start()
            process.jobs, process.results = jobs, results
            self._process = process
        return self._process

    def _receive(self) -> PendingRollout:
        """The child's rollout (raises if the child died or failed)."""
        import queue

        step, indices = self._in_flight
        self._in_flight = None
        while True:
            try:
                reply = self._process.results.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(
                        f"the rollout process (grpo.rollout_worker='process') died with exit code "
                        f"{self._process.exitcode} while generating step {step}'s rollout"
                    ) from None
        if reply[0] != "ok":
            raise RuntimeError(f"the rollout process failed generating step {step}'s rollout:\n{reply[1]}")
        _, tensors, prompt_length, temperature, seconds = reply
        rollout = Rollout(
            **{name: tensors[name].clone() for name in _ROLLOUT_TENSORS},  # out of the child's shared memory
            prompt_length=prompt_length,
            temperature=temperature,
        )
        return PendingRollout(step, indices, rollout, seconds)

    @property
    def pending(self) -> bool:
        """Whether a rollout is in flight or loaded and not yet taken."""
        return self._future is not None or self._in_flight is not None or self._loaded is not None

    def take(self) -> PendingRollout | None:
        """The rollout launched (waiting for it) or loaded from a checkpoint, or ``None`` when there is none."""
        if self._loaded is not None:
            pending, self._loaded = self._loaded, None
            return pending
        if self._in_flight is not None:
            return self._receive()
        if self._future is None:
            return None
        future, self._future = self._future, None
        return future.result()

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def save(self, checkpoint_dir: str, *, rank: int, keep: int) -> int | None:
        """Wait for the rollout in flight and write it to ``checkpoint_dir/grpo-pending/step-N-rank-R.safetensors``
        (the files of this rank's ``keep`` newest steps are kept). Returns its step, or ``None`` when there is
        none."""
        pending = self.take()
        if pending is None:
            return None
        self._loaded = pending  # taken by the next step as if still in flight
        from safetensors.torch import save_file

        folder = os.path.join(checkpoint_dir, PENDING_DIR)
        os.makedirs(folder, exist_ok=True)
        rollout = pending.rollout
        tensors = {name: getattr(rollout, name).detach().contiguous().cpu() for name in _ROLLOUT_TENSORS}
        tensors["indices"] = torch.tensor(pending.indices, dtype=torch.long)
        metadata = {"step": str(pending.step), "prompt_length": str(rollout.prompt_length)}
        metadata["temperature"] = repr(float(rollout.temperature))
        path = pending_path(checkpoint_dir, pending.step, rank)
        save_file(tensors, path + ".tmp", metadata=metadata)
        os.replace(path + ".tmp", path)
        steps = sorted(_saved_steps(folder, rank))
        for old in steps[: max(len(steps) - keep, 0)]:
            os.remove(pending_path(checkpoint_dir, old, rank))
        return pending.step

    def load(self, checkpoint_dir: str, step: int, *, rank: int) -> None:
        """Restore the rollout a checkpoint saved for ``step`` (`save`): the next `take` returns it.

        Raises:
            FileNotFoundError: this rank's file is missing (resume with the layout the checkpoint was saved with).
        """
        path = pending_path(checkpoint_dir, step, rank)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"the checkpoint's in-flight GRPO rollout for step {step} (grpo.max_staleness=1) is missing: {path}; "
                "resume with the number of processes it was saved with, or set grpo.max_staleness=0 to resume "
                "synchronously"
            )
        from safetensors import safe_open

        with safe_open(path, framework="pt", device=str(self.device)) as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        rollout = Rollout(
            **{name: tensors[name] for name in _ROLLOUT_TENSORS},
            prompt_length=int(metadata["prompt_length"]),
            temperature=float(metadata["temperature"]),
        )
        self._loaded = PendingRollout(int(metadata["step"]), tensors["indices"].tolist(), rollout)

    def close(self) -> None:
        """Wait for a rollout in flight and stop the worker."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._future = None
        if self._process is not None:
            if self._in_flight is not None:
                self._receive()
            self._process.jobs.put(None)
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
            self._process = None


def _autocast(device_type: str, dtype):
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _process_main(model, jobs, results, threads: int, autocast_dtype) -> None:
    """The rollout process: generate each job from the shared-memory ``model`` until a ``None`` job."""
    import traceback

    torch.set_num_threads(threads)
    while (job := jobs.get()) is not None:
        prompts, params, seed, _step, _indices = job
        try:
            started = time.perf_counter()
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad(), _autocast("cpu", autocast_dtype):
                rollout = generate(model, prompts, params, generator=generator)
            tensors = {name: getattr(rollout, name) for name in _ROLLOUT_TENSORS}
            seconds = time.perf_counter() - started
            results.put(("ok", tensors, rollout.prompt_length, float(rollout.temperature), seconds))
        except BaseException:  # the parent raises it with the traceback
            results.put(("error", traceback.format_exc()))


def pending_path(checkpoint_dir: str, step: int, rank: int) -> str:
    """The file of the in-flight rollout for ``step`` saved by ``rank``."""
    return os.path.join(checkpoint_dir, PENDING_DIR, f"step-{step}-rank-{rank}.safetensors")


def _saved_steps(folder: str, rank: int) -> list[int]:
    pattern = re.compile(rf"step-(\d+)-rank-{rank}\.safetensors$")
    return [int(m.group(1)) for p in glob.glob(os.path.join(folder, "*")) if (m := pattern.search(p))]
