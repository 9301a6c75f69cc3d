"""Models from the Hugging Face Hub beyond the catalog, and finding drafts for a target."""

from __future__ import annotations

import logging
from pathlib import Path

from edgespec.errors import FetchError, ModelNotFoundError
from edgespec.models.catalog import MODELS
from edgespec.models.store import hub_reachable

log = logging.getLogger(__name__)
PREFERRED_QUANT = "q4_k_m"
HF_PREFIX = "hf:"  # a model argument naming a Hub repository: hf:OWNER/REPO[:QUANT]


def pull(repo: str, filename: str | None = None, quant: str | None = None) -> Path:
    """Download (or find in the HF cache) one GGUF of `repo`: `filename`, else the one whose name holds `quant`
    (default PREFERRED_QUANT, or the repo's only GGUF); returns its local path."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    online = hub_reachable()
    try:
        if filename is None:
            filename = _pick(repo, _repo_ggufs(repo, online), quant)
        return Path(hf_hub_download(repo, filename, local_files_only=not online))
    except LocalEntryNotFoundError as e:
        raise FetchError(
            f"{repo}/{filename} is not in the Hugging Face cache ({_hf_home()}) and the Hub cannot be reached "
            f"(offline or HF_HUB_OFFLINE=1); connect and pull again, or pass a local .gguf path"
        ) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise FetchError(f"could not pull {repo}/{filename or ''}: {e}; check the repo and file names") from e


def _repo_ggufs(repo: str, online: bool) -> list[str]:
    """The repo's GGUF files: listed on the Hub, or offline those already in the Hugging Face cache."""
    if online:
        from huggingface_hub import list_repo_files

        return [f for f in list_repo_files(repo) if f.endswith(".gguf")]
    cached = sorted({f for r, f, _, _ in hub_cached_ggufs() if r == repo})
    if not cached:
        raise FetchError(f"the Hub is unreachable (offline or HF_HUB_OFFLINE=1) and no file of {repo} is in the "
                         f"Hugging Face cache; connect and pull again, or name the file: "
                         f"`edgespec models pull {repo} FILE.gguf`")
    return cached


def parse_hf_ref(ref: str) -> tuple[str, str | None, str | None]:
    """`hf:OWNER/REPO[:QUANT]` (QUANT such as Q4_K_M, or a file name ending .gguf) as (repo, filename, quant)."""
    repo, _, tail = ref[len(HF_PREFIX):].partition(":")
    parts = repo.split("/")
    if len(parts) != 2 or not all(p.strip() for p in parts) or ":" in tail:
        raise ModelNotFoundError(f"{ref!r} does not name a Hugging Face repository; write hf:OWNER/REPO or "
                                 f"hf:OWNER/REPO:QUANT (e.g. hf:{MODELS['smollm2-135m'].hub.repo}:Q4_1)")
    if tail.lower().endswith(".gguf"):
        return repo, tail, None
    return repo, None, tail or None


def pull_ref(ref: str) -> Path:
    """The local path of a `hf:` model argument, pulled as `edgespec models pull` does."""
    repo, filename, quant = parse_hf_ref(ref)
    return pull(repo, filename, quant)


def _pick(repo: str, ggufs: list[str], quant: str | None = None) -> str:
    if not ggufs:
        raise FetchError(f"{repo} has no .gguf file; pick a GGUF repository (often named ...-GGUF)")
    if quant is None and len(ggufs) == 1:
        return ggufs[0]
    matching = [f for f in ggufs if (quant or PREFERRED_QUANT).lower() in f.lower()]
    if len(matching) == 1:
        return matching[0]
    listed = ", ".join(sorted(matching or ggufs)[:8])
    if quant is not None:
        raise FetchError(f"{len(matching)} GGUF files of {repo} match {quant!r}; give a quantization that names "
                         f"one (hf:{repo}:QUANT) among: {listed}")
    raise FetchError(f"{repo} has {len(ggufs)} GGUF files; name one: {listed}")


def _hf_home() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def hub_cached_ggufs() -> list[tuple[str, str, int, Path]]:
    """(repo, file, size, path) of every GGUF in the Hugging Face cache."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir()
    except Exception:  # no cache directory yet, or an unreadable one: nothing pulled
        return []
    out = []
    for repo in info.repos:
        for rev in repo.revisions:
            for f in rev.files:
                if f.file_name.endswith(".gguf"):
                    out.append((repo.repo_id, f.file_name, f.size_on_disk, f.file_path))
    return out

