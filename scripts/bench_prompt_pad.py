"""What a prompt batch of n new tokens costs evaluated as it is and padded as edgespec pads it (filler tokens after
it, dropped after: PromptRate.padded from this machine's calibration), side by side in alternating rounds on one
loaded model, so a busy spell spoils both alike. Logits on the last row only, as a prompt asks.

    python scripts/bench_prompt_pad.py                      # Qwen2.5-Coder-1.5B, 2 threads, n = 1..64
    python scripts/bench_prompt_pad.py --sizes 13 14 15 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import machine  # noqa: E402
from edgespec.backend import Model  # noqa: E402
from edgespec.config import LoadConfig  # noqa: E402
from edgespec.decoding.costs import PromptRate, calibrate  # noqa: E402
from edgespec.models import fetch  # noqa: E402
from edgespec.paths import calibration_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(range(1, 65)))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=400, help="tokens cached before the batch, as in an editor's slot")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    path = fetch(args.model)
    m = Model(path, LoadConfig(n_ctx=args.context + 2 * max(args.sizes) + 16, n_threads=args.threads))
    try:
        where = machine.record(m, args.threads)  # calibrates, or reads the cached calibration the next line reads
        rate = PromptRate(*calibrate(m, None, 63, calibration_dir()).prompt_curve)  # as the engine prices prompts
        m.decode(list(range(1000, 1000 + args.context)), n_outputs=1)
        base, plain = m.n_past, m.padded
        ms: dict[tuple[int, bool], list[float]] = {}
        for _ in range(args.rounds):
            for n in args.sizes:
                for pad in (False, True):
                    m.padded = rate.padded if pad else plain  # type: ignore[method-assign]
                    t = time.perf_counter()
                    m.decode(list(range(2000, 2000 + n)), n_outputs=1)
                    ms.setdefault((n, pad), []).append((time.perf_counter() - t) * 1000)
                    m.trim(base)
        med = {k: statistics.median(v) for k, v in ms.items()}
        print(machine.line(where))
        print(f"{path.name}, {args.threads} threads, {args.context} tokens cached; ms per prompt batch, median of "
              f"{args.rounds} rounds; the sizes edgespec pads:")
        print("| n | evaluated as | as it is | padded | ratio |")
        print("|---:|---:|---:|---:|---:|")
        for n in args.sizes:
            if rate.padded(n) != n:
                print(f"| {n} | {rate.padded(n)} | {med[n, False]:.0f} | {med[n, True]:.0f} | "
                      f"{med[n, True] / med[n, False]:.2f} |")
        total = [sum(med[n, pad] for n in args.sizes) for pad in (False, True)]
        print(f"all {len(args.sizes)} sizes together: {total[0]:.0f} ms as they are, {total[1]:.0f} ms padded "
              f"({total[1] / total[0]:.2f})")
    finally:
        m.close()


if __name__ == "__main__":
    main()
