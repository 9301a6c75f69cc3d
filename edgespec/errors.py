"""Domain errors. Each message names the offending value and the fix.

The CLI turns these into one-line `click.ClickException`s and the server into
HTTP status codes, by type, so nothing above this module formats errors itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Any, Callable, Iterator

SHOWN_CHARS = 80  # of an offending value a message quotes: a request's field can hold a whole file


def shown(value: Any, dump: Callable[[Any], str] = repr) -> str:
    """A value as a message quotes it (`dump`: repr, or json.dumps as it was sent): its first SHOWN_CHARS
    characters, then "..." where there were more."""
    text = dump(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


class EdgespecError(Exception):
    """Base class: something the user can fix; the message says how."""


class ConfigError(EdgespecError):
    """A config file or environment variable that cannot be used as it is."""


class ModelNotFoundError(EdgespecError):
    """A model path that does not exist and is not a catalog name."""


class InvalidModelError(EdgespecError):
    """A file that llama.cpp cannot load: not GGUF, truncated or corrupt."""


class FetchError(EdgespecError):
    """A model could not be downloaded or assembled."""


class ChecksumError(FetchError):
    """A fetched model does not match the catalog's size or sha256."""


class ContextOverflowError(EdgespecError):
    """A prompt that does not fit the context; `details` are the numbers (llama.cpp's error carries them)."""

    def __init__(self, message: str, **details: int) -> None:
        super().__init__(message)
        self.details = details


class InvalidRequestError(EdgespecError):
    """A generation parameter outside its valid range."""


class IncompatibleDraftError(EdgespecError):
    """A draft model whose vocabulary differs from the target's."""


class UnsupportedModelError(EdgespecError):
    """A model that cannot do what was asked (e.g. partial KV removal)."""


class ChatTemplateError(EdgespecError):
    """A model without a chat template, or one that fails to render."""


class TranscriptError(EdgespecError):
    """A chat transcript that cannot be read or written."""


class OutOfMemoryError(EdgespecError):
    """The target does not fit the memory budget; the message gives the numbers."""


class WorkerError(EdgespecError):
    """An RPC worker that cannot be reached, does not answer, or was lost; the message names it."""


@contextlib.contextmanager
def stderr_captured() -> Iterator[Callable[[], list[str]]]:
    """What C code writes to file descriptor 2 meanwhile (the lines, once the block has ended): llama.cpp prints
    some reasons there, not to its log, and an error message quotes them."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines += tmp.read().decode("utf-8", "replace").splitlines()
