"""The draft's cost per token in onnxruntime against llama.cpp's GGUF draft, side by side in one run.

Exports the GGUF draft at each precision (cached in --export-dir), loads the target (llama.cpp, --ngl
layers on the GPU), and times, round-robin so a slow spell of the machine falls on every draft alike:
the target's t(B) for the calibration batch sizes, the llama.cpp draft per token (--ngld layers on the
GPU) and each ONNX export per token on each --devices execution provider. Each draft decodes after a
64-token context, one token a pass, as it drafts. Then, per draft, the speed auto's cycle would reach
at the acceptance measured with the real models (docs/bench/draft-traces.json: 0.71 Spec-Bench T=0.7,
0.76 greedy, 0.98 code edits), predicted from these measured costs (placement.predicted_rate): a
prediction, labelled so, for machines where only random-weight models can run.

    python scripts/bench_onnx_draft.py                      # this machine, real models, CPU
    python scripts/bench_onnx_draft.py --target /tmp/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --draft /tmp/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --ngl 99 --ngld 99 \\
        --onnx cuda:fp16,cuda:int4,cpu:int4                 # a GPU machine, random-weight GGUFs
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine  # noqa: E402

from edgespec.onnx import runtime as ort  # noqa: E402
from edgespec.planning import placement  # noqa: E402
from edgespec.backend import Model  # noqa: E402
from edgespec.devices import devices  # noqa: E402
from edgespec.config import LoadConfig  # noqa: E402
from edgespec.decoding.costs import CALIBRATION_BATCHES, time_batches  # noqa: E402
from edgespec.onnx.export import export  # noqa: E402
from edgespec.onnx.files import export_dir  # noqa: E402

ACCEPT = {"Spec-Bench T=0.7": 0.71, "Spec-Bench greedy": 0.76, "code edits": 0.98}
CONTEXT = 64


def per_token(model, n: int) -> float:
    """Seconds per single-token pass after a CONTEXT-token prompt, over `n` passes."""
    model.trim(0)
    model.decode(list(range(1000, 1000 + CONTEXT)))
    t = time.perf_counter()
    for i in range(n):
        model.decode([2000 + i])
    seconds = (time.perf_counter() - t) / n
    model.trim(0)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target GGUF [default: qwen2.5-coder-1.5b from the catalog]")
    ap.add_argument("--draft", default=None, help="draft GGUF [default: qwen2.5-coder-0.5b from the catalog]")
    ap.add_argument("--onnx", default="cpu:int8,cpu:int4,cpu:fp32",
                    help="ONNX drafts as DEVICE:PRECISION (--draft-device names, export precisions)")
    ap.add_argument("--ngl", type=int, default=0, help="target layers on the GPU")
    ap.add_argument("--ngld", type=int, default=0, help="llama.cpp draft layers on the GPU")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32, help="passes timed per round")
    ap.add_argument("--export-dir", type=Path, default=None, help="[default: beside the draft GGUF]")
    ap.add_argument("--out", type=Path, default=Path("bench-results/onnx-draft.json"))
    args = ap.parse_args()
    if args.target is None or args.draft is None:
        from edgespec.models import resolve

        args.target = args.target or resolve("qwen2.5-coder-1.5b")
        args.draft = args.draft or resolve("qwen2.5-coder-0.5b")
    target_path, draft_path = Path(args.target), Path(args.draft)
    exports = {}
    pairs = [tuple(item.split(":")) for item in args.onnx.split(",")]
    for p in dict.fromkeys(p for _, p in pairs):
        out = (args.export_dir / f"{draft_path.stem}.onnx-{p}") if args.export_dir else export_dir(draft_path, p)
        t = time.perf_counter()
        if not (out / "edgespec-onnx.json").exists():
            export(draft_path, out, p)
            print(f"exported {p} in {time.perf_counter() - t:.1f} s: {out}", flush=True)
        exports[p] = out
    load = LoadConfig(n_ctx=1024, n_threads=args.threads)
    target = Model(target_path, LoadConfig(n_ctx=1024, n_threads=args.threads, n_gpu_layers=args.ngl))
    drafts = {f"llama.cpp GGUF ({args.ngld} layers on GPU)": Model(draft_path, LoadConfig(
        n_ctx=1024, n_threads=args.threads, n_gpu_layers=args.ngld))}
    for dev, p in pairs:
        m = ort.OnnxModel(exports[p], load, dev)
        drafts[f"onnxruntime {p} on {m.device}"] = m
    t_curve = time_batches(target, CALIBRATION_BATCHES)
    args.machine = machine.record(target, args.threads)
    samples: dict[str, list[float]] = {name: [] for name in drafts}
    for _ in range(args.rounds):  # round-robin: each round times every draft once
        for name, m in drafts.items():
            samples[name].append(per_token(m, args.tokens))
    report(args, target_path, draft_path, t_curve, {n: statistics.median(s) for n, s in samples.items()})


def report(args, target_path: Path, draft_path: Path, t_curve, cost: dict[str, float]) -> None:
    t1 = t_curve[0]
    gpus = [f"{d.name} {d.description}" for d in devices() if d.kind != "cpu"]
    where = f"{machine.line(args.machine)}; GPU: {', '.join(gpus) or 'none'}"
    print(f"{where}\ntarget {target_path.name} ({args.ngl} layers on GPU): t(1) = {t1 * 1e3:.2f} ms, "
          f"t(B)/t(1) = {[round(t / t1, 2) for t in t_curve]} for B = {list(CALIBRATION_BATCHES)}")
    heads = list(ACCEPT)
    print(f"{'draft':<44}{'ms/token':>9}{'÷ target':>9}  " + "  ".join(f"{h:>18}" for h in heads))
    rows = []
    for name, d in cost.items():
        preds = [placement.predicted_rate(placement.layout_costs(t_curve, (d,)), 63, a) for a in ACCEPT.values()]
        cells = [f"{r * t1:.2f}x (K={k})" for r, k in preds]
        print(f"{name:<44}{d * 1e3:>9.2f}{d / t1:>9.2f}  " + "  ".join(f"{c:>18}" for c in cells))
        rows.append({"draft": name, "seconds_per_token": d, "predicted_speedup": {
            h: {"ratio": r * t1, "k": k} for h, (r, k) in zip(heads, preds)}})
    print("predicted speedup: auto's best cycle at that acceptance under the measured costs (not a decode run)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": args.machine | {"gpus": gpus}, "platform": platform.platform(),
                                    "target": target_path.name,
                                    "draft": draft_path.name, "ngl": args.ngl, "ngld": args.ngld,
                                    "target_seconds": t_curve, "drafts": rows}, indent=1))


if __name__ == "__main__":
    main()
