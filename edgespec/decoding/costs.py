"""What passes cost on this machine and how often proposals are accepted: measured, then tracked.

Costs come from a calibration at load: the target's time for a batch of B tokens,
t(B), and the draft's time per token, measured once per model file, machine and
thread count and cached, then corrected by every pass actually run. Acceptance is
tracked online as decayed counts, so it follows the text. `policy` puts them together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Callable, Sequence

from edgespec.decoding.policy import CONFIDENCE_Z, Costs

log = logging.getLogger(__name__)

# Batch sizes calibrated; the chooser only considers these, since the curve is not monotonic (llama.cpp
# switches kernels with the batch size) and powers of two are where CPU kernels are cheapest per token.
CALIBRATION_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# Sizes just short of a calibrated one, timed for prompts (PromptRate.padded): llama.cpp's repacked CPU kernels take
# a batch's rows four at a time and each row left over alone, so 15 tokens can cost more than 16.
PROMPT_BATCHES = (3, 7, 15, 31, 63)
ACCEPT_DECAY = 0.9  # weight of the past per observation: follows the text within ~10 cycles
ACCEPT_PRIOR = 0.5
PRIOR_WEIGHT = 2.0  # the prior counts as this many observations
COST_DECAY = 0.8  # weight of the past per observed pass: costs follow the context within a few passes
# Per pass of another size, a size's own scale keeps this weight against the next smaller size's, so
# one dear pass (a deep context, a busy spell) does not keep the larger sizes untried for good.
COST_STALE_DECAY = 0.98
CACHE_VERSION = 9  # 9: PROMPT_BATCHES timed too; 8: an AMX build repacks its weights by name (its curve changed)
# Background batch sizes a pause is planned in (pause_batch), and the slack on a batch's predicted time: its cost
# varies between runs, and a batch that overruns the pause is lost.
PAUSE_BATCH_STEP = 8
# Fewest new tokens a prefill must evaluate to correct the prompt rate's scale: below it a prefill's time is mostly
# the request's own overhead, not its tokens', and scaled every batch up to 2.4x dear (docs/bench/editor.md).
RATE_LEAST_TOKENS = 8
PAUSE_MARGIN = 1.15
# Cores other processes may keep busy on this process's CPUs, past those its threads leave free, for a timing to be
# cached: one taken while a build or a benchmark ran would price every later run's prompts as dear as then.
CONTENDED_CORES = 0.25
# Timings taken while it is so, at most, before the fastest of each size is used: under a curve timed beside a
# test worker no proposal may pay (docs/policy.md).
CONTENDED_TRIES = 3
TimingProgress = Callable[[str, int, int], None]  # (model file name, passes timed, passes in all)


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
        self.costs = dataclasses.replace(c, target_seconds=tuple(t * s for t, s in zip(c.target_seconds, scales)),
                                         draft_seconds_per_token=draft)


class PromptRate:
    """Seconds to evaluate n new prompt tokens: the calibrated t(B) curve (B up to its largest batch, each batch
    beyond at the largest's cost), scaled by what prefills actually took. A few new tokens cost far more per token
    than a long prompt (a small batch runs slower kernels), and an editor's next request is a few new tokens.

    A prefill that moved cached chunks also paid for llama.cpp's re-rotation of every cell of the context, a cost
    of the context's size, not of the tokens: it is priced apart (`shift`, timed once where the engine can, then
    followed), so it neither inflates the scale nor is forgotten where a prompt needs it."""

    def __init__(self, batches: Sequence[int] = (), seconds: Sequence[float] = (), shift: float | None = None,
                 decay: float = COST_DECAY) -> None:
        self.batches, self.seconds_of = tuple(batches), tuple(seconds)
        self.decay, self.scale = decay, 1.0
        self.shift = shift  # seconds of one re-rotation: timed (engine.slots), else the first prefill with one
        # The scale of batches nobody waits on (an aside build's), followed apart: a request's prefill also pays for
        # the request around it, and requests' scale priced such batches 1.5x dear (docs/bench/editor.md).
        self.background = 1.0

    @property
    def known(self) -> bool:
        return bool(self.batches)

    def seconds(self, tokens: int, shifted: bool = False) -> float:
        """Predicted seconds for a prefill of `tokens` new tokens (0 for none), after moving cached chunks."""
        return self._moved(shifted) + self.scale * self._curve(tokens)

    def _curve(self, tokens: int) -> float:
        """Seconds the calibrated curve gives `tokens` new tokens, unscaled (0 for none or nothing calibrated)."""
        if tokens <= 0 or not self.known:
            return 0.0
        b, t = self.batches, self.seconds_of
        full, rest = divmod(tokens, b[-1])
        return full * t[-1] + (_interpolate(b, t, self.padded(rest)) if rest else 0.0)

    def padded(self, n: int) -> int:
        """How many tokens to evaluate `n` new prompt tokens as: the timed size of at least n that costs least, where
        that is less than n cost alone (else n; also at or past the largest size). The filler after them changes none
        of their rows, attention being causal, and is dropped after (backend.Model.padded)."""
        b, t = self.batches, self.seconds_of
        if not self.known or n <= 0 or n >= b[-1]:
            return n
        cost, size = min((c, s) for s, c in zip(b, t) if s >= n)
        return size if cost < _interpolate(b, t, n) else n

    def observe(self, tokens: int, seconds: float, shifted: bool = False) -> None:
        """A prefill of `tokens` new tokens took `seconds`: the scale follows it, at most 2x per observation, where it
        evaluated at least RATE_LEAST_TOKENS; one that `shifted` the cache teaches the re-rotation's cost instead
        (what it took past the tokens' price), also at most 2x: a slow spell over a long prompt is the tokens' more
        than the re-rotation's."""
        if seconds <= 0 or not self.known:
            return
        if shifted:
            past, old = max(0.0, seconds - self.seconds(tokens)), self.shift
            self.shift = past if old is None else self._followed(old, past)
            return
        if tokens >= RATE_LEAST_TOKENS:
            self.scale = self._followed(self.scale, seconds / self._curve(tokens))

    def background_seconds(self, tokens: int, shifted: bool = False) -> float:
        """Predicted seconds for a batch of `tokens` evaluated while nobody waits, after moving cached chunks when
        `shifted` (the re-rotation costs what it costs a request)."""
        return self._moved(shifted) + self.background * self._curve(tokens)

    def _moved(self, shifted: bool) -> float:
        """Seconds of the re-rotation a prefill that `shifted` cached chunks pays first (0 where it moved none)."""
        return (self.shift or 0.0) if shifted else 0.0

    def observe_background(self, tokens: int, seconds: float, at_least: bool = False) -> None:
        """A batch of `tokens` evaluated while nobody waits took `seconds` (of the time the process ran): its scale
        follows it as `observe`'s does. One a request aborted (`at_least`) ran that long and needed more, so it
        teaches only where it ran past its price: batches priced short were each aborted at a pause's end, and taught
        nothing, pause after pause (docs/bench/editor.md)."""
        if seconds <= 0 or not self.known or tokens < RATE_LEAST_TOKENS:
            return
        ratio = seconds / self._curve(tokens)
        if at_least:  # a bound, not a timing: the price rises to it at once (at most 2x), and never falls by it
            self.background = max(self.background, min(ratio, 2 * self.background))
        else:
            self.background = self._followed(self.background, ratio)

    def _followed(self, old: float, ratio: float) -> float:
        """A scale after one more observation of `ratio`, which moves it at most 2x."""
        return self.decay * old + (1 - self.decay) * min(max(ratio, old / 2), old * 2)

    def tokens_within(self, seconds: float, shifted: bool = False) -> int | None:
        """The most new prompt tokens predicted to fit in `seconds`, after moving cached chunks when `shifted`
        (None while nothing is calibrated)."""
        if not self.known:
            return None
        seconds -= self._moved(shifted)
        per_batch = self.seconds(self.batches[-1])
        n = self.batches[-1] * int(max(seconds, 0.0) // per_batch) if per_batch > 0 else 0
        left = seconds - self.seconds(n)
        # within one batch the curve is not monotonic (kernels switch with the size): the largest size that fits
        return n + max((k for k in range(self.batches[-1]) if self.seconds(k) <= left + 1e-9), default=0)


def pause_batch(elapsed: float, pauses: Sequence[float], seconds: Callable[[int], float], left: int,
                largest: int) -> int:
    """Tokens for the next batch of work nobody waits on, `elapsed` seconds into a pause: of up to `largest` (and
    `left` to do), the size expected to evaluate the most before the next request, by the `pauses` seen lately that
    outlast this one so far. The request aborts a batch in flight and loses it whole, and an editor's pauses are
    alike, so a fixed size would lose the end of every pause. `largest` where no pause seen lasted this long; the
    smallest where none of those holds any size by the estimate: it loses least, and fits where the estimate is dear."""
    longer = [p for p in pauses if p > elapsed]
    top = max(min(largest, left), 1)
    if not longer:
        return top
    sizes = sorted({*range(PAUSE_BATCH_STEP, top, PAUSE_BATCH_STEP), top})

    def expected(n: int) -> float:
        ends = elapsed + PAUSE_MARGIN * seconds(n)
        return n * sum(p >= ends for p in longer)

    best = max(sizes, key=lambda n: (expected(n), n))
    return best if expected(best) > 0 else sizes[0]


def pause_holds(elapsed: float, pauses: Sequence[float], seconds: float) -> bool:
    """Whether work of `seconds` that cannot be aborted, started `elapsed` seconds into a pause, is expected to end
    before the next request: most of the `pauses` seen lately that outlast this one so far last that much longer.
    True where none seen lasted this long (nothing says when the request comes)."""
    longer = [p for p in pauses if p > elapsed]
    return 2 * sum(p >= elapsed + PAUSE_MARGIN * seconds for p in longer) >= len(longer)


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """ys at x, linear between the calibrated sizes (through the origin below the smallest)."""
    lo_x, lo_y = 0, 0.0
    for hx, hy in zip(xs, ys):
        if x <= hx:
            return lo_y + (hy - lo_y) * (x - lo_x) / (hx - lo_x)
        lo_x, lo_y = hx, hy
    return ys[-1] * x / xs[-1]


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

    def chain(self, n: int) -> list[float]:
        """Estimates for keys 0..n-1 where a key not tried yet is expected to do as the key before it (key 0:
        the prior). For draft positions: with a flat prior, longer drafts would look worse than they are and
        never be tried (docs/gpu.md). One pass, since auto asks for up to MAX_K of them every cycle."""
        out: list[float] = []
        for key in range(n):
            accepted, trials = self._counts.get(key, (0.0, 0.0))
            prior = out[-1] if out else self.prior(key)
            out.append((accepted + prior * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT))
        return out

    def lower(self, key: int, z: float = CONFIDENCE_Z) -> float:
        """The estimate z standard errors lower: the prior and few, mixed outcomes give a wide margin."""
        p = self.get(key)
        _, trials = self._counts.get(key, (0.0, 0.0))
        return max(0.0, p - z * (p * (1.0 - p) / (trials + PRIOR_WEIGHT)) ** 0.5)

    def update(self, key: int, accepted: bool) -> None:
        a, n = self._counts.get(key, (0.0, 0.0))
        self._counts[key] = (self.decay * a + accepted, self.decay * n + 1.0)

    def discount(self, weight: float) -> None:
        """Keep every count at `weight` of itself: evidence from earlier texts counts less against a new one."""
        self._counts = {k: (a * weight, n * weight) for k, (a, n) in self._counts.items()}


# -- calibration ------------------------------------------------------------------


def calibrate(target, draft, k_max: int, cache_dir: Path, device: str = "cpu",
              progress: TimingProgress | None = None) -> Costs:
    """Measure t(B) of the target and the draft's per-token cost, each cached in `cache_dir` per model file,
    layers on the GPU, threads, `device` and machine: so the planner can price a layout measured before.

    `target` and `draft` (or None) are backend.Model objects. The measurement decodes at
    the end of whatever the caches hold and trims back, so state is unchanged. `progress` hears of
    every pass timed (none when the costs come from the cache).
    """
    batches = tuple(b for b in CALIBRATION_BATCHES if b <= k_max + 1)
    sizes = tuple(sorted({*batches, *(b for b in PROMPT_BATCHES if b < batches[-1])}))
    t0 = time.perf_counter()
    timed = dict(zip(sizes, _measured_or_timed(target, sizes, cache_dir, getattr(target, "device_key", device),
                                               progress)))
    target_seconds = tuple(timed[b] for b in batches)
    # An ONNX draft names its execution provider: its cost depends on that, not on llama.cpp's device.
    draft_cost = (_measured_or_timed(draft, (1,), cache_dir, getattr(draft, "device_key", device), progress)[0]
                  if draft is not None else None)
    log.info("costs in %.2fs: t(B)/t(1) = %s, draft/target per token = %s", time.perf_counter() - t0,
             [round(t / target_seconds[0], 2) for t in target_seconds],
             round(draft_cost / target_seconds[0], 2) if draft_cost else None)
    return Costs(batches, target_seconds, draft_cost, tuple((b, t) for b, t in timed.items() if b not in batches))


def measured(cache_dir: Path, path: Path, gpu_layers: int, load, device: str) -> tuple[float, ...] | None:
    """The t(B) at CALIBRATION_BATCHES cached for this model file laid out so (`load`: a LoadConfig), as far as it was
    calibrated (PROMPT_BATCHES left out), if it ever was."""
    cached = _read_cached(_cache_path(cache_dir, path, gpu_layers, load, device))
    seconds = tuple(t for b, t in zip(*cached) if b in CALIBRATION_BATCHES) if cached else ()
    return seconds or None


def _measured_or_timed(model, batches: tuple[int, ...], cache_dir: Path, device: str,
                       progress: TimingProgress | None = None) -> tuple[float, ...]:
    path = _cache_path(cache_dir, model.path, model.cfg.n_gpu_layers, model.cfg, device)
    cached = _read_cached(path)
    if cached is not None and cached[0] == batches:
        log.info("costs of %s from cache %s", model.path.name, path)
        return cached[1]
    tries: list[tuple[float, ...]] = []
    while len(tries) < CONTENDED_TRIES:
        with Contention() as busy:
            seconds = time_batches(model, batches, progress)
        if not contended(busy.others, len(busy.cpus), model.cfg.n_threads):
            break
        tries.append(seconds)
    else:  # load only slows a pass: each size's fastest try is the nearest to its quiet cost
        log.warning("costs of %s timed %d times while other processes kept %.1f of this process's %d CPUs busy: the "
                    "fastest of each size used for this run, not cached (timed again at the next load)",
                    model.path.name, len(tries), busy.others, len(busy.cpus))
        return tuple(min(t) for t in zip(*tries))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "batches": batches, "seconds": seconds}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not cache calibration at %s: %s", path, e)
    return seconds


def contended(others: float, cpus: int, threads: int) -> bool:
    """Whether other processes keeping `others` cores busy on `cpus` CPUs slowed a timing on `threads` threads: more
    than the CPUs the threads leave free, by CONTENDED_CORES."""
    return others > max(0, cpus - threads) + CONTENDED_CORES


class Contention:
    """Over a span (a `with` block): the cores other processes kept busy, on average, on the CPUs this process may
    run on (`others`), the hypervisor's steal included: time this process's threads could not have had."""

    def __enter__(self) -> "Contention":
        import psutil

        me, n = psutil.Process(), len(psutil.cpu_times(percpu=True))
        allowed = me.cpu_affinity() if hasattr(me, "cpu_affinity") else []  # none on macOS: every CPU
        self.cpus = [c for c in allowed if c < n] or list(range(n))
        self._me, self.others = me, 0.0
        self._start = (time.perf_counter(), self._busy(), self._mine())
        return self

    def __exit__(self, *exc: object) -> None:
        t0, busy0, mine0 = self._start
        wall = time.perf_counter() - t0
        self.others = max(0.0, (self._busy() - busy0) - (self._mine() - mine0)) / wall if wall > 0 else 0.0

    def _busy(self) -> float:
        import psutil

        per_cpu = psutil.cpu_times(percpu=True)
        return sum(getattr(per_cpu[c], f, 0.0) for c in self.cpus
                   for f in ("user", "nice", "system", "irq", "softirq", "steal"))

    def _mine(self) -> float:
        t = self._me.cpu_times()
        return t.user + t.system


def _read_cached(path: Path) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """(batches, seconds) from a calibration file of this CACHE_VERSION; None if absent or unreadable."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") == CACHE_VERSION:
            return tuple(data["batches"]), tuple(data["seconds"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def time_batches(model, batches: Sequence[int], progress: TimingProgress | None = None) -> tuple[float, ...]:
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
    report = progress or (lambda name, done, total: None)
    report(model.path.name, 0, 3 * len(batches))
    for b in (batches[-1], 1):
        model.decode([token] * b, n_outputs=b)
        model.trim(base)
    samples: list[list[float]] = [[] for _ in batches]
    for r in range(3):
        for i, b in enumerate(batches):
            t = time.perf_counter()
            model.decode([token] * b, n_outputs=b)
            samples[i].append(time.perf_counter() - t)
            model.trim(base)
            report(model.path.name, r * len(batches) + i + 1, 3 * len(batches))
    out: list[float] = []
    floor = 0.0
    for b, times in zip(batches, samples):
        # Among powers of two a larger batch never costs less; a dip is noise. A size short of one may cost more.
        out.append(max(sorted(times)[1], floor))
        floor = out[-1] if b & (b - 1) == 0 else floor
    return tuple(out)


def _cache_path(cache_dir: Path, path: Path, gpu_layers: int, load, device: str) -> Path:
    """One file per model file, layers on the GPU, threads, flash attention, device, machine and llama.cpp build
    (a second build, used through PYTHONPATH to time another machine's kernels, has a curve of its own)."""
    st = path.stat() if path.exists() else None
    spec = importlib.util.find_spec("llama_cpp")
    parts = [platform.machine(), str(os.cpu_count()), cpu_model(), device, str(spec.origin if spec else ""),
             str(path.resolve()),
             str(st.st_size if st else 0), str(int(st.st_mtime) if st else 0), str(gpu_layers), str(load.n_threads),
             load.flash_attn, *([] if getattr(load, "repack", True) else ["no-repack"])]
    return cache_dir / f"{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:24]}.json"


def cpu_model() -> str:
    """The CPU's name and flags: machines named alike ("AMD EPYC") may differ in AVX-512, and so in costs."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = (next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), "")
              for key in ("model name", "flags"))
    return " ".join(wanted).strip() or platform.processor()

