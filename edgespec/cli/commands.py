"""The `edgespec` command: argument handling only; the work is in the engine."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from edgespec.cli.models import memory_group, models
from edgespec.cli.options import (constraints, domain_errors, echo_stats, engine_config, engine_options,
                                  generation_config, layer_options, open_engine, options, progress_bar,
                                  rpc_options, rpc_settings, sampling_options, show_draft_option, source_option)
from edgespec.cli.terminal import print_stream, read_stdin
from edgespec.cli.userconfig import settle
from edgespec.config import (
    ASIDE_TOKENS,
    DEFAULT_FIM_LAYOUT,
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_N_CTX,
    DEFAULT_PORT,
    DEFAULT_SERVER_SLOTS,
    DEFAULT_SSE_PING_SECONDS,
    DRAFT_DEVICES,
    MAX_K,
    MAX_SEQ,
    SHUTDOWN_GRACE_SECONDS,
    FIM_GROUP_LINES,
    GROUPED_SUFFIX_LINES,
    FIM_LAYOUTS,
    EngineConfig,
    LoadConfig,
    default_threads,
)
from edgespec.models import DEFAULT_MODEL
from edgespec.planning.budget import parse_size


@click.group()
@click.version_option(package_name="edgespec")
@click.option("-v", "--verbose", count=True, help="More diagnostics on stderr (-vv includes llama.cpp's log).")
def cli(verbose: int) -> None:
    """Speculative decoding for local GGUF models."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if verbose < 2:  # llama.cpp's own errors are quoted in our messages; its log is for -vv
        logging.getLogger("edgespec.llama_cpp").setLevel(logging.CRITICAL)


@cli.command()
@engine_options
@sampling_options
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, tokens, finish_reason, stats.")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain the output to this JSON Schema (a file); speculation runs under it.")
@click.option("--grammar", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain the output to this GBNF grammar (a file, llama.cpp's format).")
@show_draft_option
@domain_errors
def generate(prompt: str | None, prompt_file: Path | None, chat: bool, as_json: bool, json_schema: Path | None,
             grammar: Path | None, show_draft: bool, **o: Any) -> None:
    """Generate a completion for one prompt."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-file FILE")
    # Invalid UTF-8 in a file reads as U+FFFD, as it does in --prompt (see text.to_utf8).
    text = prompt if prompt is not None else prompt_file.read_text(encoding="utf-8", errors="replace")  # type: ignore[union-attr]
    config = generation_config(o, **constraints(json_schema, grammar))
    with open_engine(o) as engine:
        tokens = engine.chat_tokens([{"role": "user", "content": text}]) if chat else engine.tokenize(text)
        if as_json:
            out = engine.generate(tokens, config, stop=o["stop"])
            click.echo(json.dumps({"text": out.text, "tokens": out.tokens, "finish_reason": out.finish_reason,
                                   "stats": out.stats.to_dict()}))
            return
        echo_stats(print_stream(engine.stream(tokens, config, stop=o["stop"]), show_draft,
                                 f"reading the prompt ({len(tokens)} tokens)", o["quiet"]), o["quiet"])


@cli.command()
@engine_options
@sampling_options
@click.option("-p", "--prompt", help="Prompt text [default: read standard input].")
@domain_errors
def complete(prompt: str | None, **o: Any) -> None:
    """Raw completion of a prompt (from --prompt or stdin), no chat template: for scripts."""
    text = prompt if prompt is not None else read_stdin()
    with open_engine(o) as engine:
        echo_stats(print_stream(engine.stream(engine.tokenize(text), generation_config(o), stop=o["stop"]),
                                 quiet=o["quiet"]), o["quiet"])


@cli.command("chat")
@engine_options
@sampling_options
@click.option("-s", "--system", default=None, help="System prompt.")
@click.option("--interactive/--once", default=None,
              help="Prompt for turns, or answer standard input once [default: prompt when stdin is a terminal].")
@click.option("--cache-reuse", type=click.IntRange(min=0), default=0, show_default=True,
              help="When the oldest turns are dropped to make room, keep the cached turns after them at their new "
                   "place (chunks of at least N tokens, shifted) instead of evaluating them again; 0 keeps the "
                   "chat exact. Close to a fresh evaluation, not identical.")
@show_draft_option
@domain_errors
def chat_cmd(system: str | None, interactive: bool | None, show_draft: bool, cache_reuse: int, **o: Any) -> None:
    """Talk with a model; tokens stream as they are accepted. Piped input gets one answer.

    On a terminal: line editing, history kept between sessions (up/down), \"\"\" or Alt-Enter for several lines,
    /help for the commands.
    """
    from edgespec.engine.session import ChatSession
    from edgespec.cli.repl import run_chat
    from edgespec.paths import history_path

    with open_engine(o) as engine:
        # In a chat the context, not a fixed number, bounds an answer (unless -n says otherwise).
        session = ChatSession(engine, generation_config(o, max_tokens=None, cache_reuse=cache_reuse), system=system,
                              stop=o["stop"])
        run_chat(session, sys.stdin.isatty() if interactive is None else interactive, history_path(), o["quiet"],
                 show_draft)


@cli.command()
@engine_options
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
@click.option("--cache-reuse", "cache_reuse", type=click.IntRange(min=0), default=None,
              help="Reuse cached chunks of at least N tokens at their new position (KV shifting) on every route, "
                   "as llama-server's --cache-reuse; 0 reuses only the common prefix [default: 16 on /infill, 0 "
                   "elsewhere]. Close to a fresh evaluation, not identical.")
@click.option("--cache-ram", "cache_ram", type=click.IntRange(min=-1), default=None,
              help="MiB of host memory for prompts the slots held before, taken back when a client returns to "
                   "one (llama-server's --cache-ram; -1: no limit, 0: none kept) [default: 8192, or an eighth of "
                   "the machine's memory where that is less].")
@click.option("--fim-layout", type=click.Choice(FIM_LAYOUTS), default=DEFAULT_FIM_LAYOUT, show_default=True,
              help="/infill: the typed part of the cursor line starts the middle (a keystroke then appends to the "
                   "prompt) or ends the prefix (llama.cpp's layout).")
@click.option("--fim-groups", type=click.IntRange(min=0), default=0, show_default=True,
              help=f"/infill with chunk reuse: hold the suffix in groups of N lines (e.g. {FIM_GROUP_LINES}) that see "
                   f"only the prefix, grown to {GROUPED_SUFFIX_LINES} lines in pauses, so a line the cursor walks over "
                   "is cut out and the rest kept (0: the prompt in one piece). Not yet better in sessions: "
                   "docs/bench/editor.md.")
@click.option("--shutdown-grace", type=click.FloatRange(min=0), default=SHUTDOWN_GRACE_SECONDS, show_default=True,
              help="Seconds requests in flight get after SIGTERM or Ctrl-C before they are cancelled; "
                   "a second signal cancels them at once.")
@domain_errors
def serve(host: str, port: int, api_keys: tuple[str, ...], cors_origins: tuple[str, ...], max_body_bytes: int,
          infill_cancel_older: bool, n_seq: int, keepalive: float, cache_reuse: int | None, cache_ram: int | None,
          fim_layout: str, fim_groups: int, shutdown_grace: float, **o: Any) -> None:
    """Serve OpenAI-compatible and llama.cpp-style (/infill, /completion) endpoints."""
    try:
        from edgespec.server import Settings, create_app, is_loopback, serve as run_server
    except ImportError as e:
        raise click.ClickException(f"the server needs its extra ({e.name} is missing): pip install 'edgespec[server]'")
    if not is_loopback(host) and not api_keys:
        raise click.ClickException(f"refusing to listen on {host} without an API key: anyone who can reach it "
                                   f"could use it; pass --api-key KEY, or keep the default --host 127.0.0.1")
    # Bad options end here, in one line, before the port opens. Memory: on by default only where text stays local.
    config = engine_config(o, mmap=False, n_seq=n_seq, memory=is_loopback(host), aside=ASIDE_TOKENS,
                           cache_ram=cache_ram, fim_groups=fim_groups)
    port = settle({"port": port}).port
    settings = Settings(host=host, port=port, api_key=api_keys[0] if api_keys else None, api_keys=api_keys[1:],
                        cors_origins=cors_origins,
                        max_body_bytes=max_body_bytes, infill_cancel_older=infill_cancel_older,
                        model_name=Path(config.model).name, keepalive_seconds=keepalive, cache_reuse=cache_reuse,
                        fim_layout=fim_layout)
    if not o["quiet"]:
        click.echo(click.style(f"edgespec serving {config.model} on http://{host}:{port} (GET /health is 503 until "
                               f"the model is loaded)", dim=True), err=True)
    app = create_app(settings, lambda: open_engine({**o, "quiet": True}, config))
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
@options(*layer_options)
@click.option("--threads", type=int, default=None,
              help="CPU threads [default: the config file's threads, else physical cores].")
@options(*rpc_options)
@click.option("--json", "as_json", is_flag=True)
@source_option
@domain_errors
def plan_cmd(model: str | None, draft: str | None, draft_device: str, n_ctx: int | None, k: int | None,
             memory_budget: str | None, gpu_layers: int | None, draft_gpu_layers: int | None, threads: int | None,
             rpc: str | None, rpc_layers: str | None, as_json: bool, source: str | None) -> None:
    """Show every layout of target and draft that fits this machine (and its RPC workers), its predicted speed,
    and the one chosen."""
    from edgespec.models import resolve
    from edgespec.onnx.files import is_onnx
    from edgespec.planning.plan import plan_memory, plan_remote

    d = settle({"model": model, "draft": draft, "ctx": n_ctx, "threads": threads})
    model, draft = d.model, d.draft
    load = LoadConfig(n_ctx=d.ctx, n_gpu_layers=-1 if gpu_layers is None else gpu_layers,
                      n_threads=default_threads() if d.threads is None else d.threads)
    endpoints, layers = rpc_settings(rpc, rpc_layers)
    config = EngineConfig(model, draft, k=k, load=load, source=source, draft_gpu_layers=draft_gpu_layers,
                          memory_budget=parse_size(memory_budget) if memory_budget else None, rpc=endpoints,
                          rpc_layers=layers)
    progress = progress_bar(not as_json)
    target = resolve(model, source=source, progress=progress)
    links, spreads = plan_remote(target, endpoints, layers, load, config.memory_budget) if endpoints else ([], [])
    share = spreads[0].local_units / (spreads[0].local_units + sum(spreads[0].worker_units)) if spreads else 1.0
    p = plan_memory(target, None if not draft else Path(draft) if is_onnx(draft) else resolve(
        draft, source=source, progress=progress), config.load, config.k_max, config.memory_budget, draft_gpu_layers,
        draft_device=draft_device, local_share=share)
    if as_json:
        click.echo(json.dumps(p.to_dict() | _remote_dict(links, spreads), indent=2))
        return
    _echo_remote(links, spreads)
    _echo_plan(p)


def _remote_dict(links: list, spreads: list) -> dict[str, Any]:
    if not links:
        return {}
    return {"rpc_workers": [{"endpoint": w.endpoint, "free_bytes": w.free_bytes, "rtt_ms": w.rtt_seconds * 1e3}
                            for w in links],
            "rpc_layouts": [{"layout": s.description, "local_layers": s.local_units,
                             "worker_layers": list(s.worker_units),
                             "predicted_tokens_per_second": round(s.tokens_per_second, 1)} for s in spreads]}


def _echo_remote(links: list, spreads: list) -> None:
    """The RPC workers and the ways to spread the target over them, fastest first (the first is taken)."""
    for w in links:
        click.echo(f"RPC worker {w.endpoint}: {w.free_bytes / 2**30:.2f} GiB free, round trip "
                   f"{w.rtt_seconds * 1e3:.2f} ms")
    for i, s in enumerate(spreads):
        layers = ", ".join(f"{n} on {w.endpoint}" for n, w in zip(s.worker_units, links))
        click.echo(f"{'*' if i == 0 else ' '}{s.description:<28} {s.local_units} layers here, {layers}: "
                   f"{s.tokens_per_second:.1f} tok/s predicted")


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


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@domain_errors
def info(as_json: bool) -> None:
    """This machine, the llama.cpp build, cached models and the memory plan for the default pair."""
    from edgespec.cli.info import machine_info

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


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="IPv4 address to listen on; any other than 127.0.0.1 lets the network in, without authentication.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads [default: the physical cores].")
@click.option("--device", default=None,
              help="The device to serve, as `edgespec info` names it (CPU, CUDA0, Metal...) [default: the first GPU, "
                   "else the CPU].")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the weights sent here in this folder, so that a target loaded again sends only their "
                   "hashes (llama.cpp's rpc-server -c).")
@domain_errors
def worker(host: str, port: int, threads: int | None, device: str | None, cache_dir: Path | None) -> None:
    """Serve this machine's device to a target on another (`--rpc HOST:PORT` there): llama.cpp's RPC server, from
    the llama-cpp-python edgespec installed, built with CMAKE_ARGS="-DGGML_RPC=on"."""
    from edgespec.remote.worker import run

    run(host, port, threads or default_threads(), device, cache_dir, say=lambda text: click.echo(text, err=True))


cli.add_command(models)
cli.add_command(memory_group)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
