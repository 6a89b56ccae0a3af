"""The registry entries of the RLHF tasks (``data.task: rm | dpo | grpo | ppo``): their sections and support rules.

Each rule names the field to change; the first one a config breaks is its error (`colo.apps.train.task.TaskRule`).
The task classes are imported only when a run builds them.
"""

from __future__ import annotations

import os

from ..train.language_model import record_data_rules
from ..train.task import TaskRule, TaskSpec
from .grpo_config import GRPOSection
from .ppo_config import PPOSection
from .preference_config import PreferenceSection

_DPO_ONLY = ("loss_type", "beta", "label_smoothing", "simpo_gamma")


def _hybrid_beyond_tp_sp(config) -> bool:
    plugin = config.plugin
    return plugin.name == "hybrid" and (plugin.sp_mode == "megatron" or (plugin.pp > 1 and plugin.sp > 1))


def _same_path(first: str, second: str) -> bool:
    return os.path.realpath(first) == os.path.realpath(second)


def _preference_rules(task: str) -> tuple[TaskRule, ...]:
    """``rm`` / ``dpo``: preference records, the other kind's settings unset, a layout the pair forward supports."""
    rules = [
        *record_data_rules(task, "{prompt, chosen, rejected} records", "runs one pair per item", "every record"),
        TaskRule(
            "data.paths",
            lambda c: not c.data.paths and not c.preference.synthetic_records,
            lambda c: (
                f"data.task={task!r} needs data.paths of {{prompt, chosen, rejected}} records, or "
                "preference.synthetic_records > 0 for the embedded Python-line set"
            ),
            summary="no data.paths and no preference.synthetic_records",
        ),
    ]
    if task == "rm":
        rules.append(
            TaskRule(
                "preference",
                lambda c: any(getattr(c.preference, n) != PreferenceSection.model_fields[n].default for n in _DPO_ONLY),
                lambda c: (
                    "preference."
                    + sorted(
                        n for n in _DPO_ONLY if getattr(c.preference, n) != PreferenceSection.model_fields[n].default
                    )[0]
                    + " is a DPO setting; data.task='rm' does not read it"
                ),
                summary="a DPO setting of the preference section (loss_type, beta, label_smoothing, simpo_gamma)",
            )
        )
    else:
        rules.append(
            TaskRule(
                "preference.margin",
                lambda c: c.preference.margin is not None,
                lambda c: "preference.margin is a reward-model setting; data.task='dpo' does not read it",
                summary="preference.margin set (a reward-model setting)",
            )
        )
    rules += [
        TaskRule(
            "preference.sft_steps",
            lambda c: c.preference.sft_steps >= c.schedule.total_steps,
            lambda c: (
                f"preference.sft_steps={c.preference.sft_steps} leaves no {task.upper()} step of "
                f"schedule.total_steps={c.schedule.total_steps}; lower it"
            ),
            summary="preference.sft_steps >= schedule.total_steps",
        ),
        TaskRule(
            "plugin",
            _hybrid_beyond_tp_sp,
            lambda c: (
                f"data.task={task!r} under plugin.name='hybrid' supports tp, dp, pp and sp (Ulysses or ring "
                "attention), sp not with pp, sp_mode not 'megatron': Megatron-SP's hidden-state shards, and sequence "
                "shards on a pipeline's last stage, do not give per-sequence log-probs or rewards yet; drop "
                "sp_mode='megatron', use sp=1 with pp > 1, or use plugin.name='ddp', 'zero' (stage 1-3) or 'gemini'"
            ),
            summary="plugin.name='hybrid' with sp_mode 'megatron', or sp > 1 together with pp > 1",
        ),
        TaskRule(
            "plugin.loss_weighting",
            lambda c: c.plugin.loss_weighting != "microbatch",
            lambda c: f"data.task={task!r} averages pairs: set plugin.loss_weighting='microbatch'",
            summary="plugin.loss_weighting other than 'microbatch'",
        ),
    ]
    if task == "rm":
        rules += [
            TaskRule(
                "checkpoint.dir",
                lambda c: c.preference.sft_steps > 0 and _same_path(c.checkpoint_dir, c.output_dir),
                lambda c: (
                    f"checkpoint.dir={c.checkpoint.dir!r} is output_dir itself: a reward model with "
                    "preference.sft_steps saves its SFT'd policy to output_dir/sft-policy, which resume=auto would "
                    "take for a checkpoint; use a subdirectory (or leave checkpoint.dir unset)"
                ),
                summary="checkpoint.dir = output_dir with preference.sft_steps > 0",
            ),
            TaskRule(
                "lora.enabled",
                lambda c: c.lora.enabled,
                lambda c: "data.task='rm' with LoRA is not supported: the scalar head must train",
                summary="lora.enabled: the scalar head must train",
            ),
        ]
    return tuple(rules)


_HYBRID_ROLLOUT = (
    # (field, the value it must have, how to write the fix, why)
    ("plugin.pp", 1, "1", "this task's update is not pipelined"),
    ("plugin.tp_mode", "1d", "'1d'", "the grid layouts have no rollout path"),
    ("lora.enabled", False, "false", "the tp reference is built without adapters"),
)

_HYBRID_WHOLE_ROWS = (
    # a task whose update runs on whole rows (every online-RL task splits them today: GRPO / RLOO and PPO)
    ("plugin.sp", 1, "1", "rollout rows are not split along the sequence"),
    ("plugin.sp_mode", None, "null", "rollout rows are not split along the sequence"),
)


def _field(config, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


def _differs(value, allowed) -> bool:
    return value != allowed or type(value) is not type(allowed)


_PIPELINED_ROLLOUT = (
    # with pp > 1: (field, the value it must have, how to write the fix, why)
    ("plugin.tp", 1, "1", "the rollout copy gathers whole stages over pp, not tp shards"),
    ("plugin.sp", 1, "1", "the last stage scores whole rows"),
    ("plugin.sp_mode", None, "null", "the last stage scores whole rows"),
)


def _pipeline_rules(task: str) -> tuple[TaskRule, ...]:
    """With ``plugin.pp > 1``: what the pipelined update and the rollout copy gathered over pp support (ZeRO 0-3: under
    ZeRO-3 the rollout copy gathers each stage's chunks over dp, then the stages over pp,
    `colo.apps.generation.RolloutEngine`; test_rlhf_grpo_tp's and test_rlhf_ppo_pp's pp2 x dp2 ZeRO-3 cases)."""
    return tuple(
        TaskRule(
            field,
            lambda c, field=field, allowed=allowed: (
                c.plugin.name == "hybrid" and c.plugin.pp > 1 and _differs(_field(c, field), allowed)
            ),
            lambda c, field=field, fix=fix, why=why: (
                f"data.task='{task}' under plugin.pp={c.plugin.pp} supports pp x dp: {field}={_field(c, field)!r} "
                f"is not supported with a pipeline ({why}); set {field}={fix}, or plugin.pp=1"
            ),
            summary=f"plugin.pp > 1 with {field} other than {fix} ({why})",
        )
        for field, allowed, fix, why in _PIPELINED_ROLLOUT
    )


def _rollout_rules(
    task: str, *, plugins: tuple[str, ...], sequence_parallel: bool, pipeline: bool = False
) -> tuple[TaskRule, ...]:
    """An online-RL task's rules (its section ``task``, a `RolloutSection`): prompts, a layout whose trainer holds
    full-vocabulary or vocabulary-parallel log-probs and whole weights (in place or gathered) for the frozen
    reference, batches that split into the updates, prompts + completions that fit the model. With
    ``sequence_parallel`` the update may split rows over ``sp`` (Ulysses or ring attention: the rollout forward
    gathers the per-token log-probs, `colo.apps.rlhf.sequence_logps`); Megatron-SP is refused either way. With
    ``pipeline`` the update may run over ``pp`` stages (pp x dp: `colo.apps.rlhf.rollout_pipeline`, the rollout on the
    stages' weights gathered over pp)."""

    def section(c):
        return getattr(c, task)

    def window(c):
        return c.model.max_position_embeddings or c.model.preset_config.max_position_embeddings

    hybrid = tuple(
        TaskRule(
            field,
            lambda c, field=field, allowed=allowed: c.plugin.name == "hybrid" and _differs(_field(c, field), allowed),
            lambda c, field=field, fix=fix, why=why: (
                f"data.task='{task}' under plugin.name='hybrid' supports tp x dp"
                f"{' (x sp: Ulysses or ring)' if sequence_parallel else ''} only: {field}={_field(c, field)!r} is "
                f"not supported ({why}); set {field}={fix}"
            ),
            summary=f"plugin.name='hybrid' with {field} other than {fix} ({why})",
        )
        for field, allowed, fix, why in _HYBRID_ROLLOUT + (() if sequence_parallel else _HYBRID_WHOLE_ROWS)
        if not (pipeline and field == "plugin.pp")
    )
    if pipeline:
        hybrid += _pipeline_rules(task)
    if sequence_parallel:
        hybrid += (
            TaskRule(
                "plugin.sp_mode",
                lambda c: c.plugin.name == "hybrid" and c.plugin.sp_mode == "megatron",
                lambda c: (
                    f"data.task='{task}' under plugin.name='hybrid' does not support plugin.sp_mode='megatron' (it "
                    "splits the hidden states over tp, which the rollout forward does not gather); set "
                    "plugin.sp_mode=null, or plugin.sp > 1 with plugin.sp_mode 'ulysses' or 'ring'"
                ),
                summary="plugin.name='hybrid' with sp_mode 'megatron' (Ulysses and ring are supported)",
            ),
        )
    return (
        *record_data_rules(task, "{prompt, ...} records", "generates from one prompt per row", "every prompt"),
        TaskRule(
            "data.paths",
            lambda c: not c.data.paths and not section(c).synthetic_prompts,
            lambda c: (
                f"data.task='{task}' needs data.paths of {{prompt, ...}} records, or {task}.synthetic_prompts > "
                "0 for the embedded arithmetic prompts"
            ),
            summary=f"no data.paths and no {task}.synthetic_prompts",
        ),
        TaskRule(
            "plugin.name",
            lambda c: c.plugin.name not in plugins,
            lambda c: (
                f"data.task='{task}' runs the policy under plugin.name={', '.join(repr(n) for n in plugins)} in "
                f"the trainer; plugin.name={c.plugin.name!r} is not supported yet"
            ),
            summary=f"plugin.name other than {', '.join(plugins)}",
        ),
        *hybrid,
        TaskRule(
            "plugin.loss_weighting",
            lambda c: c.plugin.loss_weighting != "microbatch",
            lambda c: (
                f"data.task='{task}' aggregates its losses itself ({task}.loss_aggregation): set "
                "plugin.loss_weighting='microbatch'"
            ),
            summary="plugin.loss_weighting other than 'microbatch'",
        ),
        TaskRule(
            f"{task}.sft_steps",
            lambda c: section(c).sft_steps >= c.schedule.total_steps,
            lambda c: (
                f"{task}.sft_steps={section(c).sft_steps} leaves no {task.upper()} step of schedule.total_steps="
                f"{c.schedule.total_steps}; lower it"
            ),
            summary=f"{task}.sft_steps >= schedule.total_steps",
        ),
        TaskRule(
            f"{task}.minibatches",
            lambda c: (
                (c.data.global_batch_size * section(c).group_size)
                % (section(c).minibatches * c.schedule.num_microbatches)
            ),
            lambda c: (
                f"data.global_batch_size={c.data.global_batch_size} prompts x {task}.group_size="
                f"{section(c).group_size} give {c.data.global_batch_size * section(c).group_size} completions per "
                f"step, which do not split into {task}.minibatches={section(c).minibatches} x "
                f"schedule.num_microbatches={c.schedule.num_microbatches} on every data-parallel rank; change one of "
                "them"
            ),
            summary=(
                f"data.global_batch_size x {task}.group_size not divisible by {task}.minibatches x "
                "schedule.num_microbatches"
            ),
        ),
        TaskRule(
            f"{task}.max_new_tokens",
            lambda c: c.model.init_from is None and section(c).max_prompt_len + section(c).max_new_tokens > window(c),
            lambda c: (
                f"{task}.max_prompt_len={section(c).max_prompt_len} + {task}.max_new_tokens="
                f"{section(c).max_new_tokens} exceed the model's max_position_embeddings={window(c)}; lower them"
            ),
            summary=f"{task}.max_prompt_len + {task}.max_new_tokens > the model's max_position_embeddings",
        ),
    )


_GRPO_RULES = (
    TaskRule(
        "grpo.pack_rows",
        lambda c: c.grpo.pack_rows and c.plugin.name == "hybrid" and c.plugin.pp > 1,
        lambda c: (
            f"grpo.pack_rows under plugin.pp={c.plugin.pp} is not supported yet (the pipelined update scores the "
            "padded rows on its last stage); set grpo.pack_rows=false or plugin.pp=1"
        ),
        summary="grpo.pack_rows with plugin.pp > 1",
    ),
)

_PPO_RULES = (
    TaskRule(
        "lora.enabled",
        lambda c: c.lora.enabled,
        lambda c: (
            "data.task='ppo' with LoRA is not supported yet (the critic and the value head train whole); set "
            "lora.enabled=false"
        ),
        summary="lora.enabled: the critic and the value head train whole",
    ),
    TaskRule(
        "ppo.critic",
        lambda c: c.ppo.critic == "shared" and c.plugin.name == "hybrid" and c.plugin.pp > 1,
        lambda c: (
            f"data.task='ppo' with ppo.critic='shared' does not run under plugin.pp={c.plugin.pp} (the value head "
            "sits beside lm_head, and the pipeline's last stage outputs only the logits); set ppo.critic='separate' "
            "(a critic pipelined as the actor), or plugin.pp=1"
        ),
        summary="ppo.critic='shared' with plugin.pp > 1 (the separate critic is pipelined as the actor)",
    ),
)


def critic_plugin_section(config):
    """The separate critic's plugin section: ``ppo.critic_plugin`` validated as a ``plugin`` section, or the
    actor's ``plugin``. The critic scores the actor's rows, so its data-parallel ranks must see the actor's rows: a
    ``ddp`` / ``zero`` critic over every rank (tensor- and sequence-parallel peers of the actor hold the same rows),
    or, beside a ``hybrid`` actor, a ``hybrid`` critic with the actor's ``tp``, ``sp``, ``sp_mode`` and ``pp`` (its
    own plan on the actor's mesh; under a pipeline its stages are the actor's). Raises a
    `ValueError` naming ``ppo.critic_plugin`` otherwise."""
    from pydantic import TypeAdapter

    from ..train.plugin_config import PluginConfig

    if config.ppo.critic_plugin is None:
        return config.plugin
    try:
        section = TypeAdapter(PluginConfig).validate_python(config.ppo.critic_plugin)
    except Exception as error:  # pydantic's ValidationError, reworded with the field
        raise ValueError(f"ppo.critic_plugin={config.ppo.critic_plugin!r} is not a plugin section: {error}") from None
    actor = config.plugin
    if section.name == "hybrid":
        layout = ("tp", "sp", "sp_mode", "pp")  # (under a pipeline the critic's stages are the actor's)
        if actor.name != "hybrid" or any(getattr(section, n) != getattr(actor, n) for n in layout):
            raise ValueError(
                "ppo.critic_plugin: a hybrid critic runs on the actor's mesh, so it needs a hybrid actor with the "
                f"same tp, sp, sp_mode and pp (actor: name={actor.name!r}, "
                + ", ".join(f"{n}={getattr(actor, n, None)!r}" for n in layout)
                + "; critic: "
                + ", ".join(f"{n}={getattr(section, n)!r}" for n in layout)
                + "); match them, or use name 'ddp' or 'zero'"
            )
    elif section.name not in ("ddp", "zero"):
        raise ValueError(
            f"ppo.critic_plugin: name={section.name!r} cannot hold the critic in the trainer: its data-parallel ranks "
            "must see the actor's rows (every rank, as ddp / zero, or the actor's tp / sp layout as hybrid), and "
            "Gemini / experts are not wired for it; use name 'ddp', 'zero' (stage 0-3) or, beside a hybrid actor, "
            "'hybrid'"
        )
    if section.loss_weighting != "microbatch":
        raise ValueError(
            "ppo.critic_plugin: the value loss is aggregated by PPO itself; set loss_weighting='microbatch'"
        )
    return section


def _async_rule(axis: str) -> TaskRule:
    """``grpo.max_staleness=1`` generates in a background thread that runs no collective: tp, sp, pp, ep stay 1."""

    def size(c) -> int:
        return getattr(c.plugin, axis, 1) or 1

    return TaskRule(
        "grpo.max_staleness",
        lambda c: c.grpo.max_staleness > 0 and size(c) > 1,
        lambda c: (
            f"grpo.max_staleness={c.grpo.max_staleness} generates in a background thread, which runs no collective, "
            f"but generation under plugin.{axis}={size(c)} runs collectives at every decode step; set plugin.{axis}=1 "
            "(data parallelism: ddp, zero, gemini) or grpo.max_staleness=0"
        ),
        summary=f"grpo.max_staleness > 0 with plugin.{axis} > 1 (asynchronous rollouts: data parallelism only)",
    )


_GRPO_ASYNC_RULES = tuple(_async_rule(axis) for axis in ("tp", "sp", "pp", "ep"))


def _preference_task():
    from .task import PreferenceTask

    return PreferenceTask


def _grpo_task():
    from .grpo_task import GRPOTask

    return GRPOTask


def _ppo_task():
    from .ppo_task import PPOTask

    return PPOTask


RLHF_TASKS = (
    TaskSpec(
        name="rm",
        summary="a reward model (the Llama with a scalar head) on {prompt, chosen, rejected} records, Bradley-Terry "
        "loss (the preference section, colo.apps.rlhf)",
        load=_preference_task,
        section="preference",
        section_type=PreferenceSection,
        rules=_preference_rules("rm"),
        reads_chat_template=True,
    ),
    TaskSpec(
        name="dpo",
        summary="the DPO family (preference.loss_type) on the same records",
        load=_preference_task,
        section="preference",
        section_type=PreferenceSection,
        rules=_preference_rules("dpo"),
        reads_chat_template=True,
    ),
    TaskSpec(
        name="grpo",
        summary="online RL on {prompt, ...} records with reward functions (GRPO / Dr. GRPO / RLOO, the grpo section)",
        load=_grpo_task,
        section="grpo",
        section_type=GRPOSection,
        rules=(
            *_rollout_rules("grpo", plugins=("ddp", "zero", "gemini", "hybrid"), sequence_parallel=True, pipeline=True),
            *_GRPO_RULES,
            *_GRPO_ASYNC_RULES,
        ),
    ),
    TaskSpec(
        name="ppo",
        summary="online RL on the same records with a critic, GAE and reward functions or a reward model (the ppo "
        "section)",
        load=_ppo_task,
        section="ppo",
        section_type=PPOSection,
        rules=(
            *_rollout_rules("ppo", plugins=("ddp", "zero", "gemini", "hybrid"), sequence_parallel=True, pipeline=True),
            *_PPO_RULES,
        ),
        check=critic_plugin_section,
        check_summary=(
            "ppo.critic_plugin",
            "a layout whose data ranks are not the actor's rows (gemini, expert; hybrid other than the actor's tp, sp, "
            "pp)",
        ),
    ),
)
"""The RLHF tasks' registry entries (registered by `colo.apps.recipes`)."""
