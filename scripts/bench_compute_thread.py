"""What a pass of one token (or of a prompt's batch) costs when two threads take turns decoding (the server's slot
workers, the thread that loaded the model), with every pass run on edgespec's one compute thread and with each
thread calling llama.cpp itself, as edgespec did before edgespec.compute. One thread decoding alone is the
reference. Each case runs in a process of its own (OpenMP's teams live as long as their threads), the cases
alternating over the rounds, so a busy spell of the machine spoils all alike.

    python scripts/bench_compute_thread.py                  # Qwen2.5-Coder-1.5B, 2 threads, 400 tokens cached
    python scripts/bench_compute_thread.py --batch 16       # a prompt's batch instead of one token
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CASES = {
    "alone": "one thread decodes (the reference)",
    "direct": "two threads take turns, each calling llama.cpp itself (edgespec before)",
    "compute": "two threads take turns, every pass on the compute thread (edgespec now)",
}


def child(case: str, model: str, threads: int, context: int, tokens: int, batch: int) -> None:
    from edgespec import compute
    from edgespec.backend import Model
    from edgespec.config import LoadConfig
    from edgespec.models import fetch

    if case == "direct":
        compute.run = lambda fn, *args: fn(*args)  # type: ignore[assignment]
    m = Model(fetch(model), LoadConfig(n_ctx=context + batch + 64, n_threads=threads))
    workers = [ThreadPoolExecutor(1) for _ in range(1 if case == "alone" else 2)]

    def one() -> float:
        t = time.perf_counter()
        m.decode(list(range(2000, 2000 + batch)), n_outputs=1)
        seconds = time.perf_counter() - t
        m.trim(context)
        return seconds

    workers[0].submit(m.decode, list(range(1000, 1000 + context)), 1).result()
    ms = [workers[i % len(workers)].submit(one).result() * 1000 for i in range(tokens)]
    print(json.dumps({"case": case, "ms": statistics.median(ms[2:])}))
    m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=400, help="tokens cached before each pass")
    ap.add_argument("--tokens", type=int, default=20, help="passes per case and round")
    ap.add_argument("--batch", type=int, default=1, help="tokens a pass evaluates (a prompt's: 16, say)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model, args.threads, args.context, args.tokens, args.batch)
        return
    import machine
    from edgespec.backend import Model
    from edgespec.config import LoadConfig
    from edgespec.models import fetch

    with Model(fetch(args.model), LoadConfig(n_threads=args.threads)) as m:
        where = machine.record(m, args.threads)
    ms: dict[str, list[float]] = {c: [] for c in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            out = subprocess.run([sys.executable, __file__, "--child", case, "--model", args.model, "--threads",
                                  str(args.threads), "--context", str(args.context), "--tokens", str(args.tokens),
                                  "--batch", str(args.batch)],
                                 capture_output=True, text=True, check=True).stdout
            ms[case].append(json.loads(out.strip().splitlines()[-1])["ms"])
    med = {c: statistics.median(v) for c, v in ms.items()}
    print(machine.line(where))
    print(f"{args.model}, {args.threads} threads, {args.context} tokens cached; ms per pass of {args.batch} token(s), "
          f"median of {args.rounds} rounds of {args.tokens}:")
    print("| case | ms per pass | ÷ alone |")
    print("|---|---:|---:|")
    for c, what in CASES.items():
        print(f"| {what} | {med[c]:.1f} | {med[c] / med['alone']:.2f} |")


if __name__ == "__main__":
    main()
