"""`RunConfig`: the user-facing configuration of one training run (``colo train CONFIG``), validated by pydantic.

Every section forbids unknown fields and documents every field; the JSON schema (``colo config --schema``) and
``colo train --help`` are derived from it. Files are YAML or TOML; ``--set a.b=c`` overrides any field (see
`colo.apps.train.loading`).
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ..data.sft import ChatTemplate
from ..models.llama import PRESETS, LlamaConfig, get_preset
from ..models.moe_llama import MOE_PRESETS, MoELlamaConfig, get_moe_preset
from ._fields import dataclass_fields
from .plugin_config import DDPSection, PluginConfig
from .task import sections, task_spec, task_specs


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _ModelBase(_Section):
    """The model: a Llama preset, or a mixture-of-experts Llama (`MoELlama`, Mixtral-style) preset, plus field
    overrides."""

    preset: str = Field(
        default="tiny-llama",
        description=f"Llama preset (colo.apps.models.llama.PRESETS): one of {sorted(PRESETS)}; or a mixture-of-"
        f"experts Llama preset (colo.apps.models.moe_llama.MOE_PRESETS, trained with plugin.name='expert'): one of "
        f"{sorted(MOE_PRESETS)}.",
    )
    pad_vocab_to_multiple_of: int = Field(
        default=64,
        ge=1,
        description="When vocab_size is unset, the tokenizer's vocabulary rounded up to a multiple of this.",
    )
    init_from: str | None = Field(
        default=None,
        description="Start from pretrained weights: a Hugging Face Llama directory (config.json + safetensors) or a "
        "checkpoint written by colo train (any layout; its LoRA adapters merged). The model's shape comes from "
        "there: model.preset is ignored and the shape fields must stay unset. None: a fresh model from the seed.",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESETS and value not in MOE_PRESETS:
            raise ValueError(
                f"unknown Llama preset {value!r}; choose one of {sorted(PRESETS)}, or a mixture-of-experts preset: "
                f"{sorted(MOE_PRESETS)}"
            )
        return value

    @model_validator(mode="after")
    def _valid_llama(self):
        if self.init_from is not None:
            shaped = sorted(name for name in _LLAMA_FIELDS if getattr(self, name, None) is not None)
            if shaped:
                fields = ", ".join(f"model.{name}" for name in shaped)
                raise ValueError(
                    f"model.init_from={self.init_from!r} gives the model's shape, and {fields} is set too; drop "
                    f"{fields} or model.init_from"
                )
            return self
        moe_only = sorted(name for name in _MOE_ONLY_FIELDS if getattr(self, name, None) is not None)
        if moe_only and not self.is_moe:
            raise ValueError(
                f"model.{moe_only[0]} is a mixture-of-experts field, and model.preset={self.preset!r} is a dense "
                f"Llama; choose an MoE preset ({', '.join(sorted(MOE_PRESETS))}) or drop model.{moe_only[0]}"
            )
        self.llama_config(vocab_size=self.vocab_size or self.preset_config.vocab_size)  # the config's own checks
        return self

    @property
    def is_moe(self) -> bool:
        """The run trains a fresh `MoELlama` (an MoE preset and no ``init_from``)."""
        return self.init_from is None and self.preset in MOE_PRESETS

    @property
    def preset_config(self) -> LlamaConfig:
        """The preset's config as it is (`LlamaConfig`, or `MoELlamaConfig` for an MoE preset)."""
        return MOE_PRESETS[self.preset] if self.preset in MOE_PRESETS else PRESETS[self.preset]

    def llama_config(self, *, vocab_size: int) -> LlamaConfig:
        """The model's config: the preset with every set field changed, ``vocab_size`` used when unset here (a
        `MoELlamaConfig` for an MoE preset, else a `LlamaConfig`)."""
        overrides = {name: value for name, value in self.model_dump().items() if name in _LLAMA_FIELDS}
        overrides = {name: value for name, value in overrides.items() if value is not None}
        overrides.setdefault("vocab_size", vocab_size)
        if self.preset in MOE_PRESETS:
            return get_moe_preset(self.preset, **overrides)
        return get_preset(self.preset, **overrides)


_LLAMA_FIELDS = dataclass_fields(LlamaConfig, optional=True)
_MOE_ONLY_FIELDS = {
    name: (annotation, Field(default=None, description=f"Mixture-of-experts presets only: {field.description}"))
    for name, (annotation, field) in dataclass_fields(MoELlamaConfig, optional=True).items()
    if name not in _LLAMA_FIELDS
}
_LLAMA_FIELDS.update(_MOE_ONLY_FIELDS)
_LLAMA_FIELDS["vocab_size"] = (
    int | None,
    Field(
        default=None,
        description="Number of token ids. Unset: the tokenizer's vocabulary size, rounded up to a multiple of "
        "pad_vocab_to_multiple_of (the preset's own vocab_size is for its original tokenizer).",
    ),
)
ModelSection = create_model("ModelSection", __base__=_ModelBase, __doc__=_ModelBase.__doc__, **_LLAMA_FIELDS)


class OptimizerSection(_Section):
    """AdamW (Loshchilov & Hutter, 2019) with decoupled weight decay."""

    lr: float = Field(default=3e-4, gt=0, description="Peak learning rate (reached after warmup).")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="Adam's (beta1, beta2).")
    eps: float = Field(default=1e-8, gt=0, description="Adam's epsilon.")
    weight_decay: float = Field(default=0.1, ge=0, description="Decoupled weight decay of matrices and embeddings.")
    no_decay_norms_and_biases: bool = Field(
        default=True, description="Put norm weights and biases (every 1-D parameter) in a group without weight decay."
    )
    layerwise_lr_decay: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Layer-wise LR decay (Clark et al., 2020): depth i of L gets lr * decay**(L + 1 - i). A Llama: "
        "layer i is depth i + 1, the embedding 0, the final norm and lm_head L + 1; a diffusion UNet: its input "
        "convolution and time / text embeddings 0, then its down blocks, mid block and up blocks, the output last "
        "(colo.apps.diffusion.task.UNetDepth). 1.0: off.",
    )
    fused: bool | None = Field(
        default=None, description="torch AdamW's fused kernel (None: fused on CUDA, torch's default elsewhere)."
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in value):
            raise ValueError(f"betas={value} must both be in [0, 1)")
        return value


class ScheduleSection(_Section):
    """How long to train and the learning-rate schedule: linear warmup, then cosine decay to min_lr."""

    total_steps: int = Field(
        default=1000, ge=1, description="Optimizer steps of the whole run (the LR schedule's length)."
    )
    warmup_steps: int = Field(default=100, ge=0, description="Steps of linear warmup from 0 to optimizer.lr.")
    min_lr: float = Field(default=3e-5, ge=0, description="The learning rate at the end of the cosine decay.")
    num_microbatches: int = Field(
        default=1,
        ge=1,
        description="Gradient accumulation: each step's batch runs as this many microbatches (the pipeline's "
        "microbatches when pp > 1); the plugin's num_microbatches.",
    )
    stop_at_step: int | None = Field(
        default=None,
        ge=1,
        description="End the run after this step as if it were interrupted (no final checkpoint, the LR schedule "
        "unchanged); a later run with checkpoint.resume='auto' continues. For time-boxed jobs and tests.",
    )

    @model_validator(mode="after")
    def _warmup_fits(self):
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} is longer than total_steps={self.total_steps}; lower warmup_steps"
            )
        return self


class _ChatTemplateBase(_Section):
    """How ``data.task='sft'`` renders a conversation (colo.apps.data.ChatTemplate): role markers, turn ends, the
    trained role."""

    @model_validator(mode="after")
    def _valid_template(self):
        self.template()  # ChatTemplate's checks (the assistant role needs a marker)
        return self

    def template(self) -> ChatTemplate:
        """The `ChatTemplate` these settings describe."""
        return ChatTemplate(**self.model_dump())


ChatTemplateSection = create_model(
    "ChatTemplateSection",
    __base__=_ChatTemplateBase,
    __doc__=_ChatTemplateBase.__doc__,
    **dataclass_fields(ChatTemplate),
)


class BlendEntry(_Section):
    """One prepared corpus of a blend and its weight."""

    path: str = Field(description="A prepared corpus directory (written by colo data prepare; holds manifest.json).")
    weight: float = Field(
        gt=0,
        description="Its share of the training samples (weights are normalized to sum to 1, Megatron's blend "
        "semantics): a corpus whose share asks for more samples than it holds is read for more epochs, each in a "
        "new order.",
    )


class DataSection(_Section):
    """Training data (colo.apps.data): pre-training text packed into rows of seq_len tokens (read from raw files and
    tokenized at start-up, or from prepared token shards, blended by weight), or chat records for supervised
    fine-tuning with the loss on the assistant's replies only."""

    task: str = Field(
        default="pretrain",
        description="What the run trains: one of the registered tasks (colo.apps.train.task; the choices and what "
        "each reads are listed in the assembled run config's schema).",
    )
    packing: Literal["fixed", "documents"] = Field(
        default="fixed",
        description="How documents become rows: 'fixed': pre-training text as one token stream cut into seq_len "
        "windows (documents cross row boundaries, no padding), or with task='sft' one conversation per row padded "
        "to seq_len; 'documents': whole documents (or conversations, with task='sft') bin-packed into rows of "
        "seq_len slots (cut only when longer), position_ids restarting per document, no loss on a document's first "
        "token, rows padded at the end. Attention is masked per document (the model derives document ids from "
        "the position_ids), so a packed row trains exactly as its documents would one per row.",
    )
    paths: list[str] = Field(
        default_factory=list,
        description="Text, JSONL or Hugging Face dataset paths, tokenized in memory at start-up; or one prepared "
        "corpus directory (colo data prepare; holds manifest.json), read from its memory-mapped token shards "
        "(data.task='pretrain'; raw files and prepared corpora do not mix); empty: the built-in corpus (the "
        "Python standard library's .py files).",
    )
    blend: list[BlendEntry] = Field(
        default_factory=list,
        description="Prepared corpora blended by weight (list of {path, weight}; data.task='pretrain', instead of "
        "data.paths): each corpus's share of the training samples is its weight, each corpus's samples come in a "
        "new order every epoch of it, eval.num_sequences is held out of the corpora's tails by weight, and the run "
        "resumes at the exact next sample at any data-parallel size.",
    )
    format: Literal["auto", "text", "jsonl", "hf"] = Field(default="auto", description="How to read paths.")
    text_field: str = Field(default="text", description="The text field of JSONL / Hugging Face records.")
    messages_field: str = Field(
        default="messages", description="The chat-messages field of JSONL / Hugging Face records (task='sft')."
    )
    prompt_field: str = Field(default="prompt", description="The prompt field of prompt/response records (task='sft').")
    response_field: str = Field(
        default="response", description="The response field of prompt/response records (task='sft')."
    )
    chat_template: ChatTemplateSection = Field(
        default_factory=ChatTemplateSection,
        description="How task='sft' renders a conversation (colo.apps.data.ChatTemplate): role markers, turn "
        "ends, the trained role, the bos token. Only with task='sft'.",
    )
    tokenizer: str | None = Field(
        default=None, description="A tokenizer path (Hugging Face tokenizer directory); None: the byte tokenizer."
    )
    seq_len: int = Field(
        default=256,
        ge=2,
        description="Tokens per training row (a window of the token stream, a row of packed documents, or one "
        "conversation cut or padded to it).",
    )
    global_batch_size: int = Field(
        default=16,
        ge=1,
        description="Sequences per optimizer step over all data-parallel ranks; must divide by the data-parallel "
        "size times schedule.num_microbatches.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Read at most this many tokens of the corpus (None: all of it; task='pretrain'); of each "
        "prepared corpus, its stream's first this many tokens.",
    )
    shuffle: bool = Field(
        default=True,
        description="Shuffle the sequences each epoch (seeded by `seed`). A streamed corpus (data.streaming) is read "
        "in file order and ignores it.",
    )
    streaming: bool = Field(
        default=False,
        description="Stream data.paths (JSON Lines, text or Parquet files; task='pretrain', packing='fixed') "
        "through Hugging Face datasets while training instead of tokenizing the corpus at start-up "
        "(colo.apps.data.streaming): each data-parallel rank reads its share of the files (or of the documents), "
        "packed into seq_len windows in a background thread, in file order (data.shuffle does not apply); with "
        "eval.every_steps the corpus's first eval.num_sequences windows are held out. A run resumes exactly at the "
        "same data-parallel size only (prepare the corpus with colo data prepare to resume at any size).",
    )

    def prepared_corpora(self) -> list[tuple[str, str, float]]:
        """``(field, path, weight)`` of each prepared corpus the run reads (``data.blend``, or a prepared corpus
        in ``data.paths`` with weight 1); empty when it reads raw files."""
        from ..data.prepared import is_prepared_corpus

        if self.blend:
            return [(f"data.blend[{n}].path", entry.path, entry.weight) for n, entry in enumerate(self.blend)]
        return [(f"data.paths[{n}]", path, 1.0) for n, path in enumerate(self.paths) if is_prepared_corpus(path)]

    @model_validator(mode="after")
    def _prepared_corpora_alone(self):
        from ..data.prepared import is_prepared_corpus

        if self.blend and self.paths:
            raise ValueError(
                "data.blend and data.paths are both set; blend prepared corpora in data.blend, or read data.paths "
                "(raw files, or one prepared corpus), not both"
            )
        if self.blend:
            from ..data.blend import BlendPattern

            try:
                BlendPattern([entry.weight for entry in self.blend])
            except ValueError as error:
                raise ValueError(f"data.blend: {error}") from None
        for number, entry in enumerate(self.blend):
            if os.path.exists(entry.path) and not is_prepared_corpus(entry.path):
                raise ValueError(
                    f"data.blend[{number}].path={entry.path!r} is not a prepared corpus (no manifest.json); prepare "
                    "it with colo data prepare, or read raw files through data.paths"
                )
        prepared = [path for path in self.paths if is_prepared_corpus(path)]
        if prepared and len(prepared) < len(self.paths):
            raw = [path for path in self.paths if path not in prepared]
            raise ValueError(
                f"data.paths mixes prepared corpora ({', '.join(prepared)}) and raw files ({', '.join(raw)}); "
                "prepare the raw files too (colo data prepare) and list every corpus in data.blend, or list only "
                "raw files"
            )
        if len(prepared) > 1:
            raise ValueError(
                f"data.paths lists {len(prepared)} prepared corpora; list them in data.blend with their weights "
                "(data.blend: [{path: ..., weight: ...}, ...])"
            )
        if (self.blend or prepared) and not task_spec(self.task).reads_prepared_corpora:
            readers = sorted(name for name, spec in task_specs().items() if spec.reads_prepared_corpora)
            raise ValueError(
                f"data.task={self.task!r} reads records from raw files; prepared corpora (data.blend, or a prepared "
                f"corpus in data.paths) are read with data.task in {readers}"
            )
        if (self.blend or prepared) and self.format != "auto":
            raise ValueError(
                f"data.format={self.format!r} says how to read raw files; a prepared corpus is already tokenized: "
                "drop data.format"
            )
        return self

    @model_validator(mode="after")
    def _streams_raw_files(self):
        if not self.streaming:
            return self
        if not task_spec(self.task).streams:
            readers = sorted(name for name, spec in task_specs().items() if spec.streams)
            raise ValueError(
                f"data.streaming is read with data.task in {readers} (data.task={self.task!r}); set "
                "data.streaming=false"
            )
        refusals = (
            (
                self.packing != "fixed",
                "data.streaming packs the stream into fixed windows, and data.packing='documents' bin-packs whole "
                "documents (which needs the whole corpus); set data.packing=fixed or data.streaming=false",
            ),
            (
                bool(self.blend or self.prepared_corpora()),
                "data.streaming reads raw files, and a prepared corpus (data.blend, or one in data.paths) is already "
                "tokenized and read from its shards without a start-up cost; drop data.streaming",
            ),
            (
                self.max_tokens is not None,
                f"data.streaming reads the corpus while training, and data.max_tokens={self.max_tokens} caps what is "
                "read at start-up; drop data.max_tokens (schedule.total_steps bounds what a streamed run reads)",
            ),
            (
                self.format == "hf",
                "data.streaming reads JSON Lines, text or Parquet files, and data.format='hf' names saved Hugging "
                "Face datasets; set data.format to 'auto', 'jsonl' or 'text', or data.streaming=false",
            ),
        )
        for refused, message in refusals:
            if refused:
                raise ValueError(message)
        return self

    @model_validator(mode="after")
    def _chat_template_read(self):
        if self.chat_template != ChatTemplateSection() and not task_spec(self.task).reads_chat_template:
            readers = sorted(name for name, spec in task_specs().items() if spec.reads_chat_template)
            raise ValueError(
                f"data.chat_template is read only with data.task in {readers} (data.task={self.task!r}); set data.task "
                "or drop data.chat_template"
            )
        return self


class CheckpointSection(_Section):
    """Checkpoints: the Booster's sharded format, each in ``dir/step-NNNNNNNN``."""

    enabled: bool = Field(default=True, description="Write checkpoints at all.")
    dir: str | None = Field(default=None, description="Checkpoint directory; None: output_dir/checkpoints.")
    every_steps: int | None = Field(
        default=100, ge=1, description="Save every this many steps (None: only at the end)."
    )
    async_save: bool = Field(
        default=True,
        description="Write checkpoints in a background thread while training goes on (the state is copied to host "
        "buffers at the save step; at most one save in flight; committed by a rename once every rank has written; "
        "the run waits for it before it ends). False: every save blocks its step.",
    )
    keep_last: int | None = Field(
        default=2, ge=1, description="Keep the newest this many checkpoints, deleting older ones (None: keep all)."
    )
    resume: str = Field(
        default="auto",
        description="'auto': continue from the newest complete checkpoint in dir if there is one; 'none': start "
        "fresh; or a checkpoint directory to start from.",
    )
    save_final: bool = Field(default=True, description="Save a checkpoint after the last step.")
    every_minutes: float | None = Field(
        default=None,
        gt=0,
        description="Also save when this many minutes passed since the last checkpoint (rank 0 decides, every rank "
        "saves at the same step), bounding the work a failure loses on slow steps (None: by steps only).",
    )


class ResilienceSection(_Section):
    """Failure handling (colo.apps.train.resilience): SIGTERM checkpoints and exits with code 75 (preempted, resume
    with the same command), a hang watchdog per rank, and per-attempt records saying which rank failed and why."""

    watchdog_seconds: float | None = Field(
        default=1800.0,
        gt=0,
        description="End a rank (exit code 86, failing the job) when no step finished for this many seconds, after "
        "writing its Python stacks and last collective to output_dir/hang/rank-R.txt (None: no watchdog). Keep it "
        "above the slowest step, eval or checkpoint save.",
    )


class LoggingSection(_Section):
    """Metrics: a progress bar and log lines on rank 0, a JSONL file, TensorBoard when installed."""

    every_steps: int = Field(default=10, ge=1, description="Log metrics every this many steps.")
    jsonl: bool = Field(default=True, description="Append every logged step to output_dir/metrics.jsonl.")
    tensorboard: bool = Field(
        default=True, description="Write TensorBoard scalars to output_dir/tensorboard when tensorboard is installed."
    )
    progress_bar: bool = Field(default=True, description="Show a rich progress bar (on a terminal).")
    peak_flops: float | None = Field(
        default=None,
        gt=0,
        description="Peak FLOP/s of one device for MFU; None: colo.apps.peak_flops() (known GPUs in bf16/fp16, "
        "else MFU shows n/a).",
    )
    report_to: list[Literal["wandb", "mlflow"]] = Field(
        default=[],
        description="Experiment trackers that also get the resolved run config, every logged metric and the samples "
        "(rank 0): 'wandb' (Weights & Biases; WANDB_MODE=offline works without an account) and / or 'mlflow' "
        "(MLFLOW_TRACKING_URI; unset: MLflow's default, sqlite:///mlflow.db in the working directory). Optional "
        "extras (pip install 'colo-apps[wandb]' / 'colo-apps[mlflow]'), imported only when listed.",
    )
    project: str | None = Field(
        default=None, description="The tracker's project (W&B) / experiment (MLflow); None: 'colo'."
    )
    rank_timing: bool = Field(
        default=False,
        description="Time each rank's forward, backward, optimizer step and communication wait, gather them every "
        "logging.every_steps steps (one small all-gather) and log the slowest rank and its lag (the whole table in "
        "metrics.jsonl). Off: no timing code runs.",
    )


class ProfileSection(_Section):
    """torch.profiler traces over windows of steps: one Chrome / Perfetto JSON trace per profiled rank in
    output_dir/profile/, with colo's regions named (forward, backward, optimizer step, collectives with their axis and
    bytes, pipeline actions, rollout, checkpoint save). Off (every_steps unset): no profiler and no hooks run."""

    every_steps: int | None = Field(
        default=None, ge=1, description="Profile a window every this many steps, ending at its multiples (None: never)."
    )
    warmup_steps: int = Field(default=1, ge=0, description="Steps the profiler runs untraced before each window.")
    active_steps: int = Field(default=2, ge=1, description="Steps traced in each window.")
    ranks: list[int] | None = Field(default=[0], description="The ranks that profile (None: every rank).")
    record_shapes: bool = Field(default=False, description="Record the ops' input shapes (larger traces).")
    memory_history: bool = Field(
        default=False,
        description="CUDA only (refused elsewhere): record the allocator's history from the first step (the newest "
        "100,000 events) and write a snapshot (output_dir/profile/memory-rank-R-step-N.pickle, the format torch's "
        "memory_viz reads; pickle, written only when asked) at the end of each window and on an out-of-memory error.",
    )

    @model_validator(mode="after")
    def _window_fits(self):
        if self.every_steps is not None and self.warmup_steps + self.active_steps > self.every_steps:
            raise ValueError(
                f"profile.warmup_steps={self.warmup_steps} + profile.active_steps={self.active_steps} do not fit in "
                f"profile.every_steps={self.every_steps}; raise every_steps or shorten the window"
            )
        return self


class EvalSection(_Section):
    """Periodic evaluation on held-out sequences (the last ones of the packed corpus, never trained on)."""

    every_steps: int | None = Field(default=None, ge=1, description="Evaluate every this many steps (None: never).")
    num_sequences: int = Field(
        default=0, ge=0, description="Sequences held out of training for evaluation (0: no evaluation)."
    )
    batch_size: int = Field(default=8, ge=1, description="Sequences per evaluation batch per data-parallel rank.")


class SampleSection(_Section):
    """A text sample generated from the final model (greedy unless temperature > 0)."""

    prompt: str = Field(default="def ", description="The prompt to continue.")
    prompts: list[str] = Field(default=[], description="More prompts, each continued like `prompt`.")
    max_new_tokens: int = Field(default=64, ge=0, description="Tokens to generate (0: no sample).")
    temperature: float = Field(default=0.0, ge=0, description="Sampling temperature; 0: greedy.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass (with temperature > 0).")
    beside_greedy_temperature: float = Field(
        default=0.8,
        ge=0,
        description="With temperature 0, also show a sample at this temperature (top-p 0.95) after each greedy one: "
        "a greedy continuation of a small model often repeats itself. 0: greedy only.",
    )


class LoraSection(_Section):
    """LoRA fine-tuning (Hu et al., 2021) through peft (colo.apps.lora): the model's weights are frozen and low-rank
    adapters of its projections are trained; under tensor parallelism they are sharded like their layer, under ZeRO
    only they have optimizer state. Checkpoints hold base weights and adapters; `colo convert --to hf` merges them,
    `--to peft` writes the adapters alone."""

    enabled: bool = Field(default=False, description="Train LoRA adapters instead of the whole model.")
    r: int = Field(default=16, ge=1, description="The adapters' rank.")
    alpha: float = Field(default=32.0, gt=0, description="The scale numerator: updates are (alpha / r) * B A.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | None = Field(
        default=None,
        description="Names (or name suffixes) of the linears to adapt; None: every projection of every decoder "
        "layer (qkv_proj, o_proj, gate_proj, up_proj, down_proj).",
    )
    use_rslora: bool = Field(default=False, description="Rank-stabilized scaling alpha / sqrt(r) (rsLoRA).")

    @property
    def scaling(self) -> float:
        """The factor of ``B A`` in the adapted weights."""
        return self.alpha / (self.r**0.5 if self.use_rslora else self.r)


class BaseRunConfig(_Section):
    """One training run: model, parallelism, optimizer, schedule, data, checkpoints, logging, eval; the sections
    of the registered tasks are added to it by `run_config_class` (the class users see as `RunConfig`)."""

    name: str = Field(default="run", description="The run's name (shown in logs).")
    output_dir: str = Field(
        default="runs/run",
        description="Directory of the run's files: checkpoints/, metrics.jsonl, tensorboard/ (relative to the "
        "working directory).",
    )
    seed: int = Field(default=0, description="Seed of the model initialization, the data order and torch's RNG.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="'auto': CUDA when available (one device per local rank), else CPU."
    )
    model: ModelSection = Field(default_factory=ModelSection, description=ModelSection.__doc__)
    plugin: PluginConfig = Field(default_factory=lambda: DDPSection(name="ddp"), description="The Booster plugin.")
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection, description=OptimizerSection.__doc__)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection, description=ScheduleSection.__doc__)
    data: DataSection = Field(default_factory=DataSection, description=DataSection.__doc__)
    lora: LoraSection = Field(default_factory=LoraSection, description=LoraSection.__doc__)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description=CheckpointSection.__doc__)
    resilience: ResilienceSection = Field(default_factory=ResilienceSection, description=ResilienceSection.__doc__)
    logging: LoggingSection = Field(default_factory=LoggingSection, description=LoggingSection.__doc__)
    profile: ProfileSection = Field(default_factory=ProfileSection, description=ProfileSection.__doc__)
    eval: EvalSection = Field(default_factory=EvalSection, description=EvalSection.__doc__)
    sample: SampleSection = Field(default_factory=SampleSection, description=SampleSection.__doc__)

    @model_validator(mode="after")
    def _cross_checks(self):
        if self._rows_vary_in_labelled_tokens() and "loss_weighting" not in self.plugin.model_fields_set:
            self.plugin.loss_weighting = "token"  # every labelled token weighs the same (see LoRA/SFT docs)
        try:  # schedule checks of the plugin (pipeline microbatches) need schedule.num_microbatches
            self.plugin.build(num_microbatches=self.schedule.num_microbatches, seed=self.seed)
        except ValueError as error:
            raise ValueError(f"plugin / schedule.num_microbatches: {error}") from None
        if self.data.global_batch_size % self.schedule.num_microbatches:
            raise ValueError(
                f"data.global_batch_size={self.data.global_batch_size} does not divide into "
                f"schedule.num_microbatches={self.schedule.num_microbatches}; make it a multiple"
            )
        self._check_mixture_of_experts()
        self._check_task()
        pipelined = self.plugin.name == "hybrid" and self.plugin.pp > 1
        microbatches = self.schedule.num_microbatches
        if pipelined and self.eval.every_steps and self.eval.batch_size % microbatches:
            raise ValueError(
                f"eval.batch_size={self.eval.batch_size}: with plugin.pp > 1 an eval batch is split into "
                f"schedule.num_microbatches={microbatches}; make eval.batch_size a multiple of {microbatches}"
            )
        if self.schedule.stop_at_step is not None and self.schedule.stop_at_step > self.schedule.total_steps:
            raise ValueError(
                f"schedule.stop_at_step={self.schedule.stop_at_step} is after schedule.total_steps="
                f"{self.schedule.total_steps}; lower it or leave it unset"
            )
        max_positions = self.model.max_position_embeddings or self.model.preset_config.max_position_embeddings
        if self.model.init_from is None and self.data.seq_len > max_positions:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} is longer than the model's max_position_embeddings={max_positions}; "
                "lower data.seq_len or set model.max_position_embeddings"
            )
        return self

    def _check_mixture_of_experts(self) -> None:
        """An MoE preset trains under ``plugin.name: expert`` or ``hybrid`` (ep dividing its experts; ``hybrid``
        composes ep with tp, pp and ZeRO-3), pre-training or SFT, without LoRA; ``expert``, or ``hybrid`` with
        ``ep > 1``, needs an MoE preset. (ep dividing the world size is checked when the ranks start.)"""
        model, plugin = self.model, self.plugin
        splits_experts = plugin.name == "expert" or (plugin.name == "hybrid" and plugin.ep > 1)
        if splits_experts and not model.is_moe:
            what = f"model.init_from={model.init_from!r}" if model.init_from else f"model.preset={model.preset!r}"
            field = "plugin.name='expert'" if plugin.name == "expert" else f"plugin.ep={plugin.ep}"
            raise ValueError(
                f"{field} splits the experts of a mixture-of-experts model, and {what} is a dense Llama; set "
                f"model.preset to one of {sorted(MOE_PRESETS)} (and no model.init_from), or "
                + ("use another plugin" if plugin.name == "expert" else "plugin.ep=1")
            )
        if not model.is_moe:
            return
        if plugin.name not in ("expert", "hybrid"):
            raise ValueError(
                f"model.preset={model.preset!r} is a mixture-of-experts model, which the trainer runs under "
                f"plugin.name='expert' or 'hybrid' (plugin.name={plugin.name!r}); set plugin.name='expert' (ep with "
                "ZeRO 0-2; plugin.ep=1 keeps every expert on every rank) or 'hybrid' (plugin.ep with tp, pp, ZeRO-3)"
            )
        experts = model.num_local_experts or MOE_PRESETS[model.preset].num_local_experts
        if experts % plugin.ep:
            raise ValueError(
                f"plugin.ep={plugin.ep} does not divide model.num_local_experts={experts}: every ep rank holds the "
                f"same number of experts; choose plugin.ep dividing {experts}"
            )
        if self.lora.enabled:
            raise ValueError(
                f"lora.enabled with the mixture-of-experts model.preset={model.preset!r} is not supported (adapters of "
                "the experts are not implemented); set lora.enabled=false"
            )
        if not task_spec(self.data.task).supports_moe:
            tasks = sorted(name for name, spec in task_specs().items() if spec.supports_moe)
            raise ValueError(
                f"data.task={self.data.task!r} with the mixture-of-experts model.preset={model.preset!r} is not "
                f"supported in the trainer; MoE presets train with data.task in {tasks}"
            )

    def _check_task(self) -> None:
        """The run's task's support rules (`colo.apps.train.task.TaskSpec.validate`); the sections of other tasks
        stay at their defaults (a setting nothing reads is an error, not silently ignored)."""
        spec = task_spec(self.data.task)
        for section, (section_type, readers) in sections(task_specs().values()).items():
            if self.data.task not in readers and getattr(self, section) != section_type():
                which = " or ".join(repr(name) for name in readers)
                raise ValueError(f"{section}.* is read only with data.task={which} (data.task={self.data.task!r})")
        spec.validate(self)

    def _rows_vary_in_labelled_tokens(self) -> bool:
        """SFT rows and rows of packed documents hold different numbers of labelled tokens: they default to
        ``plugin.loss_weighting='token'`` (not with a pipeline, which averages its microbatches itself)."""
        varying = task_spec(self.data.task).rows_vary_in_labelled_tokens or self.data.packing == "documents"
        return varying and not (self.plugin.name == "hybrid" and self.plugin.pp > 1)

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints go: ``checkpoint.dir``, or ``output_dir/checkpoints``."""
        import os

        return self.checkpoint.dir or os.path.join(self.output_dir, "checkpoints")


def _same_path(first: str, second: str) -> bool:
    import os

    return os.path.realpath(first) == os.path.realpath(second)


_assembled: type[BaseRunConfig] | None = None


def run_config_class() -> type[BaseRunConfig]:
    """`RunConfig`: `BaseRunConfig` with each registered task's section (``preference``, ``grpo``, ``ppo``,
    ``diffusion``, ...) and ``data.task`` restricted to the registered names; assembled once, on first use."""
    global _assembled
    if _assembled is None:
        specs = task_specs()
        names = tuple(specs)
        described = "; ".join(f"'{name}': {spec.summary}" for name, spec in specs.items())
        data = create_model(
            "RunDataSection",
            __base__=DataSection,
            __doc__=DataSection.__doc__,
            task=(Literal[names], Field(default="pretrain", description=f"What the run trains. {described}")),
        )
        data.__module__ = __name__  # pickled by name, found through this module's __getattr__
        fields = {"data": (data, Field(default_factory=data, description=DataSection.__doc__))}
        for section, (section_type, _) in sections(specs.values()).items():
            fields[section] = (section_type, Field(default_factory=section_type, description=section_type.__doc__))
        _assembled = create_model("RunConfig", __base__=BaseRunConfig, __doc__=BaseRunConfig.__doc__, **fields)
        _assembled.__module__ = __name__
    return _assembled


def __getattr__(name: str):
    """``RunConfig`` (and its ``RunDataSection``) are assembled from the registered tasks on first use
    (`run_config_class`)."""
    if name == "RunConfig":
        return run_config_class()
    if name == "RunDataSection":  # the data section with data.task's registered choices
        return run_config_class().model_fields["data"].annotation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
