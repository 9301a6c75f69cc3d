"""The parts of scripts/gpu_proof.py that load llama.cpp or onnxruntime, each run in a process of its own.

gpu_proof.py starts one of these subcommands per check or measurement, from a folder outside any source
tree, with `python -X faulthandler`, a time limit and stderr kept, so a crash (SIGSEGV in a native
library) ends that process and is recorded, not the kit. Each writes its answer as JSON to --result.

    imports   which llama_cpp was imported and which libllama.so was mapped; devices; ctypes layouts
    load      llama_model_load_from_file with chosen parameters, then a context and one decode
    timing    t(B) of one model in one layout (edgespec.decoding.costs.time_batches)
    lockstep  plain decoding, auto, draft:K and ngram in lockstep (bench_spec.lockstep_streams)
    replay    recorded draft acceptance priced under the measured curve (simulate_devices)
    onnx      the ONNX export of the draft on each onnxruntime provider, next to the target
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Lockstep modes: (name, K); K 0 is the engine's own choice. The draft is the target itself (100% acceptance).
MODES = (("none", 0), ("auto", 0), ("draft", 2), ("draft", 4), ("draft", 8), ("ngram", 0))
REPLAY_HOWS = ("plain", "k2", "k4", "k8", "auto")
LAYER_ALL = 999  # llama.cpp's n_gpu_layers for "every layer"


STARTED = time.monotonic()


def stage(text: str) -> None:
    """A progress mark on stderr, so the tail of a crashed check says how far it got (and when)."""
    print(f"[stage {time.monotonic() - STARTED:7.2f} s] {text}", file=sys.stderr, flush=True)


# -- crash checks -------------------------------------------------------------------------------------


def mapped_libraries() -> list[str]:
    """Paths of the llama.cpp libraries this process has mapped (/proc/self/maps)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {ln.split(None, 5)[5] for ln in lines if len(ln.split(None, 5)) == 6}
    return sorted(p for p in paths if any(k in Path(p).name for k in ("libllama", "libggml", "libcuda", "libcublas")))


def struct_layout(cls) -> dict:
    """sizeof and each field's offset and size of a ctypes Structure, as the binding declares it."""
    return {"sizeof": ctypes.sizeof(cls),
            "fields": {name: {"offset": getattr(cls, name).offset, "size": getattr(cls, name).size}
                       for name, *_ in cls._fields_}}


def unresolved(lib_dir: Path) -> dict[str, list[str]]:
    """Per library in `lib_dir`, what `ldd` cannot find (a CUDA runtime missing from the loader's path)."""
    out = {}
    for lib in sorted(lib_dir.glob("lib*.so")):
        try:
            text = subprocess.run(["ldd", str(lib)], check=False, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        missing = [ln.split("=>")[0].strip() for ln in text.splitlines() if "not found" in ln]
        if missing:
            out[lib.name] = missing
    return out


def cmd_imports(args: argparse.Namespace) -> dict:
    stage("import llama_cpp")
    import llama_cpp

    result = {"cwd": os.getcwd(), "llama_cpp_file": llama_cpp.__file__, "version": llama_cpp.__version__,
              "lib_override": os.environ.get("LLAMA_CPP_LIB_PATH"), "sys_path": sys.path[:6]}
    stage("llama_backend_init")
    llama_cpp.llama_backend_init()
    result["mapped"] = mapped_libraries()
    result["system_info"] = llama_cpp.llama_print_system_info().decode(errors="replace")
    result["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    result["unresolved"] = unresolved(Path(llama_cpp.__file__).parent / "lib")
    result["layouts"] = {name: struct_layout(getattr(llama_cpp, name))
                         for name in ("llama_model_params", "llama_context_params")}
    stage("devices")
    from edgespec.devices import devices

    result["devices"] = [vars(d) for d in devices()]
    return result


def cmd_load(args: argparse.Namespace) -> dict:
    if args.edgespec:
        return _load_edgespec(args)
    stage("import llama_cpp")
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = args.ngl
    if args.no_mmap:
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    if args.no_repack:
        params.use_extra_bufts = False
    t = time.perf_counter()
    stage(f"llama_model_load_from_file {args.gguf} (n_gpu_layers {args.ngl}, load_mode {params.load_mode}, "
          f"use_extra_bufts {params.use_extra_bufts})")
    model = llama_cpp.llama_model_load_from_file(str(args.gguf).encode(), params)
    if not model:
        return {"loaded": False, "why": "llama_model_load_from_file returned NULL"}
    result = {"loaded": True, "load_seconds": time.perf_counter() - t, "mapped": mapped_libraries()}
    stage("llama_init_from_model")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 256, 64, 64
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    result["context"] = bool(ctx)
    if ctx:
        stage("llama_decode of one token")
        batch = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(0), 1)
        result["decode_rc"] = int(llama_cpp.llama_decode(ctx, batch))
        llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    stage("freed")
    return result


def _load_edgespec(args: argparse.Namespace) -> dict:
    """The load as edgespec makes it: numpy imported before llama_cpp, edgespec's log callback, its parameters. On
    the H200's image this died where llama.cpp's own load did not (docs/gpu-kit.md, the first run)."""
    stage("import numpy, then edgespec.backend")
    import numpy  # noqa: F401

    from edgespec.backend import Model
    from edgespec.config import LoadConfig

    t = time.perf_counter()
    stage(f"edgespec Model {args.gguf} ({args.ngl} layers on the GPU)")
    with Model(args.gguf, LoadConfig(n_ctx=256, n_batch=64, n_gpu_layers=args.ngl, mmap=not args.no_mmap,
                                     repack=not args.no_repack)) as m:
        result = {"loaded": True, "load_seconds": time.perf_counter() - t, "mapped": mapped_libraries()}
        stage("decode of one token")
        result["decode_rc"] = 0 if m.decode([0]).shape[0] == 1 else 1
    stage("freed")
    return result


# -- measurements -----------------------------------------------------------------------------------------


def gpu_layers(path: Path, layout: str) -> int:
    """llama.cpp's n_gpu_layers for a layout: "full", "half" (of the repeating layers) or "cpu"."""
    if layout == "cpu":
        return 0
    if layout == "full":
        return LAYER_ALL
    from edgespec.planning.plan import read_facts

    return read_facts(path).n_layer // 2


def cpu_name() -> str:
    from edgespec.decoding.costs import cpu_model

    return cpu_model().split(" fpu ")[0]  # the name, without the flags that follow it


def device_list() -> list[dict]:
    from edgespec.devices import devices

    return [vars(d) for d in devices()]


def cmd_timing(args: argparse.Namespace) -> dict:
    from machine import vector_extensions

    from edgespec.backend import Model, system_info
    from edgespec.config import LoadConfig
    from edgespec.decoding.costs import time_batches

    batches = tuple(int(b) for b in args.batches.split(","))
    ngl = gpu_layers(args.gguf, args.layout)
    stage(f"load {args.gguf.name}, {ngl} layers on the GPU")
    load = LoadConfig(n_ctx=512, n_batch=max(batches), n_gpu_layers=ngl, mmap=not args.no_mmap, n_threads=args.threads)
    with Model(args.gguf, load) as m:
        stage("time_batches")
        seconds = time_batches(m, batches)
        facts = m.facts
    return {"model": args.gguf.name, "layout": args.layout, "n_gpu_layers": ngl, "n_layer": facts.n_layer,
            "weights_bytes": facts.weights_bytes, "batches": list(batches), "seconds": list(seconds),
            "ratio": [round(s / seconds[0], 3) for s in seconds], "devices": device_list(), "cpu": cpu_name(),
            "cpu_vector": vector_extensions(),
            "threads": args.threads, "system_info": system_info()}


def lockstep_streams(streams: dict) -> dict:
    """bench_spec's harness: every stream one cycle at a time, the one furthest behind next, each timed over its
    own cycles only. {key: (stats, decode seconds, output tokens)}."""
    import bench_spec

    return bench_spec.lockstep_streams(streams)


def prompts(n: int, shortest: bool = False) -> list[tuple[str, str]]:
    """`n` code edits (standard-library sources: present anywhere) and `n` Spec-Bench questions where ../shared
    is; `shortest`: the `n` shortest of all of them instead (a quick run on a small CPU)."""
    import workloads

    edits = workloads.code_edits(len(workloads.EDIT_SOURCES))
    questions = workloads.spec_bench(1) if workloads.SPEC_BENCH.exists() else []
    if shortest:
        return sorted(edits + questions, key=lambda p: len(p[1]))[:n]
    return edits[:n] + questions[:n]


def engines(args: argparse.Namespace) -> dict:
    from edgespec import Engine
    from edgespec.config import EngineConfig, LoadConfig

    ngl = 0 if args.cpu else LAYER_ALL
    load = LoadConfig(n_ctx=2048, n_gpu_layers=ngl, mmap=not args.no_mmap, n_threads=args.threads)
    kinds = {"none": {"proposer": "none"}, "ngram": {"proposer": "ngram"},
             "draft": {"proposer": "draft", "draft": str(args.draft), "draft_gpu_layers": ngl},
             "auto": {"proposer": "auto", "draft": str(args.draft), "draft_gpu_layers": ngl}}
    out = {}
    for name, k in MODES:
        stage(f"engine {name}:{k}")
        out[(name, k)] = Engine(EngineConfig(str(args.target), k=k or None, load=load, memory=False, **kinds[name]))
    return out


def cmd_lockstep(args: argparse.Namespace) -> dict:
    from edgespec import GenerationConfig, SamplingConfig

    by_mode = engines(args)
    plain = by_mode[("none", 0)]
    eos = plain.target.vocab.eos
    # Random weights: forbid the end token, so every mode writes max_tokens and the runs compare.
    config = GenerationConfig(max_tokens=args.max_tokens, memory=None,
                              sampling=SamplingConfig(logit_bias=((eos, float("-inf")),) if eos is not None else ()))
    totals = {key: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "same_as_plain": 0, "first_diff": []}
              for key in by_mode}
    work = prompts(args.prompts, args.cpu)
    for category, text in work:
        tokens = plain.chat_tokens([{"role": "user", "content": text}])
        stage(f"lockstep on a {category} prompt of {len(tokens)} tokens")
        done = lockstep_streams({key: e.stream(tokens, config) for key, e in by_mode.items()})
        base = done[("none", 0)][2]
        for key, (stats, seconds, output) in done.items():
            t = totals[key]
            t["tokens"] += len(output) - 1
            t["seconds"] += seconds
            t["drafted"] += stats.drafted
            t["accepted"] += stats.accepted
            same = output == base
            t["same_as_plain"] += same
            t["first_diff"].append(None if same else next(
                (i for i, (a, b) in enumerate(zip(output, base)) if a != b), min(len(output), len(base))))
    rows = {}
    plain_tps = totals[("none", 0)]["tokens"] / totals[("none", 0)]["seconds"]
    for (name, k), t in totals.items():
        tps = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
        rows[f"{name}:{k}" if k else name] = t | {"tokens_per_second": tps, "ratio_to_plain": tps / plain_tps,
                                                  "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else None}
    notes = sorted({n for e in by_mode.values() for n in e.notes})
    for e in by_mode.values():
        e.close()
    return {"draft": "the target itself (greedy: every proposal the target would make, the upper bound)",
            "prompts": [c for c, _ in work], "max_tokens": args.max_tokens, "layout": "cpu" if args.cpu else "gpu",
            "modes": rows, "notes": notes, "devices": device_list()}


def cmd_replay(args: argparse.Namespace) -> dict:
    import numpy as np
    import simulate_devices
    from replay_auto import dense

    from edgespec.decoding.costs import CALIBRATION_BATCHES

    timing = json.loads(args.timing.read_text())
    target, draft = timing["target"], timing["draft"]
    measured = dict(zip(target["batches"], target["ratio"]))
    # A fixed K verifies K + 1 tokens: priced on every size measured; auto verifies only where calibration measures.
    calibrated = {b: measured[b] for b in CALIBRATION_BATCHES if b in measured}
    ratio = draft["seconds"][0] / target["seconds"][0]
    traces = json.loads(args.traces.read_text())["traces"]
    if args.limit:
        traces = [t for mode in ("greedy", "sampled") for t in [t for t in traces if t["mode"] == mode][:args.limit]]
    ids = dense(traces)
    cost: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(0)
    for mode in ("greedy", "sampled"):
        state: dict = {}
        for trace, (prompt, out) in zip(traces, ids):
            if trace["mode"] != mode:
                continue
            group = cost.setdefault(f"{mode} {simulate_devices._group(trace['category'])}", dict.fromkeys(REPLAY_HOWS,
                                                                                                         0.0))
            for how in REPLAY_HOWS:
                curve = calibrated if how == "auto" else measured
                group[how] += simulate_devices._run(trace, prompt, out, curve, ratio, how, state, rng)
    speedup = {g: {h: round(c["plain"] / c[h], 3) for h in REPLAY_HOWS if h != "plain"} for g, c in cost.items()}
    return {"label": "REPLAYED, not live: recorded acceptance of the real 0.5B draft priced under this machine's "
                     "measured curve", "curve": measured, "draft_over_target": ratio, "traces": len(traces),
            "speedup_over_plain": speedup}


def cmd_onnx(args: argparse.Namespace) -> dict:
    from edgespec.backend import Model
    from edgespec.config import LoadConfig
    from edgespec.decoding.costs import time_batches
    from edgespec.onnx import runtime
    from edgespec.onnx.export import export

    have = runtime.providers()
    result: dict = {"onnxruntime": runtime.version(), "providers": have, "exports": {}, "per_token_ms": {}}
    for precision in args.precisions.split(","):
        out = args.export_dir / precision
        if not (out / "edgespec-onnx.json").exists():
            stage(f"export {args.draft.name} at {precision}")
            t = time.perf_counter()
            export(args.draft, out, precision)
            result["exports"][precision] = {"seconds": time.perf_counter() - t}
    ngl = 0 if args.cpu else LAYER_ALL
    stage("load the target")
    with Model(args.target, LoadConfig(n_ctx=512, n_gpu_layers=ngl, mmap=not args.no_mmap,
                                       n_threads=args.threads)) as target:
        result["target_t1_ms"] = 1e3 * time_batches(target, (1,))[0]
        for precision in args.precisions.split(","):
            for device in [d for d in ("cuda", "cpu") if d in have]:
                stage(f"time the {precision} draft on {device}")
                try:
                    draft = runtime.OnnxModel(args.export_dir / precision, LoadConfig(n_ctx=512,
                                                                                       n_threads=args.threads), device)
                except Exception as e:  # noqa: BLE001 - a provider that does not start is an answer here
                    result["per_token_ms"][f"{precision} {device}"] = f"did not start: {e}"
                    continue
                with draft:
                    result["per_token_ms"][f"{precision} {draft.device}"] = 1e3 * time_batches(draft, (1,))[0]
        if "cuda" not in have:
            result["cuda"] = (f"onnxruntime {result['onnxruntime']} has no CUDAExecutionProvider (providers: "
                              f"{', '.join(have) or 'none'}): carry onnxruntime-gpu (gpu_kit.py pack --onnxruntime)")
    started = [key.split() for key, ms in result["per_token_ms"].items() if isinstance(ms, float)]
    live = next((k for k in started if k[1] == "cuda"), started[0] if started else None)
    result["live"] = onnx_live(args, args.export_dir / live[0], live[1]) if live else "no provider started"
    return result


def onnx_live(args: argparse.Namespace, export_dir: Path, device: str) -> dict:
    """draft:4 with the ONNX draft on `device` against plain decoding, in lockstep: speed, and equal output."""
    from edgespec import Engine, GenerationConfig, SamplingConfig
    from edgespec.config import EngineConfig, LoadConfig

    load = LoadConfig(n_ctx=1024, n_gpu_layers=0 if args.cpu else LAYER_ALL, mmap=not args.no_mmap,
                      n_threads=args.threads)
    plain = Engine(EngineConfig(str(args.target), proposer="none", load=load, memory=False))
    spec = Engine(EngineConfig(str(args.target), draft=str(export_dir), proposer="draft", k=4, load=load,
                               draft_device=device, memory=False))
    eos = plain.target.vocab.eos
    config = GenerationConfig(max_tokens=args.max_tokens, memory=None,
                              sampling=SamplingConfig(logit_bias=((eos, float("-inf")),) if eos is not None else ()))
    category, text = prompts(1, shortest=True)[0]
    tokens = plain.chat_tokens([{"role": "user", "content": text}])
    stage(f"ONNX draft on {device}: lockstep on a {category} prompt")
    done = lockstep_streams({"plain": plain.stream(tokens, config),
                                               "draft:4": spec.stream(tokens, config)})
    (_, s_plain, out_plain), (stats, s_spec, out_spec) = done["plain"], done["draft:4"]
    for e in (plain, spec):
        e.close()
    return {"device": device, "export": export_dir.name, "tokens": len(out_spec) - 1,
            "plain_tokens_per_second": (len(out_plain) - 1) / s_plain,
            "draft4_tokens_per_second": (len(out_spec) - 1) / s_spec, "drafted": stats.drafted,
            "accepted": stats.accepted, "same_output_as_plain": out_plain == out_spec}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--result", type=Path, required=True, help="where the answer is written (JSON)")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("imports")
    p = sub.add_parser("load")
    p.add_argument("gguf", type=Path)
    p.add_argument("--ngl", type=int, default=0)
    p.add_argument("--no-mmap", action="store_true")
    p.add_argument("--no-repack", action="store_true")
    p.add_argument("--edgespec", action="store_true", help="load through edgespec.backend, numpy imported first")
    p = sub.add_parser("timing")
    p.add_argument("gguf", type=Path)
    p.add_argument("--layout", choices=("full", "half", "cpu"), required=True)
    p.add_argument("--batches", required=True)
    p.add_argument("--no-mmap", action="store_true")
    p.add_argument("--threads", type=int, required=True)
    for name in ("lockstep", "onnx"):
        p = sub.add_parser(name)
        p.add_argument("--target", type=Path, required=True)
        p.add_argument("--draft", type=Path, required=True)
        p.add_argument("--cpu", action="store_true")
        p.add_argument("--no-mmap", action="store_true")
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--prompts", type=int, default=2)
        p.add_argument("--precisions", default="fp16")
        p.add_argument("--export-dir", type=Path)
        p.add_argument("--threads", type=int, required=True)
    p = sub.add_parser("replay")
    p.add_argument("timing", type=Path)
    p.add_argument("--traces", type=Path, default=ROOT / "docs" / "bench" / "draft-traces.json")
    p.add_argument("--limit", type=int, default=0, help="traces per mode (0: all)")
    args = ap.parse_args(argv)
    answer = globals()[f"cmd_{args.command}"](args)
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(answer, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
