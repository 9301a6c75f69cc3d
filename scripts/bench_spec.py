"""Speculative decoding speed and acceptance, side by side with plain decoding in one run.

For every prompt all modes generate in lockstep, one cycle at a time with the
mode furthest behind going next, each timed over its own cycles only, so a slow
spell of this shared machine falls on every mode at the same point of the answer
(timing whole runs one after another, the same plain run varied by 10% or more
here); `--whole-runs` times whole runs instead. This is repeated `--repeats`
times. Per category the script reports decode tok/s (tokens after the first,
over decode time, summed over prompts and repeats), its ratio to plain decoding
in the same run, and acceptance. Greedy, as Spec-Bench is usually reported.
The machine line above the table names the CPU, its vector extensions, the threads, the llama.cpp
build and its calibrated t(B) (scripts/machine.py); a cycle dearer than twice the largest draft and
verify batch (calibrated) is a stall, left out of the ratios and listed on its own line.
llama.cpp's decoders run as subprocesses and do not stop at the requested
length, so on the code-editing set each llama.cpp run is paired with a run of
auto for as many tokens as it decoded, and the two are compared at equal length; under a build
without AVX-512 on an AVX-512 CPU, the tools are built the same way (scripts/llama_tools.py --avx2).
Per code edit the report sets auto against the oracle of scripts/replay_auto.py on plain decoding's
output (the speed of lookup knowing which tokens will be accepted), priced on this run's calibrated
curve and on t(B) timed at the edit's own context.

    python scripts/bench_spec.py --llama-cpp --plot
        # plain decoding and auto; llama.cpp's own n-gram speculation on the code-editing set
        # (tools built by scripts/llama_tools.py); PNG next to the JSON
    python scripts/bench_spec.py --modes none,ngram:2,ngram:4,ngram:8,draft:2,draft:4,auto
        # fixed K for comparison
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_tools  # noqa: E402
import machine  # noqa: E402
import replay_auto  # noqa: E402
import workloads  # noqa: E402

from edgespec import Engine, GenerationConfig, LoadConfig  # noqa: E402
from edgespec.decoding import costs  # noqa: E402
from edgespec.config import MAX_K  # noqa: E402
from edgespec.models import resolve  # noqa: E402

# llama.cpp's n-gram speculation at its defaults: ngram-map-k looks up a 12-token key and drafts up
# to 48 tokens, ngram-mod needs a 24-token match and drafts 48 to 64. Neither reads
# --spec-draft-n-max, nor -n: a draft may run past the requested length (124-193 tokens for 128).
LLAMA_CPP_MODES = ("ngram-map-k", "ngram-mod")
# A cycle dearer than this many times the largest draft and verify batch (calibrated; no cycle costs more
# than one of each) is a stall: a page-in after idling, another tenant. Reported apart.
STALL_FACTOR = 2


def parse_modes(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, k = item.partition(":")
        out.append((name, int(k) if k else 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--modes", default="none,auto")
    ap.add_argument("--repeats", type=int, default=2, help="runs of every mode per prompt, order reversed each time")
    ap.add_argument("--llama-cpp", action="store_true", help="also run llama-speculative-simple on the code-edit set")
    ap.add_argument("--plot", action="store_true", help="write a PNG (needs matplotlib)")
    ap.add_argument("--per-category", type=int, default=4, help="Spec-Bench questions per category")
    ap.add_argument("--code-edits", type=int, default=8, help="prompts in the code-editing set")
    ap.add_argument("--held-out", action="store_true",
                    help="the next --per-category questions of each category and other standard-library functions: "
                         "prompts nothing here was tuned on")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--whole-runs", action="store_true",
                    help="time each mode's whole run in turn instead of interleaving their cycles (lockstep)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/spec.json"))
    args = ap.parse_args()

    modes = parse_modes(args.modes)
    load = LoadConfig(n_ctx=4096, n_threads=args.threads)
    if ("none", 0) not in modes:
        modes.insert(0, ("none", 0))  # the baseline of every ratio
    kinds = {"none": {"proposer": "none"}, "ngram": {"proposer": "ngram"},
             "draft": {"draft": args.draft, "proposer": "draft"}, "auto": {"draft": args.draft}}
    # One engine per mode: modes in lockstep cannot share one (an engine runs one generation at a time).
    by_mode = {(name, k): Engine(args.model, k=k or None, load=load, **kinds[name]) for name, k in modes}
    plain, auto = by_mode[("none", 0)], by_mode.get(("auto", 0))
    where = machine.record(plain.target, args.threads)
    drafting = max((e.costs.draft_seconds_per_token or 0.0 for e in by_mode.values() if e.costs), default=0.0)
    stall_bar = STALL_FACTOR * (where["t1_ms"] * where["t_ratio"][-1] / 1e3 + MAX_K * drafting)
    for note in auto.notes if auto is not None else ():
        print(f"auto: {note}", file=sys.stderr)
    same_kernels = where["build_vector"] == "AVX2" and where["cpu_vector"].startswith("AVX-512")
    tool = llama_tools.tool("llama-speculative-simple", build=True, avx2=same_kernels) if args.llama_cpp else None
    skip, sources = (args.per_category, workloads.HELD_OUT_SOURCES) if args.held_out else (0, workloads.EDIT_SOURCES)
    prompts = workloads.spec_bench(args.per_category, skip=skip) + workloads.code_edits(args.code_edits, sources)
    # Prompt-only speculation: with cross-request memory a second repeat would copy the first's answer.
    config = GenerationConfig(max_tokens=args.max_tokens, memory=None)

    rows, prompt_tokens, stalled = [], [], []
    at_context: dict[int, list[float]] = {}  # per code edit, t(B)/t(1) measured at its context
    t_start = time.time()
    for i, (category, text) in enumerate(prompts):
        # every engine loads the same target, so the templated prompt is the same for all
        messages = [{"role": "user", "content": text}]
        tokens = plain.chat_tokens(messages)
        prompt_tokens.append(tokens)
        for rep in range(args.repeats):
            order = modes if rep % 2 == 0 else modes[::-1]
            if args.whole_runs:
                timed = {}
                for name, k in order:
                    out = by_mode[(name, k)].generate(tokens, config)
                    timed[(name, k)] = (out.stats, out.stats.decode_seconds, out.tokens)
            else:
                stalls: dict = {}
                timed = lockstep({mode: by_mode[mode] for mode in order}, tokens, config, stalls, stall_bar)
                for (name, k), times in stalls.items():
                    stalled += [f"{category} prompt {i} repeat {rep} {f'{name}:{k}' if k else name} at token {at}: "
                                f"{t:.2f} s, {faults} major page faults, {gc_s:.2f} s garbage collection"
                                for t, faults, gc_s, at in times]
            for (name, k), (s, seconds, output) in timed.items():
                rows.append(stats_row(category, i, rep, f"{name}:{k}" if k else name, s, seconds, output))
        if category == "code-edit" and auto is not None:
            # t(B) where the edit ran (the cache holds its prompt and answer): big batches cost more there than
            # at load, where calibration measured them, and the oracle should pay what auto paid.
            seconds = costs.time_batches(plain.target, tuple(where["batches"]))
            at_context[i] = [t / seconds[0] for t in seconds]
        if tool is not None and category == "code-edit":
            prompt_text = plain.chat_text(messages)
            lengths: dict[str, int] = {}
            for rep in range(args.repeats):
                for spec in LLAMA_CPP_MODES if rep % 2 == 0 else LLAMA_CPP_MODES[::-1]:
                    # each llama.cpp run next to auto over as many tokens as llama.cpp decoded (the end of an
                    # edit is mostly copy, the cheapest part), in alternating order; a subprocess cannot lockstep
                    runs = ["llama.cpp", "auto"] if rep % 2 == 0 or spec not in lengths else ["auto", "llama.cpp"]
                    for who in runs if auto is not None else ["llama.cpp"]:
                        if who == "llama.cpp":
                            n, secs, drafted, accepted = run_llama_cpp(tool, resolve(args.model), prompt_text, spec,
                                                                       args.max_tokens, args.threads)
                            lengths.setdefault(spec, n)
                            rows.append({"category": category, "prompt": i, "repeat": rep,
                                         "mode": f"llama.cpp {spec}", "tokens": n, "seconds": secs,
                                         "drafted": drafted, "accepted": accepted, "cycles": 0})
                        else:
                            out = auto.generate(tokens, GenerationConfig(max_tokens=lengths[spec] + 1, memory=None))
                            rows.append(stats_row(category, i, rep, f"auto, {spec} length", out.stats,
                                                  out.stats.decode_seconds, out.tokens))
        print(f"[{i + 1}/{len(prompts)}] {category} done, {time.time() - t_start:.0f}s", file=sys.stderr)

    mode_names = [f"{n}:{k}" if k else n for n, k in modes]
    if tool is not None:
        mode_names += [f"llama.cpp {s}" for s in LLAMA_CPP_MODES]
    print(machine.line(where))
    report(rows, mode_names)
    if auto is not None:
        oracle_report(rows, prompt_tokens, dict(zip(where["batches"], where["t_ratio"])),
                      {i: dict(zip(where["batches"], r)) for i, r in at_context.items()})
    print(f"\nstalled cycles (over {stall_bar:.2f} s: twice the largest draft and verify batch), left out of "
          f"the ratios above: {'; '.join(stalled) if stalled else 'none'}")
    if args.repeats > 1:
        print("\nthe same, counting per prompt and mode only its fastest repeat (a burst of load from elsewhere"
              " slows one repeat, not both)")
        report(fastest_repeats(rows), mode_names)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "machine": where, "rows": rows,
                                    "stalls": stalled, "prompts": prompt_tokens,
                                    "curve_at_context": at_context}, indent=1))
    if args.plot:
        plot(rows, mode_names, args.out.with_suffix(".png"))


def stats_row(category: str, prompt: int, repeat: int, mode: str, s, seconds: float, output: list[int]) -> dict:
    return {"category": category, "prompt": prompt, "repeat": repeat, "mode": mode, "tokens": s.completion_tokens - 1,
            "seconds": seconds, "drafted": s.drafted, "accepted": s.accepted, "cycles": s.cycles,
            "accepted_at": s.accepted_at, "drafted_at": s.drafted_at, "by_proposer": s.cycles_by_proposer,
            "output": list(output)}


def lockstep(engines: dict, tokens: list[int], config: GenerationConfig, stalls: dict | None = None,
             stall_seconds: float = float("inf")) -> dict:
    """Generate with every engine at once, one cycle at a time, the one furthest behind next.

    Each engine's decode time is the sum of its own cycles, so a slow spell of the machine
    (other tenants, frequency) falls on all of them at the same positions of the answer
    instead of on whichever whole run it hit. Returns {key: (stats, decode seconds, output tokens)};
    with `stalls`, the stalled cycles are left out of the seconds and listed there (see lockstep_streams).
    """
    return lockstep_streams({key: e.stream(tokens, config) for key, e in engines.items()}, stalls, stall_seconds)


def lockstep_streams(streams: dict, stalls: dict | None = None, stall_seconds: float = float("inf")) -> dict:
    """`lockstep` over any Engine.stream iterators (e.g. one engine's slots under different configs).

    With a `stalls` dict and `stall_seconds`, a cycle longer than that is taken out of its stream's
    seconds and recorded in stalls[key] as (seconds, major page faults, seconds in the garbage collector,
    tokens generated before it), so that one stall is reported on its own rather than decide a category."""
    done, seconds = {}, dict.fromkeys(streams, 0.0)
    outputs: dict = {key: [] for key in streams}
    cycles: dict = {key: [] for key in streams}
    for key, stream in streams.items():
        outputs[key] += next(stream).tokens  # prefill and the first token: not decode time
    with _gc_timer() as gc_seconds:
        while len(done) < len(streams):
            key = min((k for k in streams if k not in done), key=lambda k: len(outputs[k]))
            faults, gc_before, t = _major_faults(), gc_seconds[0], time.perf_counter()
            chunk = next(streams[key])
            cycles[key].append((time.perf_counter() - t, _major_faults() - faults, gc_seconds[0] - gc_before,
                                len(outputs[key])))
            seconds[key] += cycles[key][-1][0]
            outputs[key] += chunk.tokens
            if chunk.stats is not None:
                done[key] = (chunk.stats, seconds[key], outputs[key])
    if stalls is not None:
        for key, times in cycles.items():
            stalls[key] = [c for c in times if c[0] > stall_seconds]
            s, secs, out = done[key]
            done[key] = (s, secs - sum(c[0] for c in stalls[key]), out)
    return {key: done[key] for key in streams}


def _major_faults() -> int:
    """Page faults that read from disk: a stall with many of them is the machine paging, not the engine."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


@contextlib.contextmanager
def _gc_timer():
    """Seconds spent in Python's garbage collector while the block runs (a one-element list)."""
    total, started = [0.0], [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            total[0] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    try:
        yield total
    finally:
        gc.callbacks.remove(callback)


def run_llama_cpp(tool: Path, model: Path, prompt: str, spec: str, n: int, threads: int):
    """llama-speculative-simple on the same (already templated) prompt; its own decode figures."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        out = subprocess.run([str(tool), "-m", str(model), "-f", f.name, "-n", str(n), "-t", str(threads),
                              "--temp", "0", "-c", "4096", "--spec-type", spec],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds", text)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", text)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", text)
    return int(m.group(1)), float(m.group(2)), int(drafted.group(1)), int(accepted.group(1))


def plot(rows: list[dict], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = _aggregate(rows)
    cats = list(dict.fromkeys(r["category"] for r in rows))
    shown = [m for m in modes if m != "none" and not m.startswith("llama.cpp")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(shown)
    for j, m in enumerate(shown):
        vals = [_ratio(speed, c, m) for c in cats]
        ax1.bar([i + j * width for i in range(len(cats))], vals, width, label=m)
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    ax1.set_ylabel("decode speed ÷ plain decoding")
    ax1.set_title("Speedup by category (same run)")
    ax1.legend(fontsize=8)
    for m in shown:
        drafted, accepted = defaultdict(int), defaultdict(int)
        for r in rows:
            if r["mode"] == m:
                for i, (d, a) in enumerate(zip(r.get("drafted_at", []), r.get("accepted_at", []))):
                    drafted[i] += d
                    accepted[i] += a
        xs = [i + 1 for i in sorted(drafted) if drafted[i] >= 5]
        if xs:
            ax2.plot(xs, [accepted[i - 1] / drafted[i - 1] for i in xs], marker="o", label=m)
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("Acceptance by draft position (all prompts)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


def fastest_repeats(rows: list[dict]) -> list[dict]:
    """Per (prompt, mode) the repeat with the highest decode tok/s."""
    def tps(r: dict) -> float:
        return r["tokens"] / r["seconds"] if r["seconds"] else 0.0

    best: dict[tuple[int, str], dict] = {}
    for r in rows:
        key = (r["prompt"], r["mode"])
        if key not in best or tps(r) > tps(best[key]):
            best[key] = r
    return list(best.values())


def _aggregate(rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    agg: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0, 0, 0])  # tokens, s, drafted, acc, runs
    for r in rows:
        cats = [r["category"]] + (["all Spec-Bench"] if r["category"] != "code-edit" else [])
        for cat in cats:
            a = agg[(cat, r["mode"])]
            a[0] += r["tokens"]
            a[1] += r["seconds"]
            a[2] += r["drafted"]
            a[3] += r["accepted"]
            a[4] += 1
    return agg


def _ratio(agg, cat: str, mode: str) -> float:
    base, a = agg[(cat, "none")], agg[(cat, mode)]
    if not (base[1] and a[1]):
        return 0.0
    return (a[0] / a[1]) / (base[0] / base[1])


def report(rows: list[dict], modes: list[str]) -> None:
    agg = _aggregate(rows)
    cats = list(dict.fromkeys(r["category"] for r in rows))
    cats += ["all Spec-Bench"] if any(c != "code-edit" for c in cats) else []
    print("\ndecode speed ÷ plain decoding in the same run (acceptance in brackets)\n")
    print("| category | plain tok/s | " + " | ".join(m for m in modes if m != "none") + " |")
    print("|---|---:|" + "---:|" * (len(modes) - 1))
    for cat in cats:
        base = agg[(cat, "none")]
        base_tps = base[0] / base[1] if base[1] else 0.0
        cells = []
        for m in modes:
            if m == "none":
                continue
            a = agg[(cat, m)]
            if not a[1]:
                cells.append("–")
                continue
            acc = f" ({a[3] / a[2]:.0%})" if a[2] else ""
            cells.append(f"{_ratio(agg, cat, m):.2f}×{acc}")
        print(f"| {cat} | {base_tps:.1f} | " + " | ".join(cells) + " |")
    llama = [m for m in modes if m.startswith("llama.cpp") and agg[("code-edit", m)][1]]
    if llama and "auto" in modes:
        def tps(m: str) -> float:
            a = agg[("code-edit", m)]
            return a[0] / a[1] if a[1] else 0.0

        def per_run(m: str) -> float:
            a = agg[("code-edit", m)]
            return a[0] / a[4] if a[4] else 0.0

        print(f"\ncode-edit: auto {tps('auto'):.1f} tok/s ({per_run('auto'):.0f} tokens per run)")
        for m in llama:
            same = f"auto, {m.removeprefix('llama.cpp ')} length"
            print(f"  {m}: {tps(m):.1f} tok/s ({per_run(m):.0f} tokens per run); auto ÷ it = "
                  f"{tps('auto') / tps(m):.2f}×; auto over the same lengths {tps(same):.1f} tok/s, "
                  f"÷ it = {tps(same) / tps(m):.2f}×")


# An edit is copy-heavy when lookup, following the recorded output with any batch, could copy this share of it.
COPY_HEAVY = 0.75


def oracle_report(rows: list[dict], prompts: list[list[int]], curve: dict[int, float],
                  at_context: dict[int, dict[int, float]]) -> None:
    """auto against the lookup oracle per code edit (oracle: scripts/replay_auto.py, on plain's output), under
    the calibrated curve and under t(B) measured at the edit's context."""
    speed: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for r in rows:
        if r["category"] == "code-edit" and r["mode"] in ("none", "auto"):
            speed[(r["prompt"], r["mode"])][0] += r["tokens"]
            speed[(r["prompt"], r["mode"])][1] += r["seconds"]
    flat = dict.fromkeys(curve, 1.0)
    print("\ncode edits: auto against the oracle, under the calibrated curve and under t(B) at the edit's context\n")
    print("| edit | copied | auto ÷ plain | oracle ÷ plain | auto ÷ oracle | t(64)/t(1) there | oracle there | "
          "auto ÷ it |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    heavy: list[tuple[float, float]] = []
    for i in sorted({p for p, m in speed if m == "auto"}):
        out = next(r["output"] for r in rows if r["prompt"] == i and r["mode"] == "none")
        there = at_context.get(i, curve)
        oracle, oracle_there = ((len(out) - 1) / replay_auto.oracle_one(prompts[i], out, c)[0] for c in (curve, there))
        copied = replay_auto.oracle_one(prompts[i], out, flat)[1] / max(1, len(out) - 1)
        (n_a, s_a), (n_p, s_p) = speed[(i, "auto")], speed[(i, "none")]
        auto = (n_a / s_a) / (n_p / s_p)
        heavy += [(auto / oracle, auto / oracle_there)] if copied >= COPY_HEAVY else []
        print(f"| {i} | {copied:.0%} | {auto:.2f}× | {oracle:.2f}× | {auto / oracle:.0%} | {there[max(there)]:.2f} | "
              f"{oracle_there:.2f}× | {auto / oracle_there:.0%} |")
    for j, name in enumerate(("calibrated curve", "t(B) at each edit's context")):
        if heavy:
            got = [h[j] for h in heavy]
            print(f"copy-heavy edits (≥ {COPY_HEAVY:.0%} copied), {name}: auto at {min(got):.0%}-{max(got):.0%} "
                  f"of the oracle, mean {sum(got) / len(got):.0%}")


if __name__ == "__main__":
    main()
