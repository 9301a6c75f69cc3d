"""What moving cached tokens costs: a prompt that appends 10 tokens to 600 cached ones, against one that drops the
first 20 cached tokens (the rest shifted into place, as chunk reuse does) and appends the same 10, for KV caches of
several sizes. llama.cpp re-rotates the keys of every cell of the cache on a shift, used or not, so the difference
grows with the cache (`--ctx` times `--slots`), not with the tokens moved.

    python scripts/bench_kv_shift.py                      # Qwen2.5-Coder-1.5B, 2 threads
    python scripts/bench_kv_shift.py --cells 2048 16384
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgespec.backend import Model  # noqa: E402
from edgespec.config import LoadConfig  # noqa: E402
from edgespec.models import fetch  # noqa: E402

CACHED, DROPPED, ADDED = 600, 20, 10


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--cells", type=int, nargs="+", default=[2048, 8192, 16384], help="KV cache sizes (tokens)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = fetch(args.model)
    print("| KV cells | append 10 to 600 cached | drop 20, shift 580, append 10 | the shift |")
    print("|---:|---:|---:|---:|")
    for cells in args.cells:
        with Model(path, LoadConfig(n_ctx=cells, n_threads=args.threads)) as m:
            s = m.sequences[0]
            text = (ROOT / "edgespec" / "decoding" / "loop.py").read_text()
            toks = m.tokenize(text, add_special=False)[:CACHED + ADDED]
            s.evaluate(toks[:CACHED], [], 1)
            append, shift = [], []
            for _ in range(args.repeats):
                append.append(timed(lambda: s.evaluate(toks, [(0, 0, CACHED)], 1)))
                s.trim(CACHED)
                moved = CACHED - DROPPED
                shift.append(timed(lambda: s.evaluate(toks[DROPPED:], [(0, DROPPED, moved)], 1)))
                s.evaluate(toks[:CACHED], [], 1)
            a, b = statistics.median(append) * 1000, statistics.median(shift) * 1000
            print(f"| {cells} | {a:.0f} ms | {b:.0f} ms | {b - a:.0f} ms |")


if __name__ == "__main__":
    main()
