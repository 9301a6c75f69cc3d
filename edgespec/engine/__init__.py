"""The Engine: a target (and its proposers) loaded from one EngineConfig, its slots and their generations."""

from edgespec.decoding.loop import FinishReason, Stats
from edgespec.engine.core import Chunk, Completion, Engine

__all__ = ["Chunk", "Completion", "Engine", "FinishReason", "Stats"]
