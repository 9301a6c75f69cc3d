"""Does a decode step stall after the process sat idle, and is it the machine paging?

Issue 22 saw one cycle take 1.4 s in a benchmark. This loads the target twice, with the weights
mapped from the file (llama.cpp's default) and read into memory (`--no-mmap`), warms both, then
after each idle period times the first decode steps of each and counts the major page faults
(reads from disk) they took. A step that stalls with major faults is the kernel having dropped
file pages while idle (a reclaimer such as DAMON's pageout acts on pages idle for tens of seconds);
one that stalls without them is ours.

    python scripts/idle_stall.py --idle 0,60,120
"""

from __future__ import annotations

import argparse
import resource
import time

from edgespec import Engine, GenerationConfig, LoadConfig


def majflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def first_steps(engine: Engine, prompt: str, n: int) -> list[tuple[float, int]]:
    """(seconds, major faults) of the prefill and of each of the next n-1 steps."""
    out, faults, t = [], majflt(), time.perf_counter()
    for chunk in engine.stream(prompt, GenerationConfig(max_tokens=n, memory=None)):
        now, f = time.perf_counter(), majflt()
        out.append((now - t, f - faults))
        faults, t = f, now
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--idle", default="0,60,120", help="seconds to sit idle before each measurement")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    engines = {mmap: Engine(args.model, proposer="none", load=LoadConfig(n_ctx=512, n_threads=args.threads,
                                                                          mmap=mmap))
               for mmap in (True, False)}
    for i, idle in enumerate(int(s) for s in args.idle.split(",")):
        time.sleep(idle)
        for mmap, engine in engines.items():
            # another prompt each round: a cached prefix would skip the prefill being measured
            steps = first_steps(engine, f"Round {i}: count from 1 to 20.", args.steps)
            cells = ", ".join(f"{s * 1e3:.0f} ms ({f} faults)" for s, f in steps)
            print(f"idle {idle:>4} s, {'mmap   ' if mmap else 'no-mmap'}: prefill and steps: {cells}", flush=True)


if __name__ == "__main__":
    main()
