"""A person's defaults: flag > environment > config file > built-in, settled in one place for the CLI, the server
and any application that wants the same choices (`settle`).

The config file is TOML in the platform's config folder (`edgespec info` prints its path):

    model = "smollm2-135m"      # catalog name, GGUF path or hf:REPO[:QUANT]
    draft = "qwen2.5-coder-0.5b"
    ctx = 4096
    threads = 4
    port = 8012
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from edgespec.config import DEFAULT_MODEL, DEFAULT_PORT
from edgespec.errors import ConfigError
from edgespec.paths import config_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; tomli is the same parser (a dependency there only)
    import tomli as tomllib

# The variables a person may set, by key; the other keys come from the config file or a flag only.
ENV = {"model": "EDGESPEC_MODEL", "draft": "EDGESPEC_DRAFT"}
# Each key's check: (type, lowest value, an example for the fix).
KEYS: dict[str, tuple[type, int | None, str]] = {
    "model": (str, None, 'model = "smollm2-135m"'),
    "draft": (str, None, 'draft = "qwen2.5-coder-0.5b"'),
    "ctx": (int, 16, "ctx = 4096"),
    "threads": (int, 1, "threads = 4"),
    "port": (int, 1, "port = 8012"),
}
NO_DRAFT = "none"  # `--draft none` (or in the env or file) drops a draft set at a lower level


@dataclass(frozen=True)
class Defaults:
    """The settled values and where each came from ("flag", an env variable, the config file, "built-in")."""

    model: str = DEFAULT_MODEL
    draft: str | None = None
    ctx: int | None = None  # None: the memory plan picks it
    threads: int | None = None  # None: the physical cores
    port: int = DEFAULT_PORT
    origin: dict[str, str] = field(default_factory=dict)

    def describe(self) -> list[str]:
        return [f"{key} = {getattr(self, key)!r} ({self.origin.get(key, 'built-in')})" if getattr(self, key)
                is not None else f"{key}: not set" for key in KEYS]


def read_config(path: Path | None = None) -> dict[str, Any]:
    """The config file's values, checked; {} when there is no file."""
    path = path or config_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the config file {path} ({e}); fix its permissions or delete it") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"the config file {path} is not valid TOML ({e}); fix that line or delete the file") from e
    for key, value in data.items():
        _check(key, value, f"in {path}")
    return data


def _check(key: str, value: Any, where: str) -> None:
    if key not in KEYS:
        raise ConfigError(f"unknown key {key!r} {where}; the keys are {', '.join(KEYS)}")
    kind, lowest, example = KEYS[key]
    if type(value) is not kind or (kind is str and not value.strip()):  # type(): a TOML true is not an int
        what = "a non-empty string" if kind is str else "a whole number"
        raise ConfigError(f"{key} = {value!r} {where} must be {what}, e.g. {example}")
    if lowest is not None and value < lowest or key == "port" and value > 65535:
        raise ConfigError(f"{key} = {value!r} {where} is out of range, e.g. {example}")


def settle(flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
           path: Path | None = None) -> Defaults:
    """Each key of KEYS from the first that gives it: `flags` (None: not given), the environment, the config file
    (`path`, default config_path()), the built-in default."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in read_config(path).items():
        values[key], origin[key] = value, f"config file {path or config_path()}"
    for key, var in ENV.items():
        if environ.get(var, "").strip():
            values[key], origin[key] = environ[var].strip(), var
    for key, value in (flags or {}).items():
        if value is not None:  # click and LoadConfig check flags, with messages that name the flag
            values[key], origin[key] = value, "flag"
    if values.get("draft") == NO_DRAFT:
        values["draft"] = None
    return Defaults(**values, origin=origin)
