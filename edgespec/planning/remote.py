"""Where the target's layers go when RPC workers are given: this machine's CPU and the workers, priced per pass.

A layer unit (llama.cpp counts the output layer as one more) lives where its weights are; this machine keeps the
first units, the workers the rest, in the order given. A pass reads each side's weights at its bandwidth (a worker
is priced as a CPU unless a calibration of the layout says otherwise) and pays the link once per worker it crosses
(activations go out and come back: one round trip each), plus the output row coming back from the last worker.
The proposer never runs remotely: its passes would each pay the link. Pure: it prices literal numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from edgespec.errors import InvalidRequestError, OutOfMemoryError
from edgespec.planning.placement import CPU_BANDWIDTH, CURVES

LINK_BYTES_PER_SECOND = 125e6  # 1 Gb/s Ethernet: the link a home cluster has, until a calibration measures it
MIN_WORKER_LAYERS = 1


@dataclass(frozen=True)
class Link:
    """What the plan knows of one worker: its name, free memory and measured round trip."""

    endpoint: str
    free_bytes: int
    rtt_seconds: float


@dataclass(frozen=True)
class Spread:
    """One way to lay the target out: units on this machine, then units on each worker in order."""

    description: str
    local_units: int
    worker_units: tuple[int, ...]
    seconds: tuple[float, ...]  # predicted t(B) at the CPU curve's batch sizes

    @property
    def tokens_per_second(self) -> float:
        return 1.0 / self.seconds[0]

    @property
    def remote(self) -> bool:
        return any(self.worker_units)


def spreads(units: int, unit_bytes: float, local_free: int, links: Sequence[Link], n_embd: int, n_vocab: int,
            fixed: Sequence[int] | None = None) -> list[Spread]:
    """Every layout that fits, fastest first: the whole target here, split in proportion to free memory, or all on
    the workers; `fixed` (units per worker) replaces the choice."""
    if fixed is not None:
        if len(fixed) != len(links) or any(n < 0 for n in fixed) or sum(fixed) > units:
            raise InvalidRequestError(f"--rpc-layers {','.join(map(str, fixed))} must give one count per worker "
                                      f"({len(links)}), each >= 0, at most {units} in all (the target's layers + "
                                      f"the output layer)")
        candidates = [("as --rpc-layers fixes it", units - sum(fixed), tuple(fixed))]
    else:
        candidates = [("all on this machine", units, tuple(0 for _ in links)),
                      ("split by free memory", *_by_memory(units, unit_bytes, local_free, links)),
                      ("all on the workers", *_by_memory(units, unit_bytes, 0, links))]
    out = []
    for description, local, remote in candidates:
        fits = local * unit_bytes <= local_free and all(n * unit_bytes <= link.free_bytes
                                                        for n, link in zip(remote, links))
        if fits or fixed is not None:
            out.append(Spread(description, local, remote, _price(local, remote, unit_bytes, links, n_embd, n_vocab)))
    if not out:
        need = units * unit_bytes
        have = local_free + sum(link.free_bytes for link in links)
        raise OutOfMemoryError(f"the target needs {need / 2**30:.2f} GiB and this machine with the workers has "
                               f"{have / 2**30:.2f} GiB free; add a worker or pick a smaller quantization")
    return sorted(out, key=lambda s: s.seconds[0])


def _by_memory(units: int, unit_bytes: float, local_free: int, links: Sequence[Link]) -> tuple[int, tuple[int, ...]]:
    """Units in proportion to free memory (llama.cpp's own default split), each worker at least one."""
    frees = [local_free, *(link.free_bytes for link in links)]
    total = sum(frees) or 1
    shares = [max(MIN_WORKER_LAYERS if i else 0, math.floor(units * f / total)) for i, f in enumerate(frees)]
    shares[0] = units - sum(shares[1:])
    return max(shares[0], 0), tuple(shares[1:])


def _price(local: int, remote: Sequence[int], unit_bytes: float, links: Sequence[Link], n_embd: int,
           n_vocab: int) -> tuple[float, ...]:
    curve = CURVES["cpu"]
    compute = (local + sum(remote)) * unit_bytes / CPU_BANDWIDTH
    used = [link for n, link in zip(remote, links) if n]
    out = []
    for b, scale in zip((1, 2, 4, 8, 16, 32, 64), curve):
        link = sum(link.rtt_seconds + 2 * b * n_embd * 4 / LINK_BYTES_PER_SECOND for link in used)
        logits = b * n_vocab * 4 / LINK_BYTES_PER_SECOND if used else 0.0  # the last worker computes the output
        out.append(compute * scale + link + logits)
    return tuple(out)
