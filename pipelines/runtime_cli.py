"""``dsaindex runtime check`` (the check an operator runs before starting a server) and ``dsaindex runtime
generate`` (the runtime selecting inside transformers generation).

Both take a model reference (a checkpoint folder, ``reference`` or a preset), so they live with the
pipelines, where models are resolved; the runtime package itself only ever receives a config or a model.
"""

from __future__ import annotations

import typer

runtime_app = typer.Typer(no_args_is_help=True)


@runtime_app.command("check")
def check_cmd(
    model: str = typer.Option(..., "--model", "-m", help="Served model: checkpoint directory, `reference` or a preset."),
    artifacts: str = typer.Option(..., "--artifacts", "-a", help="Bundle path or models:/<name>@<alias>."),
    device: str = typer.Option("cpu", help="Device to load the artifacts onto."),
    basis: str = typer.Option("hadamard", help="Key basis the engine scores in."),
    tracking_uri: str = typer.Option(None, help="MLflow tracking URI for models:/ URIs."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Load the artifacts exactly as a server would and validate them against the model's config."""
    import json
    from pathlib import Path

    from dsaindex.pipelines.models import preset_config, resolve_model_dir
    from dsaindex.runtime.loader import load

    if model.startswith("preset:"):
        config = preset_config(model.split(":", 1)[1])
    else:
        config = json.loads((Path(resolve_model_dir(model)) / "config.json").read_text())
    loaded = load(artifacts, config, device=device, basis=basis, tracking_uri=tracking_uri)
    summary = loaded.summary()
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    typer.echo(f"ok: {summary['bundle']} fits {model}: {summary['family']}, {summary['basis']} basis, "
               f"{summary['key_format']}; layers {loaded.describe_layers()}; {summary['device_bytes']:,} bytes on {device}; "
               f"loaded in {summary['startup_seconds'] * 1000:.1f} ms")


@runtime_app.command("generate")
def generate_cmd(
    artifacts: str = typer.Option(..., "--artifacts", "-a", help="PQ bundle path or models:/<name>@<alias>."),
    model: str = typer.Option("reference", "--model", "-m", help="`reference` or a checkpoint directory."),
    prompt_tokens: int = typer.Option(3072, help="Prompt bytes, from the held-out text of the reference corpus."),
    prompt_offset: int = typer.Option(0, help="Where in the held-out text the prompt starts (bytes)."),
    new_tokens: int = typer.Option(300, help="Tokens generated greedily."),
    candidates: int = typer.Option(1024, help="C: keys reranked exactly per step and layer."),
    prefilter: int = typer.Option(2, help="Stage 1 keeps prefilter x C keys."),
    topk: int = typer.Option(None, help="Keys selected per step (default: the model's index_topk)."),
    device: str = typer.Option("auto", help="cuda, cpu or auto."),
    basis: str = typer.Option("hadamard", help="Key basis the artifacts were trained in."),
    out: str = typer.Option(None, help="Also write the JSON result to this file."),
) -> None:
    """Greedy generation with the runtime choosing every layer's decode-time top-k, against the model's
    own exhaustive selection: token agreement (free running, teacher forced, and on the real held-out
    continuation) and per-layer recall of the model's own top-k."""
    import json
    from pathlib import Path

    import torch

    from dsaindex.console import resolve_device
    from dsaindex.pipelines.models import BOS_ID, load_model
    from dsaindex.pipelines.reference_train import build_token_streams, set_index_topk
    from dsaindex.runtime.loader import load
    from dsaindex.runtime.transformers_adapter import greedy_agreement

    dev = resolve_device(device)
    loaded_model = load_model(model, device=dev, dtype="float32")
    net = loaded_model.model
    if topk is not None:
        set_index_topk(net, topk)
    loaded = load(artifacts, net.config, device=dev, basis=basis)
    heldout = build_token_streams(0, max(200_000, 2 * (prompt_offset + prompt_tokens + new_tokens))).heldout
    if len(heldout) < prompt_offset + prompt_tokens + new_tokens:
        raise typer.BadParameter(f"the held-out text has {len(heldout)} bytes; lower --prompt-offset or the lengths")
    window = [int(t) for t in heldout[prompt_offset : prompt_offset + prompt_tokens - 1 + new_tokens]]
    prompt = torch.tensor([BOS_ID] + window[: prompt_tokens - 1], dtype=torch.long)
    continuation = torch.tensor(window[prompt_tokens - 1 :], dtype=torch.long)
    result = greedy_agreement(net, loaded.layers, prompt, new_tokens, basis=basis, candidates=candidates,
                              prefilter=prefilter, device=dev, continuation=continuation)
    result["model"] = model
    result["artifacts"] = artifacts
    text = json.dumps(result, indent=2)
    if out:
        Path(out).write_text(text)
    print(text)
