"""``data.task: ppo`` inside the one trainer (`colo.apps.train.Trainer`): GRPO's rollout machinery with a critic.

`PPOTask` is `colo.apps.rlhf.grpo_task.GRPOTask` (the resumable prompt batches, the rollout engine on the trained
weights, the reward functions, the SFT warm-up, the frozen reference written once, the held-out greedy reward) with
another step (`PPOTask.train_step`), on each data-parallel rank:

1. **rollout** of this rank's prompts (``ppo.group_size`` completions each), seeded by ``(seed, step, rank)``;
2. **scores**: the reward functions' sum plus, with ``ppo.reward_model``, a frozen reward model's score (the scalar
   head at the last response token; a checkpoint of a ``data.task: rm`` run with the same tokenizer, replicated);
3. **experience** (`colo.apps.rlhf.ppo_learner.PPOLearner.experience`): old log-probs and values recomputed by the
   training forwards, the reference's log-probs, KL-shaped rewards, GAE, whitening over the global batch;
4. **updates**: ``ppo.epochs x ppo.minibatches`` updates of the actor and of the critic, then the KL controller.

The critic: ``ppo.critic='shared'`` puts a value head on the actor (`colo.apps.rlhf.critic.add_value_head`, in the
actor's checkpoint); ``'separate'`` builds a model of its own at the first PPO step, from the reward model when one
is given, else from the policy then (with a fresh scalar head), boosted by its own `Booster` (``ppo.critic_plugin``,
its own AdamW and LR schedule) on the same ranks. Its checkpoint is ``checkpoint_dir/critic/step-N``, written before
the actor's of the same step commits; the KL controller's state goes in the actor's checkpoint metadata. A resumed
run restores actor, critic, both optimizers and the controller exactly.

Under `HybridParallel` sequence parallelism (Ulysses or ring attention over ``sp``) the actor, the critic and the
reference take whole rollout rows, each sp rank computes the log-probs and values of its piece of every row and the
``(R, T)`` values are gathered over sp (`colo.apps.rlhf.sequence_logps`), so GAE, whitening and the losses run on
whole rows, the same on every sp rank; a ``hybrid`` critic runs with the actor's ``tp``, ``sp`` and ``sp_mode``.

Under `HybridParallel` tensor parallelism (tp x dp, pp = 1) the actor's log-probs and entropies come from each rank's
vocabulary columns (`colo.apps.rlhf.token_logps`), and the frozen reference is laid out as the policy
(`Booster.frozen_copy`, GRPO's). The separate critic runs under ``ppo.critic_plugin``, by default the actor's own
plugin section: a critic is as large as the policy, so where the policy needs tensor parallelism the critic gets it
too, from its own plan (its scalar head replicated over tp), and on the same ranks its mesh is the actor's, so the
rows a rank's critic scores and averages over ``dp`` are the rows its actor holds. A ``ppo.critic_plugin`` of
``ddp`` / ``zero`` runs the critic whole over every rank instead: the tp peers of a data-parallel rank hold the same
rows, so its mean over all ranks equals the mean over the data-parallel ranks (at tp times the critic's compute).
Either way the critic starts from the reference's weights module by module
(`colo.apps.rlhf.critic.critic_from_policy`: tp shards all-gathered, re-split by the critic's layout).

Under a `HybridParallel` pipeline (pp x dp, ``ppo.critic: separate``) the rollout runs on the stages' weights gathered
over pp (GRPO's), the frozen reference is pipelined as the actor (`Booster.frozen_copy`), and the separate critic, under
the actor's plugin section by default, is pipelined over the same stages (its scalar head on the last stage), started
from the whole weights the reference was loaded with; under ZeRO-3 (pp x dp) the rollout copy and the reference's
weights gather each stage's chunks over dp first, and the critic's stages are sharded over dp too. `PPOCriterion` is
then a `PipelineCriterion` (`colo.apps.rlhf.ppo_pipeline`): the experience's forwards return their per-token outputs on
every rank of the pipeline (sent from the last stage), so GAE and whitening run on whole rows everywhere, and the losses
are reduced on the last stage, whose criterion metrics are handed to the other ranks for logging. The value head on the
actor's backbone (``ppo.critic: shared``) is refused under pp (the run config names the field).
"""

from __future__ import annotations

import os
import time

import torch

from ..generation import rollout_model_inputs
from ..runs import load_reward_model, run_of
from ..train.language_model import LanguageModelTask
from .critic import add_value_head, attach_ppo_forward, critic_from_policy
from .grpo_task import GRPOTask, _axis_size, _fields, _seed
from .pair_pipeline import from_last_stage
from .ppo import PPOCriterion, build_kl_controller
from .ppo_learner import PPOLearner
from .rewards import compute_rewards
from .specs import critic_plugin_section

STATE_KEY = "ppo"
CRITIC_DIR = "critic"


class PPOTask(GRPOTask):
    """The ppo parts of a training run (module docstring).

    Args:
        config: the run config (``data.task`` is ``"ppo"``).
        tokenizer: the run's tokenizer.

    Raises:
        RewardFunctionError / ValueError: a reward function that does not load, prompts over the budget, or a reward
            model that is not a ``data.task: rm`` checkpoint or whose tokenizer differs (all before any collective).
    """

    state_key = STATE_KEY
    metric_prefix = "ppo"

    section = "ppo"

    def __init__(self, config) -> None:  # GRPOTask's attributes, from the ppo section
        LanguageModelTask.__init__(self, config)
        self._init_rollout(config, config.ppo, self.tokenizer)
        ppo = self.settings
        self.reward_run = None if ppo.reward_model is None else check_reward_model(ppo.reward_model, config)
        self.shared = ppo.critic == "shared"
        losses = dict(
            temperature=ppo.temperature,  # (read under a pipeline: the last stage takes the log-probs itself)
            vocab_limit=self.tokenizer.vocab_size,
            loss_aggregation=ppo.loss_aggregation,
            eps_low=ppo.eps_low,
            eps_high=ppo.eps_high,
            dual_clip=ppo.dual_clip,
            value_clip=ppo.value_clip,
        )
        self.criterion = PPOCriterion(
            "actor_critic" if self.shared else "actor", entropy_coef=ppo.entropy_coef, value_coef=ppo.value_coef,
            **losses,
        )  # fmt: skip
        self.critic_criterion = None if self.shared else PPOCriterion("critic", **losses)
        self.kl_controller = build_kl_controller(
            ppo.kl_controller, init=ppo.kl_coef, target=ppo.kl_target, horizon=ppo.kl_horizon
        )
        self.reward_model: torch.nn.Module | None = None
        self.critic_booster = None
        self.learner: PPOLearner | None = None
        self._stats: dict[str, float] = {}
        self._policy_state: dict[str, torch.Tensor] | None = None  # under pp: the separate critic's start

    # --- hooks of the trainer -------------------------------------------------------------------------------------

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Before the optimizer is built: the value head (shared critic) and the PPO forward."""
        if self.shared:
            add_value_head(model, seed=self.config.seed + 1)
        attach_ppo_forward(
            model,
            role="actor_critic" if self.shared else "actor",
            temperature=self.settings.temperature,
            vocab_limit=self.tokenizer.vocab_size,
        )

    def train_step(self, trainer, step: int):
        """The step after ``step``: an SFT step during the warm-up, else rollout, scores, experience and updates."""
        self._attach(trainer)
        if step < self.sft_steps:
            return self._sft_step(trainer)
        if self.reference is None:
            self._take_reference(trainer, step)
        return self._ppo_step(trainer, step)

    def take_metrics(self, trainer) -> dict[str, float]:
        """GRPO's metrics (as ``ppo/...``), the critic's, and the experience statistics: ``ppo/kl`` (mean summed
        k1 per sequence), ``ppo/kl_coef``, ``ppo/score``, ``ppo/returns``, ``ppo/values``,
        ``ppo/explained_variance``, and with a separate critic ``ppo/critic_loss`` and ``ppo/critic_grad_norm``; the
        means of this logging window."""
        metrics = super().take_metrics(trainer)
        if self.critic_criterion is not None:
            critic = self.critic_criterion.take_metrics(trainer.sample_group)
            if self.critic_booster is not None:  # under a pipeline the last stage's ranks ran the loss
                critic = from_last_stage(critic, self.critic_booster.mesh)
            metrics.update({f"ppo/{k}": v for k, v in critic.items()})
        count = self._stats.pop("_count", 0.0)
        if count:
            metrics.update({f"ppo/{k}": v / count for k, v in self._stats.items()})
        self._stats = {}
        return metrics

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def save_beside(self, trainer, step: int, path: str) -> None:
        """Before the actor's checkpoint after ``step``: the separate critic's, ``checkpoint_dir/critic/step-N``
        (every rank), then the older critic checkpoints pruned like the actor's."""
        if self.critic_booster is None:
            return
        from ..train.state import checkpoint_path, prune_checkpoints

        root = os.path.join(self.config.checkpoint_dir, CRITIC_DIR)
        self.critic_booster.save(checkpoint_path(root, step), metadata={"step": step})
        if trainer.rank == 0:
            prune_checkpoints(root, self.config.checkpoint.keep_last)

    def state(self) -> dict:
        """The reference's step and the KL controller's state."""
        return {"reference_step": self.reference_step, "kl_controller": self.kl_controller.state_dict()}

    def load_state(self, trainer, state: dict | None) -> None:
        """The reference (GRPO's) and the KL controller."""
        super().load_state(trainer, state)
        state = state or {}
        if "kl_controller" in state:
            self.kl_controller.load_state_dict(state["kl_controller"])

    def after_resume(self, trainer, path: str, step: int) -> None:
        """Once the reference exists: the separate critic with its optimizer from ``checkpoint_dir/critic/step-N``
        of the checkpoint's step."""
        if self.reference is None:
            return
        self._build_critic(trainer)
        if self.critic_booster is not None:
            from ..train.state import checkpoint_path

            path = checkpoint_path(os.path.join(self.config.checkpoint_dir, CRITIC_DIR), step)
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"the checkpoint after step {step} has no critic checkpoint {path}; resume from a "
                    "checkpoint directory that holds it, or start fresh (checkpoint.resume=none)"
                )
            self.critic_booster.load(path)

    # --- the step -------------------------------------------------------------------------------------------------

    def _take_reference(self, trainer, step: int) -> None:
        super()._take_reference(trainer, step)
        self._build_critic(trainer)

    def _build_reference(self, trainer, state: dict) -> torch.nn.Module:
        """GRPO's frozen copy of the policy (without the shared critic's value head), its log-probs over the
        sampling vocabulary as the actor's."""
        state = {name: tensor for name, tensor in state.items() if not name.startswith("value_head.")}
        with torch.random.fork_rng(devices=[]):
            model = trainer.booster.frozen_copy(trainer.build_model(), state)  # under tp: laid out as the policy
        if _axis_size(trainer, "pp") > 1:  # a FrozenPipeline: the actor criterion's pipeline_outputs are its forward
            self._policy_state = state  # (the separate critic starts from it: no rank holds the whole reference)
            return model
        return attach_ppo_forward(
            model, role="actor", temperature=self.settings.temperature, vocab_limit=self.tokenizer.vocab_size
        )

    def _build_critic(self, trainer) -> None:
        """The learner, with a separate critic (and the reward model) built once the reference exists: the critic
        starts from the reward model or from the reference's weights (the policy when PPO began)."""
        if self.learner is not None:
            return
        if self.reward_run is not None:
            self.reward_model = load_reward_model(self.config.ppo.reward_model, device=trainer.device)
        if not self.shared:
            self.critic_booster = self._boost_critic(trainer)
        self.learner = PPOLearner(
            trainer.booster,
            self.criterion,
            critic=self.critic_booster,
            critic_criterion=self.critic_criterion,
            settings=self.settings,
            kl_controller=self.kl_controller,
            group=trainer.sample_group,
        )

    def _boost_critic(self, trainer):
        from ..booster import Booster
        from ..train.optim import build_optimizer, build_scheduler

        config = self.config
        section = critic_plugin_section(config)
        plugin = section.build(num_microbatches=config.schedule.num_microbatches, seed=config.seed)
        if self.reward_model is not None:
            model = load_reward_model(config.ppo.reward_model, device=trainer.device)
            model.train().requires_grad_(True)
            attach_ppo_forward(model, role="critic")
        else:  # the reference's weights (under tp: gathered module by module, each rank keeping the critic's shards)
            with torch.random.fork_rng(devices=[]):
                model = trainer.build_model()
            device = None if plugin.materializes_meta_models else trainer.device
            source = self.reference if self._policy_state is None else self._whole_policy(trainer)
            critic_from_policy(model, source, seed=config.seed + 2, device=device)
            self._policy_state = None
        lr = config.ppo.critic_lr or config.optimizer.lr
        optimizer = build_optimizer(
            model,
            config.optimizer.model_copy(update={"lr": lr}),
            num_layers=model.config.num_hidden_layers,
            device=trainer.device,
        )
        scheduler = build_scheduler(optimizer, config.schedule, peak_lr=lr)
        for multiplier in scheduler.lr_lambdas:  # the critic's updates: from the first PPO step on
            if hasattr(multiplier, "total_steps"):
                multiplier.total_steps = (config.schedule.total_steps - self.sft_steps) * self.updates_per_step
        booster = Booster(plugin)
        booster.boost(model, optimizer, criterion=self.critic_criterion, lr_scheduler=scheduler)
        trainer.log.print(
            f"PPO critic: a separate {type(model).__name__} under {section.name}"
            + (" from the reward model" if self.reward_model is not None else " from the policy")
            + f", lr {lr:g}"
        )
        return booster

    def _whole_policy(self, trainer) -> torch.nn.Module:
        """Under a pipeline: the reference's weights as a whole model on this rank (each rank's critic stages are
        filled from it, then it is freed), from the state the frozen reference was loaded with."""
        with torch.random.fork_rng(devices=[]):
            model = trainer.build_model()
            if any(p.is_meta for p in model.parameters()):
                model.to_empty(device=trainer.device)
                model.init_weights(self.config.seed)  # the buffers outside the state dict (rotary tables)
        model.load_state_dict(self._policy_state)
        return model

    def _score(self, records, rollout):
        """``(scores, completions)``: the reward functions' sum plus the reward model's score."""
        eos = self.tokenizer.eos_id
        completions = [
            self.tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids) for ids in rollout.responses()
        ]
        owners = rollout.prompt_index.tolist()
        prompts = [records[i]["prompt"] for i in owners]
        skip = ("prompt_ids", "prompt")
        columns = {name: [records[i][name] for i in owners] for name in records[0] if name not in skip}
        scores = compute_rewards(
            self.reward_functions, prompts, completions, columns, completion_ids=rollout.responses()
        )
        if self.reward_model is not None:
            scores = scores + reward_model_scores(self.reward_model, rollout).cpu()
        return scores, completions

    def _ppo_step(self, trainer, step: int):
        booster, group, device = trainer.booster, trainer.sample_group, trainer.device
        records = self._next_records(trainer)
        started = time.perf_counter()
        generator = torch.Generator(device=device).manual_seed(_seed(self.config.seed, step, group.rank))
        rollout = self._generate(trainer, records, self.params, generator)
        rolled = time.perf_counter()
        scores, _ = self._score(records, rollout)
        mask = rollout.response_mask
        minibatches, microbatches = self.settings.minibatches, booster.plugin.num_microbatches
        if rollout.num_rows % (minibatches * microbatches):
            raise ValueError(
                f"{rollout.num_rows} completions on this rank do not split into ppo.minibatches={minibatches} x "
                f"schedule.num_microbatches={microbatches}; change data.global_batch_size or those"
            )
        batch = {**rollout_model_inputs(rollout, hf=False), "response_mask": mask}
        reference = self._logps(self.reference, batch)
        batch, stats = self.learner.experience(batch, scores.to(device), reference)
        scored = time.perf_counter()
        mismatch = (batch["old_logps"] - rollout.logprobs).abs() * mask
        result = self.learner.update(batch, stats)
        updated = time.perf_counter()
        self._add(
            steps=1.0,
            rows=float(rollout.num_rows),
            reward_sum=float(scores.double().sum()),
            reward_sq=float((scores.double() ** 2).sum()),
            response_tokens=float(mask.sum()),
            mismatch_sum=float(mismatch.sum()),
            rollout_seconds=rolled - started,
            logprob_seconds=scored - rolled,
            update_seconds=updated - scored,
        )
        self._peak(mismatch_max=float(mismatch.max()) if mismatch.numel() else 0.0)
        self._window_max["rollout_seconds"] = self._window_max.get("rollout_seconds", 0.0) + (rolled - started)
        for name in ("kl", "kl_coef", "score", "returns", "values", "explained_variance"):
            self._stats[name] = self._stats.get(name, 0.0) + stats[name]
        if result["critic"]:
            self._stats["critic_loss"] = self._stats.get("critic_loss", 0.0) + sum(result["critic"]) / len(
                result["critic"]
            )
        norms = [float(norm) for norm in result["critic_grad_norms"] if norm is not None]
        if norms:  # the critic's gradient norm before clipping, the mean of the step's updates
            self._stats["critic_grad_norm"] = self._stats.get("critic_grad_norm", 0.0) + sum(norms) / len(norms)
        self._stats["_count"] = self._stats.get("_count", 0.0) + 1.0
        outcome = result["last"]
        loss = sum(result["actor"]) / len(result["actor"])
        return type(outcome)(**{**_fields(outcome), "loss": loss}), int(rollout.attention_mask.sum())


# --- the reward model -------------------------------------------------------------------------------------------


def check_reward_model(path: str, config) -> dict:
    """The run metadata of the reward-model checkpoint ``path`` after checking that it is a ``data.task: rm`` run
    whose tokenizer is the run's (``data.tokenizer``); a clear `ValueError` otherwise (before any collective)."""
    from colo.tensor.checkpoint import CheckpointError, read_index

    try:
        index = read_index(path)
    except (CheckpointError, OSError) as error:
        raise ValueError(f"ppo.reward_model={path!r} is not a committed colo checkpoint: {error}") from None
    run = run_of(index, source=f"ppo.reward_model={path!r}")
    task = ((run.get("config") or {}).get("data") or {}).get("task")
    if task != "rm":
        raise ValueError(
            f"ppo.reward_model={path!r} is a checkpoint of a data.task={task!r} run; give a data.task='rm' checkpoint"
        )
    head = index.tensors.get("lm_head.weight")
    if head is not None and tuple(head.shape)[0] != 1:
        raise ValueError(
            f"ppo.reward_model={path!r} is a checkpoint of the SFT warm-up of a reward-model run (step "
            f"{run.get('step')} <= preference.sft_steps; its lm_head is the policy's): give a checkpoint saved after "
            "the warm-up"
        )
    theirs, ours = run.get("tokenizer"), config.data.tokenizer
    if not _same_tokenizer(theirs, ours):
        raise ValueError(
            f"ppo.reward_model={path!r} was trained with tokenizer {theirs or 'byte'!r}, this run uses data.tokenizer="
            f"{ours or 'byte'!r}: the reward model would read other token ids; train the reward model with the "
            "policy's tokenizer, or set data.tokenizer to its"
        )
    return run


def _same_tokenizer(a, b) -> bool:
    def normal(name):
        return None if name in (None, "byte") else os.path.realpath(name)

    if normal(a) == normal(b):
        return True
    if normal(a) is None or normal(b) is None:
        return False
    from ..data import load_tokenizer

    try:
        first, second = load_tokenizer(a), load_tokenizer(b)
    except Exception:  # a tokenizer that no longer loads: not provably the same
        return False
    probe = "PPO: 12+7=19\n\tunicode ü 🙂"
    return (
        first.vocab_size == second.vocab_size
        and (first.bos_id, first.eos_id, first.pad_id) == (second.bos_id, second.eos_id, second.pad_id)
        and list(first.encode(probe)) == list(second.encode(probe))
    )


@torch.no_grad()
def reward_model_scores(model: torch.nn.Module, rollout) -> torch.Tensor:
    """``(R,)`` the reward model's score of each rollout row: its scalar head at the row's last response token (the
    last prompt token for an empty response), over the inputs generation saw (positions from the first real token,
    left padding masked)."""
    inputs = rollout_model_inputs(rollout, hf=False)
    logits = model(inputs["input_ids"], position_ids=inputs["position_ids"], document_ids=inputs["document_ids"],
                   return_logits=True).logits  # fmt: skip
    last = rollout.prompt_length - 1 + rollout.response_mask.sum(dim=1).long()
    return logits[torch.arange(logits.shape[0], device=logits.device), last, 0].float()
