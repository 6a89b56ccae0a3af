"""Language modelling as a `TrainTask`: ``data.task: pretrain | sft`` (dense or mixture-of-experts Llama), and the
base of every task that trains the run's Llama (preference training and online RL build on it).

`LanguageModelTask` builds the model from the preset (the same seed on every rank; pretrained with
``model.init_from``; a `MoELlama` for a mixture-of-experts preset; LoRA adapters when asked), the data (packed
windows, documents or chats, a held-out tail, this rank's resumable sampler), runs the next-token step, reports
tokens/s and MFU (and router statistics for an MoE model), evaluates held-out loss and, at the end, prints samples
generated from the final checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from colo.comm import all_gather_object
from colo.tensor.moe import moe_aux_loss, moe_blocks

from ..booster.llama_plan import set_materialize_fn
from ..data import check_token_ids, collate, load_tokenizer
from ..generation import complete
from ..lora import add_lora, lora_layers
from ..mfu import mfu, peak_flops
from ..models.llama import Llama, flops_per_token
from ..models.moe_llama import MoELlama, MoELlamaConfig
from ..runs import PretrainedLlamaWeights, load_llama, load_pretrained_llama, pretrained_llama_config
from .data_setup import RunData, build_data, build_dataset, open_prepared
from .task import TaskContext, TaskRule, TaskSpec, TrainTask


class LanguageModelTask(TrainTask):
    """Next-token training of the run's Llama (see the module docstring).

    Args:
        config: the run config.

    Raises:
        ValueError: the tokenizer does not fit the model (before any collective).
    """

    chats = False
    """Whether rows are conversations rendered by ``data.chat_template`` (samples answer through it)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        open_prepared(config.data, self.tokenizer)  # a prepared corpus made with another tokenizer: refused here
        self.llama_config = self._llama_config()
        self._train_batches = None

    # --- setup ----------------------------------------------------------------------------------------------------

    def _llama_config(self):
        vocab = self.tokenizer.vocab_size
        init_from = self.config.model.init_from
        if init_from is not None:
            llama = pretrained_llama_config(init_from)
            if llama.vocab_size < vocab:
                raise ValueError(
                    f"model.init_from={init_from!r} has vocab_size={llama.vocab_size}, fewer ids than the tokenizer "
                    f"({vocab}); use the model's own tokenizer (data.tokenizer)"
                )
            return llama
        multiple = self.config.model.pad_vocab_to_multiple_of
        llama = self.config.model.llama_config(vocab_size=-(-vocab // multiple) * multiple)
        if llama.vocab_size < vocab:
            raise ValueError(
                f"model.vocab_size={llama.vocab_size} is smaller than the tokenizer's vocabulary ({vocab}); set "
                f"model.vocab_size >= {vocab} or leave it unset"
            )
        return llama

    def build_model(self, ctx: TaskContext, *, init_from: str | None = None) -> Llama:
        """The run's model: pretrained (``init_from``, by default ``model.init_from``) or fresh from the seed, with
        LoRA adapters when asked; a fresh `MoELlama` for a mixture-of-experts preset."""
        config = self.config
        init_from = config.model.init_from if init_from is None else init_from
        if isinstance(self.llama_config, MoELlamaConfig):  # (the config allows it under the expert and hybrid plugins)
            with torch.device(ctx.device):
                model = MoELlama(self.llama_config)
            model.init_weights(config.seed)
            return model
        if ctx.plugin.materializes_meta_models:
            with torch.device("meta"):  # each rank materializes only its shards: from the seed or init_from
                model = Llama(self.llama_config)
            if init_from is not None:
                set_materialize_fn(model, PretrainedLlamaWeights(init_from, self.llama_config))
        elif init_from is not None:
            model = load_pretrained_llama(init_from, device=ctx.device)
        else:
            with torch.device(ctx.device):
                model = Llama(self.llama_config)
            model.init_weights(config.seed)
        if config.lora.enabled:  # the same adapters on every rank (on a meta model: when the plugin materializes it)
            add_lora(
                model,
                r=config.lora.r,
                alpha=config.lora.alpha,
                dropout=config.lora.dropout,
                target_modules=config.lora.target_modules,
                use_rslora=config.lora.use_rslora,
                seed=config.seed,
            )
        return model

    def num_layers(self, model) -> int:
        return model.config.num_hidden_layers

    @classmethod
    def dataset_rows(cls, config, tokenizer) -> tuple:
        """The task's rows: ``(dataset, real tokens of each row or None when every row is full, a description)``."""
        cache_dir = os.path.join(config.output_dir, "data-cache")  # a read-only prepared corpus's row index
        return build_dataset(config.data, tokenizer, chats=cls.chats, cache_dir=cache_dir)

    def build_data(self, ctx: TaskContext) -> RunData:
        """This rank's share of `dataset_rows`, a held-out tail, and the resumable sampler."""
        group = ctx.sample_group
        return build_data(
            self.config,
            self.tokenizer,
            num_replicas=group.size,
            rank=group.rank,
            vocab_size=self.llama_config.vocab_size,
            rows=None if self.config.data.streaming else self.dataset_rows(self.config, self.tokenizer),
        )

    def describe(self, ctx: TaskContext) -> list[str]:
        config, data, shape = self.config, ctx.data, self.llama_config
        moe = ""
        if isinstance(shape, MoELlamaConfig):
            layers = "every layer" if shape.moe_layer_interval == 1 else f"every {shape.moe_layer_interval}th layer"
            moe = (
                f" ({shape.num_active_parameters() / 1e6:.2f}M active; {shape.num_local_experts} experts, top-"
                f"{shape.num_experts_per_tok}, on {layers})"
            )
        lines = [
            f"model: {type(ctx.booster.unwrap()).__name__} {config.model.init_from or config.model.preset}, "
            f"{shape.num_parameters() / 1e6:.2f}M parameters{moe}, "
            f"vocab {shape.vocab_size} | data: "
            + ("streamed" if data.train is None else f"{len(data.train)}")
            + f" sequences of {config.data.seq_len} tokens, {config.data.global_batch_size} per step"
            + (f", {len(data.eval)} held out" if data.eval is not None else ""),
        ]
        if config.lora.enabled:
            lines.append(self._describe_lora(ctx.model))
        lines.append(f"rows: {data.description}")
        return lines

    def _describe_lora(self, model) -> str:
        lora = self.config.lora
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        return (
            f"LoRA: r={lora.r}, alpha={lora.alpha:g} on {len(list(lora_layers(model)))} linears | trainable "
            f"{trainable / 1e6:.3f}M of {total / 1e6:.2f}M parameters on this rank ({100 * trainable / total:.2f}%)"
        )

    # --- the step -------------------------------------------------------------------------------------------------

    def train_step(self, ctx: TaskContext, step: int):
        """The next batch of this rank's sampler through `Booster.train_step`; counts its real tokens."""
        if self._train_batches is None:
            self._train_batches = ctx.data.train_batches()
        batch, num_tokens = next(self._train_batches)
        batch = {name: tensor.to(ctx.device, non_blocking=True) for name, tensor in batch.items()}
        return ctx.booster.train_step(batch), num_tokens

    def throughput(self, ctx: TaskContext, *, units: int, seconds: float) -> dict[str, float]:
        """``tokens_per_second``: real tokens over all data-parallel ranks (every slot of a fixed window, not the
        padding of SFT rows or rows of packed documents); ``mfu`` from it."""
        tokens_per_second = self._tokens_over_sample_ranks(ctx, units) / seconds
        flops = flops_per_token(self.llama_config, self.config.data.seq_len)
        if isinstance(self.llama_config, MoELlamaConfig):  # model FLOPs count the experts a token runs through
            flops -= 6 * (self.llama_config.num_parameters() - self.llama_config.num_active_parameters())
        peak = self.config.logging.peak_flops or peak_flops(ctx.device, ctx.plugin.compute_dtype)
        return {
            "tokens_per_second": tokens_per_second,
            "mfu": mfu(tokens_per_second, flops, peak, num_devices=ctx.world_size),
        }

    def _tokens_over_sample_ranks(self, ctx: TaskContext, num_tokens: int) -> int:
        """This rank's count of real tokens summed over the ranks that get different samples (no collective when
        every row is full: the count is then the same on every rank)."""
        group = ctx.sample_group
        if ctx.data.tokens_per_row is None or group.size == 1:
            return num_tokens * group.size
        return sum(all_gather_object(num_tokens, group=group))

    def take_metrics(self, ctx: TaskContext) -> dict[str, float]:
        return self._router_metrics(ctx)

    def _router_metrics(self, ctx: TaskContext) -> dict[str, float]:
        """Router statistics of the logged step's last microbatch forward, over every data rank (one gather; every
        rank calls it; empty for a dense model), from each `colo.tensor.moe.MoEBlock`'s ``stats`` (the values
        `colo.tensor.moe.router_stats` reports per block):

        - ``moe_load_balancing_loss``: the unweighted Switch/GShard loss (``num_experts_per_tok`` at perfect
          balance), mean over MoE layers and ranks; ``moe_z_loss``: the router z-loss, the same mean;
        - ``moe_drop_fraction``: the fraction of assignments over capacity (0 when dropless), the same mean;
        - ``moe_max_expert_share``: the largest share of all ranks' assignments one expert got, in the worst MoE
          layer (``1 / num_local_experts`` is perfect balance).
        """
        blocks = [block for _, block in moe_blocks(ctx.model) if block.stats]
        if not blocks:
            return {}
        local = [
            {
                "load_balancing_loss": float(block.stats["load_balancing_loss"]),
                "z_loss": float(block.stats["z_loss"]),
                "drop_fraction": float(block.stats["drop_fraction"]),
                "tokens_per_expert": block.stats["tokens_per_expert"].tolist(),
            }
            for block in blocks
        ]
        ranks = all_gather_object(local, group=ctx.sample_group)
        per_block = [[rank[i] for rank in ranks] for i in range(len(blocks))]
        mean = {
            name: sum(entry[name] for block in per_block for entry in block) / (len(per_block) * len(ranks))
            for name in ("load_balancing_loss", "z_loss", "drop_fraction")
        }
        shares = []
        for block in per_block:
            counts = [sum(column) for column in zip(*(entry["tokens_per_expert"] for entry in block))]
            shares.append(max(counts) / max(sum(counts), 1))
        return {f"moe_{name}": value for name, value in mean.items()} | {"moe_max_expert_share": max(shares)}

    # --- eval and samples -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, ctx: TaskContext, step: int) -> float | None:
        """The mean loss over the held-out sequences (every rank takes an equal share); logs it. For an MoE model it
        is the next-token loss alone (the router's auxiliary losses, part of the training loss, left out)."""
        group, evaluation = ctx.sample_group, ctx.data.eval
        if evaluation is None:
            return None
        per_rank = len(evaluation) // group.size
        size = self.config.eval.batch_size
        microbatches = ctx.booster.eval_microbatches
        starts = range(0, per_rank - size + 1, size)
        if microbatches > 1:  # a pipeline: forward-only through the stages, the batch split into its microbatches
            if size % microbatches or not starts:
                raise ValueError(
                    f"eval with pp > 1 runs batches of eval.batch_size={size} sequences split into "
                    f"schedule.num_microbatches={microbatches}, with at least one whole batch per data-parallel rank "
                    f"({per_rank} held out here): make eval.batch_size a multiple of {microbatches} and "
                    f"eval.num_sequences at least {size * group.size}"
                )
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        for first in starts or [0]:
            indices = [group.rank + group.size * i for i in range(first, min(first + size, per_rank))]
            if not indices:
                break
            batch = collate([evaluation[i] for i in indices])
            check_token_ids(batch, self.llama_config.vocab_size)
            micro = {name: tensor.to(ctx.device) for name, tensor in batch.items()}
            loss = ctx.booster.eval_step(micro)
            aux = moe_aux_loss(ctx.model)  # an MoE model's loss holds this forward's router losses: leave them out
            total += (loss if aux is None else loss - aux.to(loss.dtype)).double().cpu()
            count += 1
        loss = ctx.booster.mean_over_data_ranks(total / max(count, 1))
        ctx.log.log({"step": step, "eval_loss": loss})
        ctx.log.print(f"eval at step {step}: held-out loss {loss:.4f} (perplexity {math.exp(min(loss, 50)):.2f})")
        return loss

    def finish(self, ctx: TaskContext, *, final_checkpoint: str | None) -> str | None:
        """Rank 0: generate ``sample.max_new_tokens`` after ``sample.prompt`` (and ``sample.prompts``) from the final
        checkpoint; an SFT run answers each prompt as a user message through its chat template."""
        settings = self.config.sample
        if ctx.rank != 0 or settings.max_new_tokens == 0:
            return None
        if final_checkpoint is None:
            ctx.log.print("no sample: it is generated from the final checkpoint, and checkpointing is off")
            return None
        model, _ = load_llama(final_checkpoint, device=ctx.device)
        template = self.config.data.chat_template.template() if self.chats else None
        samplings = [(settings.temperature, settings.top_p)]
        if settings.temperature == 0 and settings.beside_greedy_temperature > 0:
            samplings.append((settings.beside_greedy_temperature, 0.95))
        first = None
        for index, prompt in enumerate([settings.prompt, *settings.prompts]):
            for temperature, top_p in samplings:
                text = complete(
                    model,
                    self.tokenizer,
                    prompt,
                    chat_template=template,
                    escape_bytes=True,
                    max_new_tokens=settings.max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    generator=torch.Generator().manual_seed(self.config.seed + index),  # a stream per prompt
                )
                how = "greedy" if temperature == 0 else f"temperature {temperature:g}, top-p {top_p:g}"
                ctx.log.print(f"sample ({how}{', chat template' if self.chats else ''}, KV cache):\n{text}")
                kind = "greedy" if temperature == 0 else "sampled"
                ctx.log.log_sample_text(f"sample/{index}-{kind}", text, self.config.schedule.total_steps)
                first = text if first is None else first
        return first

    # --- checkpoints ----------------------------------------------------------------------------------------------

    def data_state(self, ctx: TaskContext) -> dict:
        """The data position (`RunData.state_dict`): the batches this rank consumed; over prepared corpora, the
        global sample position; a streamed run's, every data-parallel rank's stream position."""
        return ctx.data.state_dict(ctx.sample_group)

    def load_data_state(self, ctx: TaskContext, state: dict | None) -> None:
        if state is not None:
            ctx.data.load_state_dict(state, ctx.sample_group)

    def close(self, ctx: TaskContext) -> None:
        """Stop reading the data (a stream's background thread)."""
        if ctx.data is not None:
            ctx.data.close()

    def run_metadata(self, ctx: TaskContext) -> dict:
        """The model's shape and tokenizer (how `colo.apps.runs.load_llama` opens the checkpoint), and an
        SFT run's chat template (how ``colo generate --chat`` and serving render conversations)."""
        metadata = {"llama_config": dataclasses.asdict(self.llama_config), "tokenizer": self.config.data.tokenizer}
        if self.chats:
            metadata["chat_template"] = self.config.data.chat_template.model_dump(mode="json")
        return metadata


class ChatTask(LanguageModelTask):
    """``data.task: sft``: next-token loss on the assistant's replies of chat records; samples answer through the
    chat template."""

    chats = True


def record_data_rules(task: str, records: str, one_per_row: str, reads: str) -> tuple[TaskRule, ...]:
    """The ``data`` rules of a task that reads records (not plain text): a record format, no document packing
    (unless the task packs them itself), no token cap (it reads ``reads``)."""
    rules = [
        TaskRule(
            "data.format",
            lambda c: c.data.format == "text",
            lambda c: (
                f"data.task={task!r} reads {records}, which data.format='text' cannot hold; set data.format to "
                "'jsonl', 'hf' or 'auto'"
            ),
            summary="data.format='text': it reads " + records,
        ),
        TaskRule(
            "data.max_tokens",
            lambda c: c.data.max_tokens is not None,
            lambda c: (
                f"data.max_tokens={c.data.max_tokens} caps pre-training text; data.task={task!r} reads {reads}: "
                "set data.max_tokens=null"
            ),
            summary="data.max_tokens set: it reads " + reads.split(" (")[0],
        ),
    ]
    if one_per_row:
        rules.append(
            TaskRule(
                "data.packing",
                lambda c: c.data.packing != "fixed",
                lambda c: f"data.task={task!r} {one_per_row}; drop data.packing='documents'",
                summary="data.packing='documents': it " + one_per_row,
            )
        )
    return tuple(rules)


_SFT_RULES = (
    *record_data_rules("sft", "chat records", "", "every conversation (use fewer records in data.paths)"),
    TaskRule(
        "data.paths",
        lambda c: not c.data.paths,
        lambda c: (
            "data.task='sft' needs data.paths of chat records (JSONL with a 'messages' field or 'prompt' and "
            "'response' fields, or a saved Hugging Face dataset); the built-in corpus is plain text"
        ),
        summary="no data.paths: the built-in corpus is plain text, not chats",
    ),
)

LANGUAGE_MODEL_TASKS = (
    TaskSpec(
        name="pretrain",
        summary="next-token loss on every token of text documents",
        load=lambda: LanguageModelTask,
        reads_prepared_corpora=True,
        streams=True,
        batches_rows_of_seq_len=True,
        supports_moe=True,
    ),
    TaskSpec(
        name="sft",
        summary="chat records (JSONL / Hugging Face rows with a messages field or prompt/response fields) rendered by "
        "data.chat_template, one conversation per row (cut at or right-padded to data.seq_len), the loss only on the "
        "assistant's replies",
        load=lambda: ChatTask,
        rules=_SFT_RULES,
        reads_chat_template=True,
        rows_vary_in_labelled_tokens=True,
        batches_rows_of_seq_len=True,
        supports_moe=True,
    ),
)
"""The language-modelling tasks' registry entries (registered by `colo.apps.recipes`)."""
