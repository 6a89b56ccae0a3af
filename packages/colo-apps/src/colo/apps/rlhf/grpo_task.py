"""``data.task: grpo`` inside the one trainer (`colo.apps.train.Trainer`): what online RL adds to it.

Each step on each data-parallel rank (`GRPOTask.train_step`):

1. **rollout**: this rank's prompts (the resumable sampler's batch) are continued ``grpo.group_size`` times each by
   `colo.apps.generation.RolloutEngine` from the weights the Booster trains (in place under DDP / ZeRO 1-2), with a
   sampling generator seeded by ``(seed, step, rank)`` (a resumed run draws the same completions);
2. **rewards** from the reward functions (`colo.apps.rlhf.rewards`) plus, with ``grpo.overlong_buffer``, DAPO's
   soft overlong punishment; with ``grpo.dynamic_sampling`` the groups of all-equal rewards are dropped and the batch
   refilled from the next prompts (`colo.apps.rlhf.dapo.fill_informative_groups`, every rank generating the same
   number of rounds and keeping the same number of rows); **advantages** per prompt group
   (`colo.apps.rlhf.advantages`; a group never spans ranks, so this needs no communication); with
   ``grpo.mask_truncated`` the completions that ran out of budget are left out of the loss;
3. **log-probs**: the old log-probs recomputed by the training forward over the rollout (as verl does: the loss's
   ratio then compares like with like; their distance to the rollout's own log-probs is logged as
   ``grpo/logprob_mismatch``), and the frozen reference's. Every one of them, the rollout's included, is taken under
   the one policy: the softmax over the tokenizer's ids (``SamplingParams.vocab_limit``, the rest of a padded
   vocabulary left out) at the sampling temperature, before top-p. With one update per step (``grpo.epochs`` x
   ``grpo.minibatches`` = 1) the update's own forward is that training forward: its log-probs, detached, are the
   old ones (`GRPOCriterion`'s on-policy path), which saves a forward over the rollout; with several updates they
   are recomputed by a separate forward before the first;
4. **update**: ``grpo.epochs`` passes of ``grpo.minibatches`` `Booster.train_step` calls, the loss aggregated with
   the global token / sequence counts of each minibatch (`colo.apps.rlhf.policy_loss.global_counts`).

The reference is a frozen copy of the policy taken when the GRPO steps begin (after ``grpo.sft_steps`` of SFT on
the prompts' answers), replicated on every rank (under HybridParallel tp: laid out as the policy, each rank its
tensor-parallel shards) and written once to ``checkpoint_dir/grpo-reference.safetensors`` (under tp one
``grpo-reference-tp{rank}-of-{tp}.safetensors`` per tp rank), so a resumed run scores against the same reference.
A checkpointed, same-layout resume reproduces the uninterrupted run bit for bit (fp32).

With ``grpo.max_staleness=1`` (asynchronous, one-step off-policy rollouts; `colo.apps.rlhf.async_rollouts`) the
rollout (1.) is the one generated in the background (``grpo.rollout_worker``: a thread or a child process) from the
weights before the previous update (the first GRPO step, with nothing in flight, generates its own), and the step
launches the next step's rollout from a snapshot of the weights now, before its update runs; dynamic sampling's
refill rounds generate on the main thread from the current weights. The
loss is decoupled PPO with the truncated behaviour importance weight (`colo.apps.rlhf.off_policy`): the proximal
log-probs are the trainer's forward with the current weights (the update's own with one update per step, else the
separate forward of step 3), the behaviour log-probs the rollout's own. Metrics: ``grpo/staleness`` (mean over the
trained rows of the updates between the weights that sampled a row and the weights it trains: 0 or 1),
``grpo/importance_weight_mean`` / ``_max`` / ``_min`` (untruncated) and ``grpo/importance_weight_capped`` (the
fraction of tokens truncated), ``grpo/time_rollout`` (the rollout time the step waited for) and
``grpo/time_rollout_background`` (the background generation's own time); ``grpo/logprob_mismatch`` then measures the
policy's one-update drift as well as the engine-vs-trainer difference.
"""

from __future__ import annotations

import math
import os
import time

import torch

from ..booster.llama_plan import sequence_multiple
from ..booster.microbatch import split_batch
from ..data import IGNORE_INDEX
from ..generation import SamplingParams, rollout_model_inputs
from ..train.language_model import LanguageModelTask
from .advantages import group_advantages
from .async_rollouts import BackgroundRollouts
from .dapo import fill_informative_groups, soft_overlong_punishment, truncated_rows
from .grpo import GRPOCriterion, attach_rollout_forward
from .off_policy import importance_weight_stats
from .pair_pipeline import from_last_stage
from .policy_loss import global_counts, keep_whole_microbatches, rows_with_gradient
from .prompts import build_prompt_dataset
from .rewards import compute_rewards, load_reward_function
from .rl_lr import use_rl_lr

STATE_KEY = "grpo"
REFERENCE_FILE = "grpo-reference.safetensors"
_PER_ROW = ("prompt_ids", "prompt")


class GRPOTask(LanguageModelTask):
    """The grpo parts of a training run (see the module docstring).

    Args:
        config: the run config (``data.task`` is ``"grpo"``).
        tokenizer: the run's tokenizer (``eos_id``, ``pad_id``, ``vocab_size``, ``decode``).

    Raises:
        RewardFunctionError / ValueError: a reward function that does not load, or prompts over the budget (before
            any collective: the task is built before the Booster).
    """

    state_key = STATE_KEY
    metric_prefix = "grpo"
    """The prefix of the step metrics (``grpo/...``) and the eval's (``eval_grpo/...``)."""

    section = "grpo"
    """The run-config section of the task's settings (a `RolloutSection`)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._init_rollout(config, config.grpo, self.tokenizer)
        grpo = self.settings
        self.criterion = GRPOCriterion(
            loss_aggregation=grpo.loss_aggregation,
            beta=grpo.beta,
            kl_estimator=grpo.kl_estimator,
            eps_low=grpo.eps_low,
            eps_high=grpo.eps_high,
            kl_ratio_correction=grpo.kl_ratio_correction,
            temperature=grpo.temperature,  # read under a pipeline, where the last stage takes the log-probs
            vocab_limit=self.params.vocab_limit,  # likewise: the policy is the distribution over the tokenizer's ids
            importance_sampling_cap=grpo.importance_sampling_cap,
        )

    def _init_rollout(self, config, settings, tokenizer) -> None:
        """What every online-RL task holds, from its section (``grpo`` / ``ppo``, a `RolloutSection`): the reward
        functions, the sampling parameters, the SFT warm-up and update counts, and the rollout state."""
        self.config, self.tokenizer, self.settings = config, tokenizer, settings
        self.reward_functions = {path: load_reward_function(path) for path in settings.reward_functions}
        build_prompt_dataset(config.data, settings, tokenizer)  # every prompt within the budget, checked up front
        self.params = SamplingParams(
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            n=settings.group_size,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
            vocab_limit=tokenizer.vocab_size,
        )
        self.sft_steps = settings.sft_steps
        self.updates_per_step = settings.epochs * settings.minibatches
        self.reference: torch.nn.Module | None = None
        self.reference_step: int | None = None
        self.engine = None
        self._batches = None
        self._window: dict[str, float] = {}
        self._window_max: dict[str, float] = {}
        self._packed_models: list[torch.nn.Module] = []  # grpo.pack_rows: the policy and the reference
        self.background: BackgroundRollouts | None = None  # grpo.max_staleness=1: the rollout generated ahead
        self._pending_step: int | None = None

    # --- hooks of the trainer -------------------------------------------------------------------------------------

    @classmethod
    def dataset_rows(cls, config, tokenizer) -> tuple:
        return build_prompt_dataset(config.data, getattr(config, cls.section), tokenizer)

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Before the optimizer is built: the rollout forward (log-probs and entropies of the responses, over the
        tokenizer's ids: the ids generation samples from)."""
        attach_rollout_forward(
            model,
            temperature=self.settings.temperature,
            pack_rows=self._pack_rows(),
            vocab_limit=self.params.vocab_limit,
        )
        self._packed_models = [model]

    def _pack_rows(self) -> bool:
        return bool(getattr(self.settings, "pack_rows", False))  # (a grpo setting; ppo's section has none)

    def before_step(self, trainer, step: int) -> None:
        """Nothing: `train_step` runs the whole step."""

    def train_step(self, trainer, step: int):
        """The step after ``step``: an SFT step during the warm-up, else rollout, rewards, log-probs and updates.

        Returns:
            ``(StepResult of the last update with the mean loss of the step's updates, real tokens of this rank)``.
        """
        self._attach(trainer)
        if step < self.sft_steps:
            return self._sft_step(trainer)
        if self.reference is None and self.settings.beta > 0:  # beta 0 (DAPO): no KL term, no reference
            self._take_reference(trainer, step)
        return self._grpo_step(trainer, step)

    def take_metrics(self, trainer) -> dict[str, float]:
        """The step metrics since the last call, over every data-parallel rank (every rank calls it)."""
        group = trainer.sample_group
        prefix = self.metric_prefix
        # under a pipeline the last stage computed the loss (rollout_pipeline): its ranks hold the statistics
        criterion_metrics = from_last_stage(self.criterion.take_metrics(group), trainer.booster.mesh)
        metrics = {f"{prefix}/{k}": v for k, v in criterion_metrics.items()}
        for model in self._packed_models if self._pack_rows() else ():  # grpo.pack_rows: the positions computed
            padded, packed = model.pack_tokens
            model.pack_tokens[:] = [0, 0]
            self._add(pack_padded_tokens=float(padded), pack_packed_tokens=float(packed))
        window, maxima = self._window, self._window_max
        self._window, self._window_max = {}, {}
        names = sorted(window)
        flags = torch.tensor([float(bool(names))], dtype=torch.float64)
        _all_reduce(flags, group, "max")
        if not flags.item():
            return metrics
        sums = torch.tensor([window[n] for n in names], dtype=torch.float64)
        _all_reduce(sums, group, "sum")
        peaks = torch.tensor([maxima.get(n, 0.0) for n in sorted(maxima)], dtype=torch.float64)
        _all_reduce(peaks, group, "max")
        total = dict(zip(names, sums.tolist()))
        peak = dict(zip(sorted(maxima), peaks.tolist()))
        if "sft_loss" in total:
            metrics[f"{prefix}/sft_loss"] = total["sft_loss"] / max(total["sft_steps"], 1.0)
        if total.get("rows"):
            rows, steps = total["rows"], max(total["steps"], 1.0)
            mean = total["reward_sum"] / rows
            generated = total.get("generated_tokens", total["response_tokens"]) / max(peak["rollout_seconds"], 1e-9)
            checked = total.get("mismatch_tokens", total["response_tokens"])
            metrics.update(
                {
                    f"{prefix}/reward_mean": mean,
                    f"{prefix}/reward_std": math.sqrt(max(total["reward_sq"] / rows - mean * mean, 0.0)),
                    f"{prefix}/response_length": total["response_tokens"] / rows,
                    f"{prefix}/logprob_mismatch": total["mismatch_sum"] / max(checked, 1.0),
                    f"{prefix}/logprob_mismatch_max": peak["mismatch_max"],
                    f"{prefix}/rollout_peak_bytes": peak.get("rollout_peak_bytes", 0.0),
                    # tokens of every rank over the slowest rank's rollout time
                    f"{prefix}/generation_tokens_per_second": generated,
                    f"{prefix}/time_rollout": total["rollout_seconds"] / steps,
                    f"{prefix}/time_logprobs": total["logprob_seconds"] / steps,
                    f"{prefix}/time_update": total["update_seconds"] / steps,
                }
            )
            if total.get("pack_padded_tokens"):  # grpo.pack_rows: the padded forwards' positions not computed
                metrics[f"{prefix}/pack_padding_saved"] = (
                    1.0 - total["pack_packed_tokens"] / total["pack_padded_tokens"]
                )
            if "skipped_rows" in total:  # rows whose loss is identically zero, left out of the update's compute
                metrics[f"{prefix}/skipped_fraction"] = total["skipped_rows"] / rows
            if "staleness_rows" in total:  # grpo.max_staleness=1 (colo.apps.rlhf.off_policy)
                weight_tokens = max(total["importance_weight_tokens"], 1.0)
                metrics.update(
                    {
                        f"{prefix}/staleness": total["staleness_sum"] / max(total["staleness_rows"], 1.0),
                        f"{prefix}/staleness_max": peak["staleness_max"],
                        f"{prefix}/importance_weight_mean": total["importance_weight_sum"] / weight_tokens,
                        f"{prefix}/importance_weight_max": peak["importance_weight_max"],
                        f"{prefix}/importance_weight_min": -peak["importance_weight_negmin"],
                        f"{prefix}/importance_weight_capped": total["importance_weight_capped"] / weight_tokens,
                        f"{prefix}/time_rollout_background": total["background_seconds"] / steps,
                    }
                )
            if "truncated_rows" in total:  # TRL's completions/clipped_ratio: rows that ran out of budget
                metrics[f"{prefix}/truncated_fraction"] = total["truncated_rows"] / rows
            ranks = group.size if group is not None else 1  # "steps" counts each rank's steps
            for name in ("dynamic_extra_rounds", "dynamic_dropped_groups", "dynamic_shortfall_groups"):
                if name in total:  # per step; the groups summed over ranks, the rounds the same on every rank
                    per_rank = name == "dynamic_extra_rounds"
                    metrics[f"{prefix}/{name}"] = total[name] / steps * (1 if per_rank else ranks)
        return metrics

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def state(self) -> dict:
        """What a checkpoint keeps: whether (and after which step) the reference was taken; its weights are in
        ``checkpoint_dir/grpo-reference.safetensors``, written once. With ``grpo.max_staleness=1`` also the step of
        the in-flight rollout saved beside the checkpoint (`save_beside`)."""
        state = {"reference_step": self.reference_step}
        if self._pending_step is not None:
            state["pending_rollout_step"] = self._pending_step
        return state

    def save_beside(self, trainer, step: int, path: str) -> None:
        """``grpo.max_staleness=1``: wait for the rollout in flight and save it (one file per rank under
        ``checkpoint_dir/grpo-pending/``): the weights that generated it are not in the checkpoint."""
        self._pending_step = None
        if self.background is not None:
            keep = self.config.checkpoint.keep_last + 1
            self._pending_step = self.background.save(self.config.checkpoint_dir, rank=trainer.rank, keep=keep)

    def close(self, trainer) -> None:
        if self.background is not None:
            self.background.close()
        super().close(trainer)

    def load_state(self, trainer, state: dict | None) -> None:
        pending = (state or {}).get("pending_rollout_step")
        if pending is not None:
            if getattr(self.settings, "max_staleness", 0):
                self._background(trainer).load(self.config.checkpoint_dir, pending, rank=trainer.rank)
            else:
                trainer.log.print(
                    f"the checkpoint's in-flight rollout for step {pending} is dropped (grpo.max_staleness=0): "
                    f"step {pending} samples new prompts from the current weights"
                )
        step = (state or {}).get("reference_step")
        if step is not None:
            from safetensors.torch import load_file

            path = _reference_path(trainer)
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"the checkpoint's GRPO reference (taken after step {step}) is missing: {path}; resume from a "
                    "checkpoint directory that holds it, or start fresh (checkpoint.resume=none)"
                )
            self.reference = self._build_reference(trainer, load_file(path, device=str(trainer.device)))
            self.reference_step = step

    # --- eval -----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, trainer, step: int) -> float | None:
        """The held-out exact-match reward: greedy completions of this rank's share of the held-out prompts,
        scored by the reward functions, averaged over every held-out prompt (and, with ``grpo.eval_samples``, the
        mean reward of that many sampled completions each). Returns the greedy reward (higher is better)."""
        if trainer.data.eval is None:
            return None
        self._attach(trainer)
        group, evaluation = trainer.sample_group, trainer.data.eval
        records = [evaluation[i] for i in range(group.rank, len(evaluation), group.size)]
        greedy = SamplingParams(
            max_new_tokens=self.params.max_new_tokens,
            temperature=0.0,
            eos_token_id=self.params.eos_token_id,
            pad_token_id=self.params.pad_token_id,
            vocab_limit=self.params.vocab_limit,
        )
        sums = torch.zeros(4, dtype=torch.float64)
        if records:
            rewards, _ = self._score(records, self._generate(trainer, records, greedy, None))
            sums[0], sums[1] = rewards.double().sum(), rewards.numel()
            if self.settings.eval_samples:
                sampled = SamplingParams(
                    **{**_fields(self.params), "n": self.settings.eval_samples, "seed": None},
                )
                generator = torch.Generator(device=trainer.device).manual_seed(
                    _seed(self.config.seed, -step, group.rank)
                )
                rewards, _ = self._score(records, self._generate(trainer, records, sampled, generator))
                sums[2], sums[3] = rewards.double().sum(), rewards.numel()
        _all_reduce(sums, group, "sum")
        reward = float(sums[0] / max(sums[1], 1.0))
        record = {"step": step, f"eval_{self.metric_prefix}/greedy_reward": reward}
        names = " + ".join(path.rsplit(":", 1)[-1] for path in self.reward_functions)  # the rewards that score
        line = f"eval at step {step}: held-out greedy reward ({names}) {reward:.3f} over {int(sums[1])} prompts"
        if self.settings.eval_samples:
            sampled_reward = float(sums[2] / max(sums[3], 1.0))
            record[f"eval_{self.metric_prefix}/sampled_reward"] = sampled_reward
            line += f" | sampled reward {sampled_reward:.3f} ({self.settings.eval_samples} per prompt)"
        trainer.log.log(record)
        trainer.log.print(line)
        self.last_eval = record
        return reward

    # --- the step -------------------------------------------------------------------------------------------------

    def _attach(self, trainer) -> None:
        """Once: the rollout engine, and the LR schedule stretched over the run's optimizer updates."""
        if self.engine is not None:
            return
        from ..generation.hybrid import RolloutEngine

        pipelined = _axis_size(trainer, "pp") > 1  # generation on the stages' weights gathered into a whole model
        build_model = trainer.build_model if pipelined else None
        self.engine = RolloutEngine(trainer.booster, trainer.model, build_model=build_model)
        scheduler = trainer.booster.lr_scheduler
        if self.updates_per_step > 1 and scheduler is not None:
            total = self.config.schedule.total_steps
            for multiplier in scheduler.lr_lambdas:
                if hasattr(multiplier, "total_steps"):
                    multiplier.total_steps = self.sft_steps + (total - self.sft_steps) * self.updates_per_step
        if self.settings.lr is not None and scheduler is not None:  # the RL steps' own LR (rlhf/rl_lr.py)
            use_rl_lr(scheduler, from_step=self.sft_steps, ratio=self.settings.lr / self.config.optimizer.lr)

    def _next_records(self, trainer) -> list[dict]:
        dataset = trainer.data.train
        return [dataset[i] for i in self._next_indices(trainer)]

    def _next_indices(self, trainer) -> list[int]:
        """The dataset indices of the sampler's next batch (this rank's)."""
        if self._batches is None:
            self._batches = _forever(trainer.data.sampler)
        return [int(i) for i in next(self._batches)]

    def _async_rollout(self, trainer, step: int):
        """``grpo.max_staleness=1``: ``(records, rollout, staleness, background seconds)`` of this step (the rollout
        generated ahead, or, with none in flight, generated now), after launching the next step's rollout from the
        weights now (before this step's update). The last step launches none."""
        group, device, dataset = trainer.sample_group, trainer.device, trainer.data.train
        background = self._background(trainer)
        pending = background.take()
        if pending is not None:
            if pending.step != step:
                raise RuntimeError(f"GRPO: the rollout generated ahead is for step {pending.step}, not step {step}")
            # copies: dynamic sampling tells these first-round rows from the refills' by the records' identity
            records, rollout = [dict(dataset[i]) for i in pending.indices], pending.rollout
            staleness, seconds = 1, pending.generate_seconds
        else:  # nothing in flight (the first GRPO step): sampled now from the current weights
            records = [dict(record) for record in self._next_records(trainer)]
            generator = torch.Generator(device=device).manual_seed(_seed(self.config.seed, step, group.rank))
            rollout = self._generate(trainer, records, self.params, generator)
            staleness, seconds = 0, 0.0
        if step + 1 < self.config.schedule.total_steps:
            indices = self._next_indices(trainer)
            seed = _seed(self.config.seed, step + 1, group.rank)
            prompts = [dataset[i]["prompt_ids"] for i in indices]
            state = self.engine.full_state_dict()  # the weights before this step's update
            background.launch(state, prompts, self.params, seed, step=step + 1, indices=indices)
        return records, rollout, staleness, seconds

    def _background(self, trainer) -> BackgroundRollouts:
        """The background rollout generator and its copy of the weights (built on first use)."""
        if self.background is None:

            def build_copy(state):
                with torch.random.fork_rng(devices=[]):  # building the model draws from the RNG: keep the run's
                    return trainer.booster.frozen_copy(trainer.build_model(), state)

            plugin = trainer.booster.plugin  # the DDP plugin computes in bf16/fp16 under autocast: generate likewise
            mixed = type(plugin).__name__ == "DDP" and plugin.precision != "fp32"
            self.background = BackgroundRollouts(
                build_copy,
                device=trainer.device,
                worker=self.settings.rollout_worker,
                autocast_dtype=plugin.compute_dtype if mixed else None,
            )
        return self.background

    def _sft_step(self, trainer):
        """Next-token loss on ``prompt + answer + eos`` (labels on the answer and eos), rows padded to the budget."""
        records = self._next_records(trainer)
        if "answer" not in records[0]:
            raise ValueError("grpo.sft_steps > 0 trains on the prompts' 'answer' column, which these records lack")
        width = self.settings.max_prompt_len + self.settings.max_new_tokens
        multiple = sequence_multiple(trainer.booster.plugin)  # sequence parallelism splits the rows into chunks
        width = -(-width // multiple) * multiple
        pad, eos = self.tokenizer.pad_id, self.tokenizer.eos_id
        input_ids = torch.full((len(records), width), pad, dtype=torch.long)
        labels = torch.full((len(records), width), IGNORE_INDEX, dtype=torch.long)
        tokens = 0
        for row, record in enumerate(records):
            prompt = record["prompt_ids"]
            answer = (list(self.tokenizer.encode(str(record["answer"]))) + [eos])[: width - len(prompt)]
            ids = prompt + answer
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, len(prompt) : len(ids)] = torch.tensor(answer)
            tokens += len(ids)
        batch = {"input_ids": input_ids.to(trainer.device), "labels": labels.to(trainer.device)}
        self.criterion.sft = True
        try:
            outcome = trainer.booster.train_step(batch)
        finally:
            self.criterion.sft = False
        self._add(sft_loss=outcome.loss, sft_steps=1.0)
        return outcome, tokens

    def _grpo_step(self, trainer, step: int):
        booster, group, device = trainer.booster, trainer.sample_group, trainer.device
        settings = self.settings
        asynchronous = bool(getattr(settings, "max_staleness", 0))
        if asynchronous:  # the rollout generated ahead from the weights before the last update, the next launched
            started = time.perf_counter()
            records, rollout, first_staleness, background_seconds = self._async_rollout(trainer, step)
            # dynamic sampling's refill rounds sample on this thread from the current weights, with a stream of
            # their own (the step's own seed sampled the rollout in the background)
            seed = _seed(self.config.seed, step, group.rank) ^ 0x5EED
            generator = torch.Generator(device=device).manual_seed(seed)
        else:
            records = self._next_records(trainer)
            started = time.perf_counter()
            generator = torch.Generator(device=device).manual_seed(_seed(self.config.seed, step, group.rank))
            rollout = self._generate(trainer, records, self.params, generator)
        first_records = records
        first_rewards = rewards = self._train_rewards(records, rollout)
        first_rows, generated = rollout.num_rows, int(rollout.response_mask.sum())
        if settings.dynamic_sampling:
            sample = fill_informative_groups(
                records,
                rollout,
                rewards,
                group_size=settings.group_size,
                max_extra_rounds=settings.dynamic_sampling_max_rounds,
                generate=lambda more: self._generate(trainer, more, self.params, generator),
                score=self._train_rewards,
                next_records=lambda: self._next_records(trainer),
                pad_token_id=self.tokenizer.pad_id,
                group=group,
            )
            records, rollout, rewards = sample.records, sample.rollout, sample.rewards
            generated = sample.generated_tokens
            self._add(
                dynamic_extra_rounds=float(sample.extra_rounds),
                dynamic_dropped_groups=float(sample.dropped_groups),
                dynamic_shortfall_groups=float(sample.shortfall_groups),
            )
        rolled = time.perf_counter()
        advantages = group_advantages(rewards, settings.group_size, estimator=settings.advantage)
        truncated = truncated_rows(rollout, self.tokenizer.eos_id)
        mask = rollout.response_mask
        if settings.mask_truncated:  # the rows stay (a sequence of the seq-mean counts), their tokens leave the loss
            mask = mask * (~truncated).to(mask.dtype).unsqueeze(1)
        batch = {
            **rollout_model_inputs(rollout, hf=False),
            "response_mask": mask,
            "advantages": advantages.to(device),
        }
        if asynchronous:  # the sampling (behaviour) policy's log-probs: the loss's importance weights
            batch["behaviour_logps"] = rollout.logprobs * mask.to(rollout.logprobs.dtype)
            first = {id(record) for record in first_records}  # rows of refill rounds were sampled just now
            staleness = torch.tensor(
                [float(first_staleness) if id(record) in first else 0.0 for record in records], dtype=torch.float64
            ).repeat_interleave(settings.group_size)
        minibatches = self.settings.minibatches
        microbatches = booster.plugin.num_microbatches
        if rollout.num_rows % (minibatches * microbatches):
            raise ValueError(
                f"{rollout.num_rows} completions on this rank do not split into grpo.minibatches={minibatches} x "
                f"schedule.num_microbatches={microbatches}; change data.global_batch_size or those"
            )
        counts, rollout_logps = None, rollout.logprobs
        if minibatches == 1:  # rows whose loss is identically zero leave the update; the counts keep them
            counts = global_counts(mask, max_new_tokens=self.params.max_new_tokens, group=group)
            keep = keep_whole_microbatches(rows_with_gradient(advantages, mask, beta=settings.beta), microbatches)
            if not bool(keep.all()):
                batch = {key: value[keep.to(value.device)] for key, value in batch.items()}
                rollout_logps = rollout.logprobs[keep.to(rollout.logprobs.device)]
                if asynchronous:
                    staleness = staleness[keep.cpu()]
            self._add(skipped_rows=float((~keep).sum()))
        on_policy = self.updates_per_step == 1  # the update's own forward gives the old log-probs (grpo.py)
        if not on_policy:
            batch["old_logps"] = self._logps(booster.forward, batch)
        if self.reference is not None:
            batch["ref_logps"] = self._logps(self.reference, batch)
        scored = time.perf_counter()
        losses, outcome = [], None
        for _ in range(self.settings.epochs):
            for part in split_batch(batch, minibatches):
                if counts is None or minibatches > 1:
                    max_new = self.params.max_new_tokens
                    counts = global_counts(part["response_mask"], max_new_tokens=max_new, group=group)
                self.criterion.prepare(counts, num_microbatches=microbatches, num_data_ranks=group.size)
                outcome = booster.train_step(part)
                losses.append(outcome.loss)
        updated = time.perf_counter()
        trained_mask = batch["response_mask"]
        if on_policy:  # under a pipeline the last stage's ranks ran the loss and hold them
            old_logps = from_last_stage(self.criterion.take_forward_logps(), booster.mesh)
        else:
            old_logps = batch["old_logps"]
        if old_logps is None or old_logps.shape != trained_mask.shape:
            raise RuntimeError(
                f"GRPO: the update's forwards gave log-probs of shape "
                f"{None if old_logps is None else tuple(old_logps.shape)} for a batch of {tuple(trained_mask.shape)}"
            )
        mismatch = (old_logps - rollout_logps).abs() * trained_mask
        if asynchronous:  # the proximal (old) vs behaviour (rollout) weights of the update, untruncated
            weights = importance_weight_stats(
                old_logps, rollout_logps, trained_mask, cap=settings.importance_sampling_cap
            )
            self._add(
                staleness_sum=float(staleness.sum()),
                staleness_rows=float(staleness.numel()),
                importance_weight_sum=weights.weight_sum,
                importance_weight_tokens=weights.num_tokens,
                importance_weight_capped=weights.capped_tokens,
                background_seconds=background_seconds,
            )
            self._peak(
                staleness_max=float(staleness.max()) if staleness.numel() else 0.0,
                importance_weight_max=weights.weight_max,
                importance_weight_negmin=-weights.weight_min if weights.num_tokens else -1.0,
            )
        self._add(
            steps=1.0,
            rows=float(first_rows),  # the rewards of the step's own prompts: what the policy earns on them
            reward_sum=float(first_rewards.double().sum()),
            reward_sq=float((first_rewards.double() ** 2).sum()),
            response_tokens=float(rollout.response_mask.sum()),
            generated_tokens=float(generated),
            truncated_rows=float(truncated.sum()),
            mismatch_sum=float(mismatch.sum()),
            mismatch_tokens=float(trained_mask.sum()),
            rollout_seconds=rolled - started,
            logprob_seconds=scored - rolled,
            update_seconds=updated - scored,
        )
        self._peak(mismatch_max=float(mismatch.max()) if mismatch.numel() else 0.0)
        if self.engine.last_report is not None:  # the rollout phase's weights + KV cache (CUDA: allocator peak)
            self._peak(rollout_peak_bytes=float(self.engine.last_report.peak_rollout_bytes))
        generating = (rolled - started) + (background_seconds if asynchronous else 0.0)  # async: + the background's
        self._window_max["rollout_seconds"] = self._window_max.get("rollout_seconds", 0.0) + generating
        result = type(outcome)(**{**_fields(outcome), "loss": sum(losses) / len(losses)})
        return result, int(rollout.attention_mask.sum())

    def _generate(self, trainer, records, params, generator):
        return self.engine.generate([record["prompt_ids"] for record in records], params, generator=generator)

    def _train_rewards(self, records, rollout) -> torch.Tensor:
        """The rewards a GRPO step trains on: the reward functions', plus DAPO's soft overlong punishment with
        ``grpo.overlong_buffer`` (`colo.apps.rlhf.dapo.soft_overlong_punishment`; eos counted in the length)."""
        rewards, _ = self._score(records, rollout)
        buffer = self.settings.overlong_buffer
        if buffer:
            lengths = rollout.response_mask.sum(dim=1).cpu()
            shaping = soft_overlong_punishment(
                lengths, max_length=self.params.max_new_tokens, buffer=buffer, penalty=self.settings.overlong_penalty
            )
            rewards = (rewards.double() + shaping).float()
        return rewards

    def _score(self, records, rollout):
        """``(rewards, completions)`` of a rollout's rows: the reward functions on the decoded responses (eos off)."""
        eos = self.tokenizer.eos_id
        completions = [
            self.tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids) for ids in rollout.responses()
        ]
        owners = rollout.prompt_index.tolist()
        prompts = [records[i]["prompt"] for i in owners]
        columns = {name: [records[i][name] for i in owners] for name in records[0] if name not in _PER_ROW}
        rewards = compute_rewards(
            self.reward_functions, prompts, completions, columns, completion_ids=rollout.responses()
        )
        return rewards, completions

    @torch.no_grad()
    def _logps(self, forward, batch) -> torch.Tensor:
        """``(R, T)`` per-token log-probs of the responses, forward only, in chunks of one microbatch's rows."""
        if isinstance(forward, torch.nn.Module):
            module = forward
            forward = lambda micro: module(**micro)  # noqa: E731
        rows = batch["input_ids"].shape[0]
        size = max(1, rows // (self.settings.minibatches * self.config.schedule.num_microbatches))
        keys = ("input_ids", "position_ids", "document_ids", "response_mask")
        pieces = []
        for first in range(0, rows, size):
            micro = {key: batch[key][first : first + size] for key in keys if key in batch}
            pieces.append(forward(micro)["logps"].detach().float())
        return torch.cat(pieces) * batch["response_mask"].float()

    # --- the reference --------------------------------------------------------------------------------------------

    def _take_reference(self, trainer, step: int) -> None:
        """The frozen reference: the policy now (after the SFT warm-up), copied on every rank (gathered chunk by
        chunk under ZeRO-3 / Gemini); saved once."""
        state = self.engine.full_state_dict()
        self.reference = self._build_reference(trainer, state)
        self.reference_step = step
        if self.config.checkpoint.enabled:
            # rank 0, or under tensor parallelism each tp rank its shards (sp ranks hold the same: the first writes)
            if trainer.sample_group.rank == 0 and _axis_rank(trainer, "sp") == 0 and _axis_rank(trainer, "pp") == 0:
                from safetensors.torch import save_file

                os.makedirs(self.config.checkpoint_dir, exist_ok=True)
                path = _reference_path(trainer)
                temporary = path + ".tmp"
                save_file({k: v.contiguous().cpu() for k, v in state.items()}, temporary)
                os.replace(temporary, path)
            from colo.comm import barrier

            barrier()
        name = self.metric_prefix.upper()
        trainer.log.print(f"{name} reference: the policy after step {step}, frozen (a copy on every rank)")

    def _build_reference(self, trainer, state: dict) -> torch.nn.Module:
        """The frozen policy ``state`` laid out as the policy is (`Booster.frozen_copy`: under tp its shards)."""
        with torch.random.fork_rng(devices=[]):  # building the model draws from the RNG: keep the run's stream
            model = trainer.booster.frozen_copy(trainer.build_model(), state)
        if _axis_size(trainer, "pp") > 1:  # a FrozenPipeline: the criterion's pipeline_outputs are its forward
            return model
        attach_rollout_forward(
            model,
            temperature=self.settings.temperature,
            pack_rows=self._pack_rows(),
            vocab_limit=self.params.vocab_limit,
        )
        self._packed_models.append(model)
        return model

    # --- metrics --------------------------------------------------------------------------------------------------

    def _add(self, **values: float) -> None:
        for name, value in values.items():
            self._window[name] = self._window.get(name, 0.0) + value

    def _peak(self, **values: float) -> None:
        for name, value in values.items():
            self._window_max[name] = max(self._window_max.get(name, -math.inf), value)


def _reference_path(trainer) -> str:
    """The frozen reference's file: one per tensor-parallel rank (its shards) under tp > 1."""
    mesh = trainer.booster.mesh
    path = os.path.join(trainer.config.checkpoint_dir, REFERENCE_FILE)
    if "tp" in mesh.shape and mesh.size("tp") > 1:
        return path.replace(".safetensors", f"-tp{mesh.rank('tp')}-of-{mesh.size('tp')}.safetensors")
    return path


def _axis_rank(trainer, axis: str) -> int:
    """This rank's coordinate on the booster mesh's ``axis`` (0 when the mesh has no such axis)."""
    mesh = trainer.booster.mesh
    return mesh.rank(axis) if axis in mesh.shape else 0


def _axis_size(trainer, axis: str) -> int:
    """The size of the booster mesh's ``axis`` (1 when the mesh has no such axis)."""
    mesh = trainer.booster.mesh
    return mesh.size(axis) if axis in mesh.shape else 1


def _forever(sampler):
    while True:
        yield from sampler


def _seed(seed: int, step: int, rank: int) -> int:
    """A sampling seed per (run seed, step, rank), the same in a resumed run."""
    return (seed * 1_000_003 + step * 8191 + rank * 131 + 17) % (2**63)


def _fields(instance) -> dict:
    import dataclasses

    return {field.name: getattr(instance, field.name) for field in dataclasses.fields(instance)}


def _all_reduce(tensor: torch.Tensor, group, op: str) -> None:
    if group is not None and group.size > 1:
        from colo.comm import all_reduce

        all_reduce(tensor, op, group=group)
