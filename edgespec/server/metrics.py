"""The server's counters in Prometheus' text format: the only module that imports prometheus_client.

Each app has its own registry, so two servers in one process (tests) do not share counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

if TYPE_CHECKING:
    from edgespec.decoding.loop import Stats

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # the *_created samples say when a counter was made: noise for a sidecar


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("edgespec_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.generations = Counter("edgespec_generations", "Generations ended, by finish reason",
                                   ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("edgespec_prompt_tokens", "Prompt tokens of ended generations", registry=r)
        self.prompt_reused = Counter("edgespec_prompt_tokens_reused",
                                     "Prompt tokens taken from a slot's KV cache instead of evaluated", registry=r)
        self.completion_tokens = Counter("edgespec_completion_tokens", "Tokens generated", registry=r)
        self.cycles = Counter("edgespec_cycles", "Target passes after the prefill, by proposer (none: a plain step)",
                              ["proposer"], registry=r)
        self.drafted = Counter("edgespec_draft_tokens", "Tokens proposed to the target", registry=r)
        self.accepted = Counter("edgespec_draft_tokens_accepted", "Proposed tokens the target accepted", registry=r)
        self.seconds = Counter("edgespec_phase_seconds", "Seconds spent, by phase (prefill, draft, verify, other)",
                               ["phase"], registry=r)
        self.waiting = Gauge("edgespec_requests_waiting", "Generations waiting for a free slot", registry=r)
        self.busy = Gauge("edgespec_slots_busy", "Slots generating now", registry=r)
        self.aside_builds = Counter("edgespec_aside_builds", "Wider /infill contexts built beside the slots while "
                                    "nobody waited, by outcome (done, stopped by a request)", ["outcome"], registry=r)
        self.pauses = Histogram("edgespec_pause_seconds", "Pauses from an answer to the next request someone waited "
                                "on, while the server ran (not while stopped): what background batches are sized to",
                                buckets=(0.25, 0.5, 1, 2, 4, 8, 16, 32), registry=r)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def generation(self, stats: Stats, finish_reason: str | None) -> None:
        """Count one ended generation (completed, stopped, cancelled) by what its stats say."""
        self.generations.labels(finish_reason or "error").inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prompt_reused.inc(stats.cached_prompt_tokens)
        self.completion_tokens.inc(stats.completion_tokens)
        for proposer, n in stats.cycles_by_proposer.items():
            self.cycles.labels(proposer).inc(n)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        for phase, s in (("prefill", stats.prefill_seconds), ("draft", stats.draft_seconds),
                         ("verify", stats.verify_seconds), ("other", stats.other_seconds)):
            self.seconds.labels(phase).inc(s)

    def queued(self, job: Callable[[], Any]) -> Callable[[], Any]:
        """`job`, counted as waiting until a worker starts it and as busy while it runs."""
        self.waiting.inc()

        def run() -> Any:
            self.waiting.dec()
            self.busy.inc()
            try:
                return job()
            finally:
                self.busy.dec()

        return run

    def render(self) -> bytes:
        return generate_latest(self.registry)
