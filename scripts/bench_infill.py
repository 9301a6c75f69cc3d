"""Replay an editing session against the sidecar: time to first token and total time per /infill.

A real source file is "typed" again: at each step the cursor moves a few words
into one of its functions and the editor asks for a completion (prefix up to
the cursor, suffix after it, as llama.vim sends). Four servers run at once on
127.0.0.1 (prefix reuse on/off x speculation auto/none) and every step goes to
each in turn, so all four see the same machine load. Without reuse, each request
says `"cache_prompt": false`, as llama.cpp's clients can.

    python scripts/bench_infill.py --steps 40
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_server import Server  # noqa: E402

# name: (server options, the requests' cache_prompt)
CONFIGS = {"reuse+auto": ([], True), "reuse, no spec": (["--proposer", "none"], True),
           "no reuse+auto": ([], False), "no reuse, no spec": (["--proposer", "none"], False)}


def editing_steps(n: int, words_per_step: int = 3) -> list[tuple[str, str]]:
    """(prefix, suffix) pairs while the body of textwrap.dedent is retyped a few words at a time."""
    source = Path(inspect.getsourcefile(textwrap)).read_text()
    body = inspect.getsource(textwrap.dedent)
    start = source.index(body)
    head, tail = source[:start], source[start + len(body):]
    pieces = body.split(" ")
    steps = []
    for i in range(1, len(pieces), words_per_step):
        typed = " ".join(pieces[:i])
        steps.append((head[-1500:] + typed, tail[:500]))
        if len(steps) == n:
            break
    return steps


def infill(url: str, prefix: str, suffix: str, n_predict: int, cache_prompt: bool) -> tuple[float, float, int]:
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": n_predict, "temperature": 0, "stream": True,
            "cache_prompt": cache_prompt}
    t0 = time.perf_counter()
    first = None
    n = 0
    with httpx.stream("POST", url + "/infill", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev.get("content") and first is None:
                    first = time.perf_counter() - t0
                if ev.get("stop"):
                    n = ev["tokens_predicted"]
    total = time.perf_counter() - t0
    return first if first is not None else total, total, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/bench/infill.json"))
    args = ap.parse_args()

    servers = {name: Server(args.model, "--ctx", "4096", "--threads", str(args.threads), *extra)
               for name, (extra, _) in CONFIGS.items()}
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in CONFIGS}
    try:
        for i, (prefix, suffix) in enumerate(editing_steps(args.steps)):
            for name, server in servers.items():
                results[name].append(infill(server.url, prefix, suffix, args.n_predict, CONFIGS[name][1]))
            print(f"step {i + 1}: " + ", ".join(f"{n} {r[-1][1]:.2f}s" for n, r in results.items()), file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()

    base = "no reuse, no spec"
    med = {n: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for n, rs in results.items()}
    print(f"\n{len(results[base])} /infill requests per configuration, n_predict {args.n_predict}, medians\n")
    print("| configuration | time to first token | ÷ baseline | total per request | ÷ baseline |")
    print("|---|---:|---:|---:|---:|")
    for n, (ttft, total) in med.items():
        print(f"| {n} | {ttft * 1000:.0f} ms | {ttft / med[base][0]:.2f} | {total * 1000:.0f} ms | "
              f"{total / med[base][1]:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
