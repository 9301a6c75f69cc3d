"""`edgespec models` (the catalog, fetches, Hub pulls, ONNX exports, drafts for a target) and `edgespec memory`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from edgespec.cli.options import FetchBar, domain_errors, source_option
from edgespec.errors import EdgespecError
from edgespec.models import MODELS, PAIRS, cache_dir, cached_path
from edgespec.models import fetch as fetch_model
from edgespec.models import remove as remove_model
from edgespec.onnx.export import PRECISIONS


@click.group()
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
@source_option
@domain_errors
def models_fetch(names: tuple[str, ...], source: str | None) -> None:
    """Download, assemble, verify (sha256) and cache catalog models."""
    for name in names:
        path = fetch_model(name, source=source, progress=FetchBar())
        click.echo(f"{name}: {path}")


@models.command("rm")
@click.argument("names", nargs=-1, required=True)
@click.option("--hub", is_flag=True, help="Also delete the model's revision from the Hugging Face cache.")
@domain_errors
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
@domain_errors
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
@source_option
@domain_errors
def models_export_onnx(name: str, precision: str, force: bool, source: str | None) -> None:
    """Export a GGUF draft (catalog NAME or PATH; llama or qwen2 family) to ONNX for onnxruntime, cached beside it.

    Use the directory it prints as --draft; --draft-device picks the execution provider.
    """
    from edgespec.models import resolve
    from edgespec.onnx.export import export
    from edgespec.onnx.files import export_dir, locate

    gguf = resolve(name, source=source, progress=FetchBar())
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
@domain_errors
def models_pair(target: str) -> None:
    """Drafts for TARGET: cached models that pass the vocabulary check, and catalog pairs."""
    rows = draft_candidates(target)
    if not rows:
        click.echo(f"no compatible draft found for {target}; the n-gram proposer needs none (--proposer ngram)")
    for name, path, verdict in rows:
        click.echo(f"{name:<40} {verdict:<28} {path or ''}")


@click.group("memory")
def memory_group() -> None:
    """What edgespec remembers of its earlier answers (to speculate from): show it, or clear it."""


@memory_group.command("show")
@click.option("--json", "as_json", is_flag=True)
def memory_show(as_json: bool) -> None:
    """Every memory file: its model, namespace (local, or an API key's hash), entries and tokens."""
    from edgespec.memory import files
    from edgespec.paths import memory_dir

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
    from edgespec.paths import memory_dir

    gone = clear(memory_dir(), model)
    click.echo(f"removed {len(gone)} memory file{'s' if len(gone) != 1 else ''} from {memory_dir()}")


def draft_candidates(target: str) -> list[tuple[str, str | None, str]]:
    """(name, path, verdict) for every cached GGUF that passes the vocabulary check against `target`,
    and catalog pairs not yet cached."""
    from edgespec.planning.plan import open_facts
    from edgespec.models import resolve
    from edgespec.models.hub import hub_cached_ggufs
    from edgespec.proposers.draft import check_compatible

    target_path = resolve(target)
    candidates: list[tuple[str, Path]] = []
    for name, entry in MODELS.items():
        if (p := cached_path(entry)) is not None:
            candidates.append((name, p))
    candidates += [(f"{repo}/{file}", path) for repo, file, _, path in hub_cached_ggufs()]
    rows: list[tuple[str, str | None, str]] = []
    with open_facts(target_path) as t:
        for name, path in candidates:
            if path.resolve() == target_path.resolve():
                continue
            with open_facts(path) as d:
                try:
                    check_compatible(t, d)
                except EdgespecError:
                    continue
                ratio = d.facts.weights_bytes / t.facts.weights_bytes
                rows.append((name, str(path), f"compatible, {ratio:.2f}x target size"))
    for name in PAIRS.get(target, ()):
        if not any(r[0] == name for r in rows):
            rows.append((name, None, "catalog pair, not cached (fetch it)"))
    return rows
