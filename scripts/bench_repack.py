"""What a batch of B tokens costs with the weights llama.cpp repacks for the CPU's kernels and without, side by side
in one run: the model is loaded both ways and the two are timed in alternating rounds (costs.time_batches), so a
busy spell on a noisy machine spoils both alike.

Without repacking is `LoadConfig(repack=False)` (llama.cpp's --no-repack). With it is edgespec's default: llama.cpp's
own choice, or on a build with AMX kernels (which GCC 12 miscompiles) the repackable weights named one by one
(backend.repack_without_amx).

    python scripts/bench_repack.py                        # Qwen2.5-Coder-1.5B, 2 threads
    python scripts/bench_repack.py --batches 1 4 16 64 --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgespec.backend import Model, amx_build  # noqa: E402
from edgespec.config import LoadConfig  # noqa: E402
from edgespec.decoding.costs import time_batches  # noqa: E402
from edgespec.models import fetch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512, help="tokens cached before the batches, as in a prompt")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = fetch(args.model)
    load = LoadConfig(n_ctx=args.context + max(args.batches) + 16, n_batch=max(args.batches), n_threads=args.threads)
    names = {"without repacking": dataclasses.replace(load, repack=False),
             "repacked" + (" by name (AMX build)" if amx_build() else ""): load}
    models = {name: Model(path, cfg) for name, cfg in names.items()}
    try:
        for m in models.values():
            m.decode(list(range(1000, 1000 + args.context)), n_outputs=1)
        seconds: dict[str, list[tuple[float, ...]]] = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, m in models.items():
                seconds[name].append(time_batches(m, args.batches))
        print(f"{path.name}, {args.threads} threads, {args.context} tokens cached; ms per batch, median of "
              f"{args.rounds} rounds")
        print("| B | " + " | ".join(models) + " | ratio |")
        print("|---:|" + "---:|" * (len(models) + 1))
        for i, b in enumerate(args.batches):
            ms = [statistics.median(r[i] for r in seconds[name]) * 1000 for name in models]
            print(f"| {b} | " + " | ".join(f"{x:.0f}" for x in ms) + f" | {ms[1] / ms[0]:.2f} |")
    finally:
        for m in models.values():
            m.close()


if __name__ == "__main__":
    main()
