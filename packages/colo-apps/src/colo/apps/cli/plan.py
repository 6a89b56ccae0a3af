"""``colo plan``: model the memory and step time of every layout colo runs for a model on a cluster, print the
fastest that fit as a ranked table, and write the best as a run config for ``colo train``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def load_model(preset: str | None, hf_config: str | None):
    """``(LlamaConfig, name)`` from a planner model preset or a Hugging Face ``config.json`` (exactly one)."""
    from ..plan.report import model_preset

    if (preset is None) == (hf_config is None):
        raise ValueError("give the model as --preset NAME or --hf-config PATH (one of them)")
    if preset is not None:
        return model_preset(preset), preset
    path = Path(hf_config)
    if path.is_dir():
        path = path / "config.json"
    try:
        fields = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--hf-config {hf_config}: cannot read a JSON config ({error})") from None
    model_type = fields.get("model_type")
    if model_type not in (None, "llama", "mixtral"):
        raise ValueError(
            f"--hf-config {hf_config}: model_type={model_type!r}; the planner models Llama and Mixtral (mixture of "
            "experts)"
        )
    try:
        from transformers import LlamaConfig as HFLlamaConfig
        from transformers import MixtralConfig as HFMixtralConfig
    except ImportError:
        raise ValueError(
            "--hf-config reads the config with transformers; install it (pip install transformers)"
        ) from None
    name = path.parent.name or "hf"
    if model_type == "mixtral":
        from ..models.moe_llama.hf import mixtral_config_from_hf

        return mixtral_config_from_hf(HFMixtralConfig(**fields)), name

    from ..models.llama.hf import llama_config_from_hf

    return llama_config_from_hf(HFLlamaConfig(**fields)), name


def load_cluster(name: str, cluster_file: str | None, nodes: int):
    """A preset cluster, or one described in a JSON file (`colo.apps.plan.Cluster`'s fields)."""
    from ..plan.cluster import Cluster, Efficiency, get_cluster

    if cluster_file is None:
        return get_cluster(name, nodes=nodes)
    try:
        fields = json.loads(Path(cluster_file).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--cluster-file {cluster_file}: cannot read a JSON cluster description ({error})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--cluster-file {cluster_file}: expected a JSON object of Cluster fields")
    fields.setdefault("name", Path(cluster_file).stem)
    fields["nodes"] = nodes
    if "efficiency" in fields:
        fields["efficiency"] = Efficiency(**fields["efficiency"])
    try:
        return Cluster(**fields)
    except TypeError as error:
        raise ValueError(f"--cluster-file {cluster_file}: {error}") from None


def plan(
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset",
            "-p",
            help="Model: llama-1b, llama-7b, llama-70b, ...; mixture of experts: tiny-moe, mixtral-8x7b",
        ),
    ] = None,
    hf_config: Annotated[
        str | None, typer.Option(help="A Hugging Face Llama or Mixtral config.json (or its directory).")
    ] = None,
    cluster: Annotated[str, typer.Option(help="Hardware preset: 8xh100, h100-96gb-500w, a100, cpu.")] = "8xh100",
    cluster_file: Annotated[str | None, typer.Option(help="A JSON file of Cluster fields instead of a preset.")] = None,
    nodes: Annotated[int, typer.Option(help="Number of nodes.")] = 1,
    global_batch: Annotated[int, typer.Option(help="Sequences per optimizer step.")] = 1024,
    seq: Annotated[int, typer.Option(help="Tokens per sequence.")] = 4096,
    precision: Annotated[str, typer.Option(help="Compute precision: bf16, fp16 or fp32.")] = "bf16",
    top: Annotated[int, typer.Option(help="Rows of the ranked table.")] = 10,
    max_sp: Annotated[int, typer.Option(help="Largest Ulysses sequence-parallel degree to consider.")] = 1,
    output: Annotated[str, typer.Option("--output", "-o", help="Where to write the best layout's run config.")] = (
        "plan.yaml"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Print the ranked rows as JSON instead of a table.")] = False,
) -> None:
    """Pick the parallel layout: the fastest layouts that fit, with memory and time breakdowns; writes the best.

    Exit 2 when the description is invalid or nothing fits (the message names the shortfall and what to change).
    """
    import yaml

    from ..plan import NothingFits, Workload, search
    from ..plan.report import print_table, run_config, table_rows, validate_run_config
    from ..train import ConfigError

    try:
        config, name = load_model(preset, hf_config)
        hardware = load_cluster(cluster, cluster_file, nodes)
        workload = Workload(config, seq, global_batch, model_name=name, precision=precision)
        results = search(workload, hardware, top=top, max_sp=max_sp)
        best = run_config(results[0], workload, base_preset=preset)
        validate_run_config(best)
    except NothingFits as error:
        typer.echo(f"colo: {error}", err=True)
        raise typer.Exit(2) from None
    except (ValueError, ConfigError) as error:
        typer.echo(f"colo: {error}", err=True)
        raise typer.Exit(2) from None
    peak = hardware.flops(precision)
    if as_json:
        typer.echo(json.dumps(table_rows(results, peak), indent=1))
    else:
        title = (
            f"{name} on {hardware.nodes} x {hardware.name} ({hardware.world_size} devices), global batch "
            f"{global_batch} x {seq} tokens, {precision}"
        )
        print_table(results, peak, title=title)
    Path(output).write_text(yaml.safe_dump(best, sort_keys=False))
    typer.echo(  # with --json, stdout holds the JSON alone
        f"best layout: {results[0].layout.describe()}; run config written to {output} (colo train {output})",
        err=as_json,
    )
