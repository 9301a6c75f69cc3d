"""A model argument as the CLI, the API and the server accept it: a path, a catalog name or hf:REPO[:QUANT]."""

from __future__ import annotations

import os
from pathlib import Path

from edgespec.errors import ModelNotFoundError
from edgespec.models.catalog import MODELS
from edgespec.models.hub import HF_PREFIX, pull_ref
from edgespec.models.store import ProgressCallback, fetch


def resolve(model: str, source: str | None = None, progress: ProgressCallback | None = None) -> Path:
    """A model argument as the CLI and API accept it: an existing path, a catalog name or hf:REPO[:QUANT]."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.startswith(HF_PREFIX):
        return pull_ref(model)
    if model in MODELS:
        return fetch(model, source=source, progress=progress)
    names = ", ".join(sorted(MODELS))
    if path.suffix == ".gguf" or os.sep in model:
        raise ModelNotFoundError(f"model file {model} does not exist; check the path, or use a catalog name ({names})")
    raise ModelNotFoundError(
        f"model {model!r} is neither an existing file nor a catalog name; check the path, "
        f"or use one of {names} (see `edgespec models list`), or hf:OWNER/REPO[:QUANT] for a Hub GGUF"
    )
