"""A conversation over one engine: its turns, the prompt fitted to the context, totals, and transcripts on disk."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from edgespec.decoding.loop import Stats
from edgespec.errors import TranscriptError, shown
from edgespec.prompts.chat import Message


class ChatSession:
    """Multi-turn state over one engine. Each turn re-renders the conversation, and
    the engine's prefix reuse means only the new tokens are evaluated; when the
    context fills, the oldest turns are dropped (the system prompt stays)."""

    def __init__(self, engine: Any, config: Any, system: str | None = None, stop: Sequence[str] = ()) -> None:
        self.engine, self.config, self.system, self.stop = engine, config, system, tuple(stop)
        self.turns: list[Message] = []
        self.last_stats: Any = None
        self.last_finish: str | None = None
        self.notices: list[str] = []  # things the person should be told (dropped turns)
        self.totals = SessionTotals()  # every answer of the session, /reset included

    def messages(self) -> list[Message]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def reset(self) -> None:
        self.turns.clear()
        self.last_stats = None

    def send(self, text: str) -> Iterator[Any]:
        """Stream the answer to `text` as engine Chunks; a partial answer (cancelled) is kept."""
        self.turns.append({"role": "user", "content": text})
        try:
            tokens = self._fit()
        except BaseException:
            self.turns.pop()
            raise
        answer: list[str] = []
        try:  # an answer longer than the room left ends at the context's end ("length")
            for chunk in self.engine.stream(tokens, self.config, stop=self.stop):
                answer.append(chunk.text)
                if chunk.stats is not None:
                    self.last_stats, self.last_finish = chunk.stats, chunk.finish_reason
                    self.totals.add(chunk.stats)
                yield chunk
        finally:
            self.turns.append({"role": "assistant", "content": "".join(answer)})

    def _fit(self) -> list[int]:
        """The prompt tokens, after dropping the oldest turns until an answer has room."""
        n_ctx, want = self.engine.n_ctx, self._room_wanted()
        tokens = self.engine.chat_tokens(self.messages())
        dropped = 0
        while len(tokens) + want > n_ctx and len(self.turns) > 1:
            del self.turns[:2]  # a user message and its answer
            dropped += 1
            tokens = self.engine.chat_tokens(self.messages())
        if dropped:
            self.notices.append(f"context full ({n_ctx} tokens): dropped the {dropped} oldest turn(s)")
        return tokens

    def _room_wanted(self) -> int:
        """Room kept for an answer: -n, at most a quarter of the context."""
        n_ctx = self.engine.n_ctx
        return min(self.config.max_tokens or n_ctx, n_ctx // 4)

    def restore(self, messages: Sequence[Message]) -> None:
        """Take up a conversation (read_transcript's messages): a leading system message, then its turns."""
        messages = list(messages)
        self.system = messages.pop(0)["content"] if messages and messages[0]["role"] == "system" else None
        self.turns = [dict(m) for m in messages]
        self.last_stats, self.last_finish = None, None

    def prefill(self) -> int:
        """Evaluate the conversation into the KV cache now, so the next answer reuses it; its token count (0 when
        there is nothing to evaluate or it leaves no room for an answer, which the next turn then makes)."""
        if not self.turns:
            return 0
        tokens = self.engine.chat_tokens(self.messages(), add_generation_prompt=False)
        if len(tokens) + self._room_wanted() > self.engine.n_ctx:
            return 0
        for _ in self.engine.stream(tokens, replace(self.config, max_tokens=0)):
            pass
        return len(tokens)


@dataclass
class SessionTotals:
    """The figures of every answer of a chat session, summed (for /stats)."""

    answers: int = 0
    sum: Stats = field(default_factory=Stats)  # the summed counters; its per-answer rates do not apply

    def add(self, stats: Stats) -> None:
        self.answers += 1
        for name in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "decode_seconds", "cycles",
                     "drafted", "accepted"):
            setattr(self.sum, name, getattr(self.sum, name) + getattr(stats, name))

    def line(self) -> str:
        t = self.sum
        if not self.answers:
            return "session: no answer yet"
        # As Stats.tokens_per_second: the first token of each answer comes out of its prefill, not the decode time.
        rate = max(t.completion_tokens - self.answers, 0) / t.decode_seconds if t.decode_seconds else 0.0
        spec = (f", {t.accepted}/{t.drafted} drafted accepted ({t.acceptance_rate:.0%}), "
                f"{t.mean_accepted_per_cycle:.2f} per cycle") if t.drafted else ", nothing drafted"
        answers = f"{self.answers} answer{'s' if self.answers != 1 else ''}"
        return (f"session: {answers}, {t.prompt_tokens} prompt tokens ({t.cached_prompt_tokens} reused), "
                f"{t.completion_tokens} generated at {rate:.1f} tok/s{spec}")


ROLES = ("system", "user", "assistant")


def write_transcript(path: Path, messages: Sequence[Message]) -> None:
    """The conversation as JSON in OpenAI's messages shape: [{"role": ..., "content": ...}, ...]."""
    try:
        path.write_text(json.dumps(list(messages), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        raise TranscriptError(f"cannot write the transcript {path} ({e.strerror or e}); pick a file you can "
                              f"write") from e


def read_transcript(path: Path) -> list[Message]:
    """Messages from a JSON file: an array of messages, or an object holding one under "messages" (a request)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except OSError as e:
        raise TranscriptError(f"cannot read the transcript {path} ({e.strerror or e}); check the file name") from e
    except json.JSONDecodeError as e:
        raise TranscriptError(f"{path} is not JSON ({e}); /load takes a file written by /save") from e
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list):
        raise TranscriptError(f"{path} holds no list of messages; /load takes [{{\"role\": \"user\", "
                              f"\"content\": \"...\"}}, ...] as /save writes it")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise TranscriptError(f"message {i} of {path} is {shown(m, json.dumps)}; each needs a role (system, user "
                                  f"or assistant) and a string content")
        if m["role"] == "system" and i:
            raise TranscriptError(f"message {i} of {path} is a system message; only the first may be one")
    return [{"role": m["role"], "content": m["content"]} for m in messages]
