"""Choosing K each cycle from what it costs on this machine and what is likely to be accepted.

Costs come from a calibration at load: the target's time for a batch of B
tokens, t(B), and the draft's time per token, measured once per model file,
machine and thread count and cached, then corrected by the time of every pass
actually run (a deeper context makes big batches dearer). Acceptance is
tracked online, decayed so it follows the text. `choose_k` is the pure function that puts them together:
it maximizes expected committed tokens per second, and K = 0 (a plain step)
wins whenever verification costs more than the drafts are expected to save.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from edgespec.budget import K_MAX_CAP

log = logging.getLogger(__name__)

# Batch sizes calibrated; the chooser only considers these, since the curve is
# not monotonic (llama.cpp switches kernels with the batch size). Powers of two
# are where the CPU kernels are cheapest per token (FACTS.md: t(12) > t(16);
# here at 500 tokens of context t(56) = 13.5, t(64) = 12.1 single steps). 32 and 64
# pay inside a long copy: per token they cost 0.23 and 0.19 steps there, 16 costs 0.26.
CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 32, 64)
ACCEPT_DECAY = 0.9  # weight of the past per observation: follows the text within ~10 cycles
ACCEPT_PRIOR = 0.5
PRIOR_WEIGHT = 2.0  # the prior counts as this many observations
# An n-gram bet of k is made only if it still pays with every estimate one standard error lower:
# near break-even bets on few observations lose on prose (replay of the benchmark's target-only
# outputs: rag 0.97x -> 1.00x plain, code editing 2.37x -> 2.36x).
CONFIDENCE_Z = 1.0
DRAFT_P_MIN = 0.5  # a draft token the draft itself rates below this is not worth verifying
# Acceptance per position a same-family draft reaches on favourable text (FACTS.md: 93% on code
# editing); a draft that cannot pay even at this rate is not worth its memory.
DRAFT_ACCEPT_CEILING = 0.9
# A draft is kept only if, at that rate, it would beat plain decoding by this much: calibration
# is one short measurement, and a draft that would gain 5% gains nothing after its noise.
DRAFT_MIN_GAIN = 1.1
COST_DECAY = 0.8  # weight of the past per observed pass: costs follow the context within a few passes
# Per pass of another size, a size's own scale keeps this weight against the next smaller size's: one
# dear pass of 32 (a deep context, a busy spell) otherwise kept 32 and 64 untried for the rest of the run.
COST_STALE_DECAY = 0.98
CACHE_VERSION = 6


@dataclass(frozen=True)
class Costs:
    """Measured seconds: target batch of B tokens (B in `batches`), and the draft per token."""

    batches: tuple[int, ...]
    target_seconds: tuple[float, ...]
    draft_seconds_per_token: float | None = None

    def verify_seconds(self, b: int) -> float:
        return self.target_seconds[self.batches.index(b)]

    @property
    def candidate_ks(self) -> tuple[int, ...]:
        return tuple(b - 1 for b in self.batches)

    def draft_batch_seconds(self, n: int) -> float:
        """The draft decoding n tokens in one batch (catching up), priced on the target's curve
        scaled to the draft's per-token cost: same architecture, smaller matrices."""
        if n <= 0 or self.draft_seconds_per_token is None:
            return 0.0
        b = next((b for b in self.batches if b >= n), self.batches[-1])
        return self.draft_seconds_per_token * self.verify_seconds(b) / self.verify_seconds(1) * max(1.0, n / b)


class CostTracker:
    """The calibrated costs, corrected by every target pass actually run.

    Calibration happens once at an empty context on an idle machine; a deep
    context or a busy machine makes passes dearer. Load from elsewhere slows
    every pass alike, and shows first in the plain steps, which run most often:
    so the smallest size's scale is the load, and every other size's (and the
    draft's) is kept relative to it. Each observed pass moves the scale of its
    size; a size not observed yet borrows the scale of the nearest smaller one
    that was, and a size not observed lately drifts back towards it, since a
    size judged too dear is never run and so never corrected by its own passes.
    """

    def __init__(self, calibrated: Costs, decay: float = COST_DECAY, stale_decay: float = COST_STALE_DECAY) -> None:
        self.calibrated, self.decay, self.stale_decay = calibrated, decay, stale_decay
        # batch size -> observed / calibrated, relative to the smallest size's except for that one; 0 is the draft
        self._scale: dict[int, float] = {}
        self.costs = calibrated

    def observe(self, batch: int, seconds: float) -> None:
        """A target pass of `batch` tokens took `seconds`."""
        if batch in self.calibrated.batches:
            self._update(batch, seconds / self.calibrated.verify_seconds(batch))

    def observe_draft(self, seconds_per_token: float) -> None:
        """The draft proposed at `seconds_per_token`, sampling included."""
        if self.calibrated.draft_seconds_per_token:
            self._update(0, seconds_per_token / self.calibrated.draft_seconds_per_token)

    def _update(self, key: int, ratio: float) -> None:
        smallest = self.calibrated.batches[0]
        if key != smallest:
            ratio /= self._scale.get(smallest, 1.0)
        old = self._scale.get(key)
        # One stalled pass (a page fault, another process) moves the scale at most 2x.
        self._scale[key] = ratio if old is None else self.decay * old + (1 - self.decay) * min(max(ratio, old / 2),
                                                                                               old * 2)
        load = self._scale.get(smallest, 1.0)
        scales, last = [load], 1.0
        for b in self.calibrated.batches[1:]:
            # Only target passes age the other sizes: the draft's (key 0) say nothing about them.
            if key and b != key and b in self._scale:
                self._scale[b] = self.stale_decay * self._scale[b] + (1 - self.stale_decay) * last
            last = self._scale.get(b, last)
            scales.append(load * last)
        c = self.calibrated
        draft = c.draft_seconds_per_token * load * self._scale.get(0, 1.0) if c.draft_seconds_per_token else None
        self.costs = Costs(c.batches, tuple(t * s for t, s in zip(c.target_seconds, scales)), draft)


def expected_tokens(accept: Sequence[float], k: int) -> float:
    """Expected tokens committed by a cycle drafting k: 1 + sum over i<=k of P(first i accepted).

    `accept[j]` is the probability that draft token j is accepted given that
    tokens 0..j-1 were.
    """
    total, run = 1.0, 1.0
    for j in range(k):
        run *= accept[j] if j < len(accept) else 0.0
        total += run
    return total


def draft_can_pay(costs: Costs, k_max: int) -> bool:
    """Whether the draft beats plain decoding by DRAFT_MIN_GAIN at DRAFT_ACCEPT_CEILING for some k."""
    if costs.draft_seconds_per_token is None:
        return False
    _, rate = choose_k(costs, [DRAFT_ACCEPT_CEILING] * k_max, k_max, costs.draft_seconds_per_token)
    return rate >= DRAFT_MIN_GAIN / costs.verify_seconds(1)


def choose_k(costs: Costs, accept: Sequence[float], k_max: int, draft_cost_per_token: float = 0.0,
             fixed_cost: float = 0.0, accept_low: Sequence[float] | None = None) -> tuple[int, float]:
    """The k in 0..k_max (among calibrated batch sizes) with the most expected tokens per second.

    Returns (k, expected tokens per second). `draft_cost_per_token` is 0 for
    proposals that cost nothing (n-gram lookup); `fixed_cost` is paid once by
    any k > 0 (a draft catching up on tokens committed while it was idle).
    With `accept_low` (pessimistic estimates), only the k that also beat a
    plain step at those are candidates: k is sized by the mean among the bets
    likely to pay, and 0 when none is (a long match known only by its prior
    gets a short bet rather than none).
    """
    def cycle_seconds(k: int) -> float:
        return costs.verify_seconds(k + 1) + k * draft_cost_per_token + fixed_cost

    plain = 1.0 / costs.verify_seconds(1)
    best_k, best_rate = 0, plain
    for k in costs.candidate_ks:
        if k == 0 or k > min(k_max, len(accept)):
            continue
        if accept_low is not None and expected_tokens(accept_low, k) / cycle_seconds(k) <= plain:
            continue
        rate = expected_tokens(accept, k) / cycle_seconds(k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, best_rate


class AcceptanceTracker:
    """Decayed estimates of conditional acceptance, keyed by a class of proposal.

    For the draft the key is the draft position; for n-gram lookup it is the
    class of the match length, since a long match that was right before tends to
    be right again. Each estimate is a decayed count of acceptances over a
    decayed count of trials plus a prior worth PRIOR_WEIGHT trials, so a few
    observations already move it and old text fades.
    """

    def __init__(self, decay: float = ACCEPT_DECAY, prior: Callable[[int], float] = lambda key: ACCEPT_PRIOR) -> None:
        self.decay, self.prior = decay, prior
        self._counts: dict[int, tuple[float, float]] = {}  # key -> (decayed accepted, decayed trials)

    def get(self, key: int) -> float:
        accepted, trials = self._counts.get(key, (0.0, 0.0))
        return (accepted + self.prior(key) * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)

    def lower(self, key: int, z: float = CONFIDENCE_Z) -> float:
        """The estimate z standard errors lower: the prior and few, mixed outcomes give a wide margin."""
        p = self.get(key)
        _, trials = self._counts.get(key, (0.0, 0.0))
        return max(0.0, p - z * (p * (1.0 - p) / (trials + PRIOR_WEIGHT)) ** 0.5)

    def update(self, key: int, accepted: bool) -> None:
        a, n = self._counts.get(key, (0.0, 0.0))
        self._counts[key] = (self.decay * a + accepted, self.decay * n + 1.0)


# -- calibration ------------------------------------------------------------------


def calibrate(target, draft=None, k_max: int = K_MAX_CAP, cache_dir: Path | None = None) -> Costs:
    """Measure t(B) of the target and the draft's per-token cost; cached per file, machine and threads.

    `target` and `draft` are backend.Model objects. The measurement decodes at
    the end of whatever the caches hold and trims back, so state is unchanged.
    """
    batches = tuple(b for b in CALIBRATION_BATCHES if b <= k_max + 1)
    key = _cache_key(target, draft, batches)
    path = (cache_dir or _default_cache_dir()) / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("version") == CACHE_VERSION:
            costs = Costs(tuple(data["batches"]), tuple(data["target_seconds"]), data["draft_seconds_per_token"])
            log.info("costs from cache %s", path)
            return costs
    except (OSError, ValueError, KeyError):
        pass
    t0 = time.perf_counter()
    target_seconds = _time_batches(target, batches)
    draft_cost = _time_batches(draft, (1,))[0] if draft is not None else None
    costs = Costs(batches, target_seconds, draft_cost)
    log.info("calibrated in %.2fs: t(B)/t(1) = %s, draft/target per token = %s", time.perf_counter() - t0,
             [round(t / target_seconds[0], 2) for t in target_seconds],
             round(draft_cost / target_seconds[0], 2) if draft_cost else None)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, **asdict(costs)}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache calibration at %s: %s", path, e)
    return costs


def _time_batches(model, batches: Sequence[int]) -> tuple[float, ...]:
    """Seconds to decode each batch size with logits on every row, as verification asks.

    Warm-up passes first (page faults, thread pool, both kernel paths); then
    three rounds over all sizes and the median per size. Rounds, not three
    passes in a row, so that a burst of load from elsewhere spoils one sample of
    several sizes rather than every sample of one: a size judged too dear is
    never tried, so never corrected (CostTracker only sees the passes run). The
    caches are left as found.
    """
    base = model.n_past
    token = model.vocab.bos if model.vocab.bos is not None else 0
    for b in (batches[-1], 1):
        model.decode([token] * b, n_outputs=b)
        model.trim(base)
    samples: list[list[float]] = [[] for _ in batches]
    for _ in range(3):
        for i, b in enumerate(batches):
            t = time.perf_counter()
            model.decode([token] * b, n_outputs=b)
            samples[i].append(time.perf_counter() - t)
            model.trim(base)
    out: list[float] = []
    for times in samples:
        # Among powers of two a larger batch never costs less; a dip is noise.
        out.append(max(sorted(times)[1], out[-1] if out else 0.0))
    return tuple(out)


def _cache_key(target, draft, batches) -> str:
    parts = [platform.machine(), platform.processor(), str(os.cpu_count()), str(target.cfg.n_threads), str(batches)]
    for m in (target, draft):
        if m is not None:
            st = m.path.stat()
            parts += [str(m.path.resolve()), str(st.st_size), str(int(st.st_mtime)), str(m.cfg.n_gpu_layers),
                      m.cfg.flash_attn]
    parts.append(_cpu_model())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _cpu_model() -> str:
    """The CPU's name and flags: machines named alike ("AMD EPYC") may differ in AVX-512, and so in costs."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = (next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), "")
              for key in ("model name", "flags"))
    return " ".join(wanted).strip() or platform.processor()


def _default_cache_dir() -> Path:
    from edgespec.models.store import cache_dir

    return cache_dir().parent / "calibration"
