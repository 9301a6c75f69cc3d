"""edgespec: speculative decoding for local GGUF models.

    from edgespec import Engine, GenerationConfig
    with Engine("qwen2.5-coder-1.5b") as engine:
        print(engine.generate("def fib(n):", GenerationConfig(max_tokens=64)).text)
"""

import logging
from typing import Any

from edgespec.config import EngineConfig, GenerationConfig, LoadConfig, SamplingConfig
from edgespec.errors import EdgespecError

__version__ = "0.1.0"  # as pyproject.toml

logging.getLogger(__name__).addHandler(logging.NullHandler())  # a library logs; the app decides what shows

_LAZY = {"Chunk", "Completion", "Engine", "Stats"}


def __getattr__(name: str) -> Any:
    # The engine pulls in llama.cpp (a shared library load); only pay for it when used.
    if name in _LAZY:
        from edgespec import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'edgespec' has no attribute {name!r}")


__all__ = ["Chunk", "Completion", "EdgespecError", "Engine", "EngineConfig", "GenerationConfig", "LoadConfig", "SamplingConfig", "Stats"]
