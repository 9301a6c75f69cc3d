"""Where edgespec keeps a person's files: models, calibrations, memories, the config file and the chat history.

Each folder has an environment variable that overrides it (tests point them at temporary folders).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

CACHE_ENV = "EDGESPEC_CACHE"  # the model cache
MEMORY_ENV = "EDGESPEC_MEMORY_DIR"  # cross-request memories
CONFIG_DIR_ENV = "EDGESPEC_CONFIG_DIR"  # the folder of config.toml
STATE_DIR_ENV = "EDGESPEC_STATE_DIR"  # the folder of the chat history
CONFIG_FILE = "config.toml"
HISTORY_FILE = "chat_history"
Kind = Literal["cache", "config", "state"]


def user_dir(kind: Kind) -> Path:
    """The platform's folder for edgespec's cache, config or state (XDG on Linux, Library on macOS, AppData)."""
    override = {"config": CONFIG_DIR_ENV, "state": STATE_DIR_ENV}.get(kind)
    if override and os.environ.get(override):
        return Path(os.environ[override]).expanduser()
    home = Path.home()
    if sys.platform == "darwin":
        base = home / "Library" / ("Caches" if kind == "cache" else "Application Support")
    elif sys.platform == "win32":
        roaming = kind == "config"
        base = Path(os.environ.get("APPDATA" if roaming else "LOCALAPPDATA")
                    or home / "AppData" / ("Roaming" if roaming else "Local"))
    else:
        var, fallback = {"cache": ("XDG_CACHE_HOME", ".cache"), "config": ("XDG_CONFIG_HOME", ".config"),
                         "state": ("XDG_STATE_HOME", ".local/state")}[kind]
        base = Path(os.environ.get(var) or home / fallback)
    return base / "edgespec"


def cache_dir() -> Path:
    """Where fetched models live: $EDGESPEC_CACHE, else the user cache dir."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return user_dir("cache") / "models"


def calibration_dir() -> Path:
    """Where measured costs are cached (decoding.costs.calibrate): beside the model cache."""
    return cache_dir().parent / "calibration"


def memory_dir() -> Path:
    """Where cross-request memories are kept (memory.py): $EDGESPEC_MEMORY_DIR, else beside the model cache."""
    if os.environ.get(MEMORY_ENV):
        return Path(os.environ[MEMORY_ENV]).expanduser()
    return cache_dir().parent / "memory"


def config_path() -> Path:
    return user_dir("config") / CONFIG_FILE


def history_path() -> Path:
    return user_dir("state") / HISTORY_FILE
