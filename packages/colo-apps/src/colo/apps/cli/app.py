"""The ``colo`` command (typer): train, launch, info, config, generate, convert."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Annotated

import typer

app = typer.Typer(
    name="colo",
    help="colo: distributed training for PyTorch. Train a Llama, launch jobs, inspect the environment.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config field: --set optimizer.lr=1e-3 (repeatable; YAML values)."),
]
PresetOption = Annotated[
    str | None, typer.Option("--preset", "-p", help="A named run config (listed below; `colo config --list`).")
]
ConfigArgument = Annotated[str | None, typer.Argument(help="A run config file (.yaml, .yml or .toml).")]


def _fields_help() -> str:
    """The run config's fields with their defaults and descriptions, for ``colo train --help``."""
    from ..train.config import RunConfig

    lines = ["Run config fields (set in the file or with --set KEY=VALUE; `colo config --schema` for all):", ""]

    def walk(model, prefix: str) -> None:
        for name, info in model.model_fields.items():
            annotation = info.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation, f"{prefix}{name}.")
                continue
            if name == "plugin":
                lines.append(
                    f"plugin.name: ddp | zero | gemini | hybrid, plus that plugin's fields ({info.description})"
                )
                continue
            default = info.get_default(call_default_factory=True)
            lines.append(f"{prefix}{name} = {default!r}: {info.description}")

    walk(RunConfig, "")
    return "\n\n".join(lines)


def _presets_help() -> str:
    """Every run preset with its one-line description, from the preset registry, for ``--help``."""
    from ..train.presets import PRESET_DESCRIPTIONS, RUN_PRESETS

    lines = ["Run presets (--preset NAME; `colo config --list` prints them as a table):"]
    lines += [f"{name}: {PRESET_DESCRIPTIONS[name]}" for name in RUN_PRESETS]
    return "\n\n".join(lines)


def _load(
    config: str | None,
    preset: str | None,
    overrides: list[str] | None,
    *,
    preflight: bool = False,
    world_size: int | None = None,
):
    """The run config, or exit 2 printing ``colo: <the error>``; ``preflight`` adds the checks of the files and the
    model's shape (`colo.apps.train.preflight`) that training would otherwise fail on inside every rank, and with
    ``world_size`` the layout over that many processes (`colo.apps.train.world_check`)."""
    from ..train import ConfigError, load_config

    try:
        run = load_config(config, preset=preset, overrides=overrides or [])
        if preflight:
            from ..train.preflight import check_before_start

            check_before_start(run)
        if world_size is not None:
            from ..train.world_check import check_world_size

            check_world_size(run, world_size)
        return run
    except ConfigError as error:
        typer.echo(f"colo: {error}", err=True)
        raise typer.Exit(2) from None


@app.command(epilog=None, context_settings={"max_content_width": 120})
def train(config: ConfigArgument = None, preset: PresetOption = None, set_: SetOption = None) -> None:
    """Train a Llama from a run config file or --preset, with --set overrides (on every rank of the job).

    Run it under `colo launch` for several processes: colo launch --nproc-per-node 2 -- train --preset tiny-llama

    Exit codes: 0 done, 2 invalid run config, 75 preempted (SIGTERM: checkpointed; the same command resumes),
    86 a rank hung (resilience.watchdog_seconds; stacks in OUTPUT_DIR/hang/), 1 any other failure.
    """
    run = _load(config, preset, set_, preflight=True, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    from ..train import Trainer
    from ..train.resilience import PREEMPTED_EXIT_CODE

    try:  # setting up reads the data and builds the layout: what fails there is the user's input
        trainer = Trainer(run)
    except (ValueError, OSError) as error:
        _input_error(error)
    result = trainer.fit()
    if result.preempted:
        raise typer.Exit(PREEMPTED_EXIT_CODE)


from .launch import INPUT_ERROR_FILE_ENV  # noqa: E402  (where rank 0 writes an input error under colo launch)


def _input_error(error: Exception):
    """Report an error about the user's input (data, sizes, paths) found while a run is set up: one line from rank
    0, exit code 2 on every rank; the traceback only with ``COLO_DEBUG=1``."""
    if os.environ.get("COLO_DEBUG") == "1":
        raise error
    if os.environ.get("RANK", "0") == "0":
        typer.echo(f"colo: {error} (COLO_DEBUG=1 shows the traceback)", err=True)
        marker = os.environ.get(INPUT_ERROR_FILE_ENV)
        if marker:  # under colo launch: it exits 2 too, not with torchrun's code
            with open(marker, "w") as file:
                file.write(str(error))
    raise typer.Exit(2) from None


train_command = app.registered_commands[-1]
train_command.epilog = None  # filled lazily by `main` (importing the config is not free)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", help="Processes on this node.")] = 1,
    nnodes: Annotated[int, typer.Option(help="Nodes in the job.")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", help="This node's index.")] = 0,
    rdzv_endpoint: Annotated[
        str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT of the rendezvous (default: loopback, 1 node).")
    ] = None,
    max_restarts: Annotated[int, typer.Option("--max-restarts", help="Elastic restarts after a failure.")] = 0,
    local_addr: Annotated[
        str | None,
        typer.Option("--local-addr", help="The address this node advertises (default: loopback on 1 node)."),
    ] = None,
    grace_seconds: Annotated[
        int,
        typer.Option(
            "--grace-seconds", help="After SIGTERM, seconds the workers get to checkpoint before they are SIGKILLed."
        ),
    ] = 30,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the torchrun command instead of running it.")
    ] = False,
) -> None:
    """Run a command on several processes through torchrun (loopback by default).

    After --: a colo subcommand (train --preset tiny-llama), -m MODULE ARGS, or SCRIPT.py ARGS. A `train` command's
    run config is validated here first, so a bad one is reported once (exit code 2) and no process starts.

    With --max-restarts N torchrun restarts the whole group when a rank dies and the trainer resumes from the newest
    complete checkpoint. SIGTERM (or Ctrl-C) here is forwarded to torchrun, which forwards it to the workers: they
    checkpoint within --grace-seconds and this command exits with 75 (run it again to resume).
    """
    import torch

    from colo.comm import gpus_per_local_rank

    from .launch import launch_environment, launch_outcome, run_forwarding_signals, torchrun_command

    try:
        command = torchrun_command(
            list(ctx.args),
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            node_rank=node_rank,
            rdzv_endpoint=rdzv_endpoint,
            max_restarts=max_restarts,
            local_addr=local_addr,
        )
    except ValueError as error:
        typer.echo(f"colo: {error}", err=True)
        raise typer.Exit(2) from None
    run = _check_launched_train(list(ctx.args), world_size=nproc_per_node * nnodes)
    if dry_run:
        typer.echo(" ".join(command))
        return
    cuda = gpus_per_local_rank(nproc_per_node)
    if torch.cuda.is_available() and not cuda and "COLO_BACKEND" not in os.environ:
        typer.echo(
            f"colo launch: {nproc_per_node} processes but {torch.cuda.device_count()} GPU(s) on this node: the ranks "
            f"run on the CPU with gloo (--nproc-per-node {torch.cuda.device_count()} trains on the GPUs)",
            err=True,
        )
    env = launch_environment(nproc_per_node=nproc_per_node, cuda=cuda)
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(grace_seconds)  # torchrun's SIGTERM -> SIGKILL grace
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="colo-launch-") as scratch:
        env[INPUT_ERROR_FILE_ENV] = os.path.join(scratch, "input-error")
        code, signalled = run_forwarding_signals(command, env=env)
        if code != 0 and os.path.exists(env[INPUT_ERROR_FILE_ENV]):  # the ranks' one colo: line said why
            raise typer.Exit(2)
    raise typer.Exit(launch_outcome(code, signalled, run=run, max_restarts=max_restarts, since=started))


def _check_launched_train(args: list[str], *, world_size: int):
    """Validate the run config of ``colo launch -- train [CONFIG] [--preset P] [--set K=V ...]`` in the launcher;
    on an error print it once and exit with code 2 (otherwise every rank would report it). Returns the run config
    (``None`` for other commands, and ``train --help``, which pass through untouched)."""
    if args[:1] != ["train"] or any(arg in ("--help", "-h") for arg in args):
        return None
    command = typer.main.get_command(app).commands["train"]
    with command.make_context("colo train", args[1:]) as parsed:  # a usage error goes up to typer: shown, exit 2
        params = parsed.params
    return _load(params["config"], params["preset"], params["set_"], preflight=True, world_size=world_size)


@app.command()
def info(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Show the environment: Python, platform, torch, devices, backends and the colo packages' versions."""
    from .info import environment_info, format_info

    details = environment_info()
    typer.echo(json.dumps(details, indent=2) if as_json else format_info(details))


@app.command()
def config(
    config: ConfigArgument = None,
    preset: PresetOption = None,
    set_: SetOption = None,
    schema: Annotated[bool, typer.Option("--schema", help="Print the run config's JSON schema.")] = False,
    list_presets: Annotated[
        bool, typer.Option("--list", help="List the run presets with a line on each, and exit.")
    ] = False,
    rules: Annotated[
        bool,
        typer.Option(
            "--rules", help="Print what each data.task refuses and the layouts plugin hybrid refuses (Markdown tables)."
        ),
    ] = False,
) -> None:
    """Print the resolved run config (YAML) of a file / preset with overrides, or the JSON schema."""
    if rules:
        from ..booster.plugins.hybrid import unsupported_table
        from ..train.task import rules_table

        typer.echo(f"{rules_table()}\n\nplugin.name: hybrid refuses\n\n{unsupported_table()}")
        return
    if list_presets:
        from ..train.presets import preset_table

        typer.echo(preset_table())
        return
    if schema:
        from ..train import RunConfig

        typer.echo(json.dumps(RunConfig.model_json_schema(), indent=2))
        return
    import yaml

    run = _load(config, preset, set_)
    typer.echo(yaml.safe_dump(run.model_dump(mode="json"), sort_keys=False).rstrip())


config_command = app.registered_commands[-1]  # its epilog (the presets) is filled by `main` for --help


@app.command()
def generate(
    checkpoint: Annotated[
        str,
        typer.Argument(
            help="A checkpoint directory written by `colo train`, a quantized one written by `colo convert "
            "--quantize`, or a Hugging Face Llama directory."
        ),
    ],
    prompt: Annotated[str, typer.Option(help="The text to continue.")] = "def ",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0: greedy; else the sampling temperature.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (with temperature > 0).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample from the K most likely tokens (0: all).")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of sampling.")] = 0,
    tokenizer: Annotated[
        str | None, typer.Option(help="Tokenizer path (default: the one the run trained with).")
    ] = None,
    cache: Annotated[
        bool, typer.Option("--cache/--no-cache", help="Decode with a KV cache; --no-cache re-runs the whole context.")
    ] = True,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--raw",
            help="Answer PROMPT as a user message through the run's chat template (default for SFT runs), or "
            "continue it as raw text.",
        ),
    ] = None,
) -> None:
    """Generate text from a checkpoint in one process (greedy, top-p or top-k, with a KV cache)."""
    import torch

    from colo.tensor.checkpoint import CheckpointError

    from ..generation import complete
    from ..runs import chat_template_of
    from ..serving import load_for_serving

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:  # a quantized checkpoint loads as stored; a run checkpoint merges its LoRA adapters
        model, run, tok = load_for_serving(checkpoint, tokenizer=tokenizer, device=device)
    except (ValueError, CheckpointError) as error:  # a damaged or malformed checkpoint: the line naming it
        typer.echo(f"colo: {error}", err=True)
        raise typer.Exit(2) from None
    template = chat_template_of(run)
    if chat and template is None:
        typer.echo("colo: --chat needs a checkpoint of an SFT run (data.task='sft'); use --raw", err=True)
        raise typer.Exit(2)
    text = complete(
        model,
        tok,
        prompt,
        chat_template=template if chat is not False else None,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        generator=torch.Generator().manual_seed(seed),
        use_cache=cache,
    )
    typer.echo(text)


@app.command()
def convert(
    checkpoint: Annotated[str, typer.Argument(help="A checkpoint directory written by `colo train`.")],
    out: Annotated[str, typer.Argument(help="The output directory.")],
    to: Annotated[
        str,
        typer.Option(
            help="The target format: hf (Hugging Face LlamaForCausalLM, LoRA adapters merged; MixtralForCausalLM for "
            "a mixture-of-experts run) or peft (a LoRA run's "
            "adapters alone, as a peft adapter directory) or diffusers (a diffusion run as a StableDiffusionPipeline)."
        ),
    ] = "hf",
    dtype: Annotated[str | None, typer.Option(help="Convert floats to this dtype (bfloat16, float16).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an earlier export in OUT.")] = False,
    quantize: Annotated[
        str | None,
        typer.Option(
            help="Write OUT as a weight-only quantized colo checkpoint instead: int8 (per output channel) or int4 "
            "(group-wise, packed); load it with colo.apps.quant.load_quantized."
        ),
    ] = None,
    group_size: Annotated[
        int | None, typer.Option(help="With --quantize int4: input columns per scale, 32, 64 or 128 (default 32).")
    ] = None,
    keep_float: Annotated[
        list[str] | None,
        typer.Option(help="With --quantize: keep these linear layers in float too (e.g. down_proj; repeatable)."),
    ] = None,
) -> None:
    """Convert a checkpoint (any layout) to a Hugging Face Llama directory (config.json + model*.safetensors; a
    Mixtral for a mixture-of-experts run), or a LoRA run's adapters to a peft adapter directory."""
    if quantize is None and (group_size is not None or keep_float):  # --quantize: a quantized colo checkpoint
        typer.echo("colo: --group-size and --keep-float are for --quantize int8|int4", err=True)
        raise typer.Exit(2)
    if quantize is not None and to != "hf":
        typer.echo(f"colo: --quantize writes a quantized colo checkpoint; it does not combine with --to {to}", err=True)
        raise typer.Exit(2)
    if to not in ("hf", "peft", "diffusers"):
        typer.echo(f"colo: --to {to!r} is not supported; use --to hf, --to peft or --to diffusers", err=True)
        raise typer.Exit(2)
    import torch

    from colo.tensor.checkpoint import CheckpointError

    from ..runs import export_llama_hf, export_lora_adapter

    torch_dtype = None
    if dtype is not None:
        torch_dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(torch_dtype, torch.dtype):
            typer.echo(f"colo: --dtype {dtype!r} is not a torch dtype; use bfloat16, float16 or float32", err=True)
            raise typer.Exit(2)
    try:
        if quantize is not None:  # colo.apps.quant: codes + scales in colo's safetensors format
            from ..quant import quantize_checkpoint

            written = quantize_checkpoint(
                checkpoint,
                out,
                mode=quantize,
                group_size=group_size,
                dtype=torch_dtype,
                keep_float=tuple(keep_float or ()),
                overwrite=overwrite,
            )
        elif to == "diffusers":  # a data.task=diffusion run: a StableDiffusionPipeline directory (EMA weights)
            from ..diffusion.export import export_diffusers

            written = export_diffusers(checkpoint, out, overwrite=overwrite)
        elif to == "peft":
            written = export_lora_adapter(checkpoint, out)
        else:
            written = export_llama_hf(checkpoint, out, dtype=torch_dtype, overwrite=overwrite)
    except (ValueError, CheckpointError, FileExistsError) as error:  # a bad checkpoint or output: no traceback
        typer.echo(f"colo: {error}", err=True)
        raise typer.Exit(2) from None
    for path in written:
        typer.echo(path)


@app.command()
def report(
    run_dirs: Annotated[list[str], typer.Argument(metavar="RUN_DIR...", help="Runs' output_dir (with metrics.jsonl).")],
    out: Annotated[
        str, typer.Option("--out", "-o", help="The PNG to write; the HTML page goes beside it (.html).")
    ] = "colo-report.png",
    title: Annotated[str | None, typer.Option(help="The title (default: the runs' names).")] = None,
) -> None:
    """Plot runs' metrics.jsonl: loss, eval loss, learning rate, throughput, MFU, memory (an RL run's reward, KL and
    response length; a diffusion run's newest sample grid), runs overlaid, into a PNG and a self-contained HTML page;
    per run, each rank's time per step (logging.rank_timing) and a timeline of its colo ranges in the newest
    profiled step (profile.every_steps traces)."""
    from ..report import write_report

    try:
        result = write_report(run_dirs, out, title=title)
    except (ValueError, OSError, ImportError) as error:  # no metrics.jsonl, a bad --out, no matplotlib: one line
        typer.echo(f"colo: {error}", err=True)
        raise typer.Exit(2) from None
    for label, run in result["runs"].items():
        if run.skipped_lines:
            typer.echo(f"colo: {label}: skipped {run.skipped_lines} line(s) of metrics.jsonl that are not records")
    typer.echo(result["png"])
    typer.echo(result["html"])


from .serve import serve as _serve  # noqa: E402  (colo serve: an OpenAI-compatible server, in its own module)

app.command(name="serve")(_serve)

from .plan import plan as _plan  # noqa: E402  (colo plan: the layout planner, in its own module)

app.command(name="plan")(_plan)

from .data import data_app  # noqa: E402  (colo data prepare / inspect: prepared corpora, in its own module)

app.add_typer(data_app, name="data")


def main(argv: list[str] | None = None) -> None:
    """The ``colo`` entry point."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["train"], ["config"]) and any(a in ("--help", "-h") for a in args):
        command = train_command if args[0] == "train" else config_command
        command.epilog = _presets_help() + ("\n\n" + _fields_help() if args[0] == "train" else "")
    app(args=args, prog_name="colo")
