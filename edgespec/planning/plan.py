"""The plan for a target (and a draft) on this machine: what fits where, priced from this machine's calibrations.

The pure planning is in planning.budget; this module reads the models' GGUF facts, the devices llama.cpp found and
the calibrations cached on this machine, and hands them to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from edgespec.backend import Model
from edgespec.devices import devices
from edgespec.gguf import ModelFacts
from edgespec.config import DEFAULT_N_CTX, EngineConfig, LoadConfig
from edgespec.decoding import costs
from edgespec.errors import EdgespecError, InvalidRequestError, OutOfMemoryError
from edgespec.models import ProgressCallback, resolve
from edgespec.onnx import runtime as ort
from edgespec.onnx.files import OnnxDraftFiles, is_onnx, locate
from edgespec.paths import calibration_dir
from edgespec.planning import budget
from edgespec.planning.budget import ModelMemory, Plan
from edgespec.planning.remote import Link, Spread, spreads
from edgespec.remote import probe


def open_facts(path: str | Path) -> Model:
    """A GGUF's facts and vocabulary without a context: weights mapped and not repacked, so this is quick."""
    return Model(path, LoadConfig(n_ctx=256, n_threads=1, n_gpu_layers=0), facts_only=True)


def read_facts(path: str | Path) -> ModelFacts:
    with open_facts(path) as m:
        return m.facts


def memory_of(f: ModelFacts) -> ModelMemory:
    return ModelMemory(f.path.name, f.weights_bytes, f.n_layer, f.n_head_kv, f.head_dim_k, f.head_dim_v, f.n_vocab,
                       f.n_embd, f.n_ff, f.n_ctx_train)


def plan_memory(target: Path, draft: Path | None, load: LoadConfig, k_max: int,
                memory_budget: int | None = None, draft_gpu_layers: int | None = None,
                keep_draft: bool = False, draft_device: str = "auto", local_share: float = 1.0) -> Plan:
    """How `target` (and `draft`) are laid out in the memory this machine has, or `memory_budget` bytes of it.

    Layouts are priced from calibrations cached on this machine where there are some, else modelled;
    `load.n_gpu_layers` (>= 0) and `draft_gpu_layers` fix the layers instead of letting the plan choose.
    An ONNX draft sits where its execution provider runs (`draft_device`) and is kept for calibration to
    price: there is no modelled curve for onnxruntime. `local_share`: the part of the target's weights this
    machine holds when RPC workers hold the rest (plan_remote).
    """
    facts = read_facts(target)
    found = devices()
    b = budget.detect_budget(found, memory_budget)
    onnx_note, draft_key = None, None
    onnx = draft is not None and is_onnx(draft)
    if onnx and draft_gpu_layers is not None:
        raise InvalidRequestError(f"--draft-gpu-layers {draft_gpu_layers} places a GGUF draft's layers; {draft} is "
                                  f"an ONNX draft: place it with --draft-device instead")
    if draft is not None and not onnx and draft_device != "auto":
        raise InvalidRequestError(f"--draft-device {draft_device} picks an ONNX draft's execution provider; "
                                  f"{draft} runs in llama.cpp: place it with --draft-gpu-layers instead")
    if onnx:
        assert draft is not None
        files = locate(draft)
        where = ort.planned_device(draft_device)
        draft_mem = onnx_memory(files)
        draft_gpu_layers = draft_mem.units if where in ort.GPU_DEVICES and b.gpu_bytes else 0
        keep_draft = True
        counted = "GPU memory" if draft_gpu_layers else "RAM"
        onnx_note = (f"draft {files.name} runs in onnxruntime on {where}; its memory is counted in {counted}; "
                     f"calibration at load prices it")
        draft_key = f"onnxruntime-{where}"  # as OnnxModel.device_key: its calibration is kept per provider
    else:
        draft_mem = memory_of(read_facts(draft)) if draft is not None else None
    paths = {"target": target, "draft": draft}

    def measured(which: str, layers: int) -> tuple[float, ...] | None:
        path = paths[which]
        if path is None:
            return None
        if which == "draft" and draft_key is not None:
            return costs.measured(calibration_dir(), path, 0, load, draft_key)
        return costs.measured(calibration_dir(), path, layers, load, b.gpu_name or "cpu")

    target_mem = memory_of(facts)
    target_mem = replace(target_mem, weights_bytes=int(target_mem.weights_bytes * local_share))
    p = budget.plan(target_mem, draft_mem, b,
                    n_ctx=load.n_ctx, k_max=k_max, n_ubatch=load.n_batch, n_seq=load.n_seq, aside=load.aside,
                    target_gpu_layers=load.n_gpu_layers if load.n_gpu_layers >= 0 else None,
                    draft_gpu_layers=draft_gpu_layers, measured=measured, keep_draft=keep_draft)
    if onnx_note is not None:
        p.notes.append(onnx_note)
    if (idle := budget.idle_gpu_note(found)) is not None:
        p.notes.insert(0, idle)
    return p


def onnx_memory(files: OnnxDraftFiles) -> ModelMemory:
    h = files.hyper
    return ModelMemory(files.name, files.weights_bytes, h["n_layer"], h["n_head_kv"], h["head_dim"], h["head_dim"],
                       h["n_vocab"], h["n_embd"], h["n_ff"], h["n_ctx_train"])


def gpu_short_error(plan: Plan, path: Path, n_gpu_layers: int, e: EdgespecError) -> OutOfMemoryError | None:
    """Why a model the plan put on the GPU did not load, when the GPU has lost the room since: the numbers."""
    b = plan.budget
    if not (n_gpu_layers and b.gpu_bytes):
        return None
    now = budget.detect_budget(devices()).gpu_bytes
    planned = plan.chosen.gpu_bytes if plan.chosen else 0
    return OutOfMemoryError(
        f"{path.name} did not load with {n_gpu_layers} layers on {b.gpu_name or b.device} ({e}): the "
        f"plan counted on {planned / budget.GiB:.2f} GiB of its memory, {b.gpu_bytes / budget.GiB:.2f} GiB "
        f"was free then and {now / budget.GiB:.2f} GiB is free now; close what took it, or pass "
        f"--gpu-layers N with fewer layers (or --memory-budget)")


def plan_remote(target: Path, endpoints: tuple[str, ...], fixed: tuple[int, ...] | None, load: LoadConfig,
                memory_budget: int | None = None) -> tuple[list[Link], list[Spread]]:
    """The RPC workers, asked first (one clear error for one that does not answer), and every way to spread the
    target over this machine and them that fits, fastest first (planning.remote)."""
    links = [Link(w.endpoint, w.free_bytes, w.rtt_seconds) for w in probe.probe_all(endpoints)]
    mem = memory_of(read_facts(target))
    b = budget.detect_budget(devices(), memory_budget)
    n_ctx = load.n_ctx or min(mem.n_ctx_train, DEFAULT_N_CTX)
    reserve = mem.kv_bytes_per_token() * n_ctx * load.n_seq + mem.compute_bytes(load.n_batch)
    local_free = max(0, int(b.ram_bytes * budget.HEADROOM) - reserve)
    return links, spreads(mem.units, mem.weights_bytes / mem.units, local_free, links, mem.n_embd, mem.n_vocab,
                          fixed)


@dataclass(frozen=True)
class Settled:
    """What an engine loads and where, once the models are found and the memory planned."""

    target: Path
    draft: Path | None  # the draft to load: None without one, or when the plan leaves it out
    dropped: Path | None  # a draft that was named but that the plan leaves out
    plan: Plan
    notes: list[str]  # what a person should hear of it
    load: LoadConfig  # the target's, with the plan's context and layers
    draft_layers: int
    remote: Spread | None = None  # the target's layers on RPC workers, when they run there


def settle(cfg: EngineConfig, progress: ProgressCallback | None = None) -> Settled:
    """Fetch or find both models of `cfg`, plan their memory, and settle what loads where."""
    notes, draft = [], cfg.draft
    if draft is not None and cfg.proposer in ("none", "ngram"):
        notes.append(f"draft {draft} is not used with proposer {cfg.proposer!r}")
        draft = None
    target_path = resolve(cfg.model, source=cfg.source, progress=progress)
    draft_path = None if draft is None else Path(draft) if is_onnx(draft) else resolve(
        draft, source=cfg.source, progress=progress)
    dropped, remote, share = None, None, 1.0
    if cfg.rpc:
        remote, note = _remote_choice(target_path, cfg)
        notes.append(note)
        share = remote.local_units / (remote.local_units + sum(remote.worker_units)) if remote else 1.0
    plan = plan_memory(target_path, draft_path, cfg.load, cfg.k_max, cfg.memory_budget, cfg.draft_gpu_layers,
                       keep_draft=cfg.proposer == "draft", draft_device=cfg.draft_device, local_share=share)
    notes += plan.notes
    if draft_path is not None and not plan.load_draft:
        if cfg.proposer == "draft":
            raise OutOfMemoryError(f"{plan.notes[-1]}; use --proposer auto or ngram, or a larger --memory-budget")
        dropped, draft_path = draft_path, None
    if plan.budget.gpu_bytes:
        notes.append(f"layout on {plan.budget.gpu_name or plan.budget.device}: {plan.chosen.description} "
                     f"({plan.reason})")
    load = replace(cfg.load, n_ctx=plan.n_ctx, n_gpu_layers=plan.target_gpu_layers)
    return Settled(target_path, draft_path, dropped, plan, notes, load, plan.draft_gpu_layers, remote)


def _remote_choice(target: Path, cfg: EngineConfig) -> tuple[Spread | None, str]:
    """The fastest spread over this machine and the RPC workers, and what a person should hear of it."""
    links, options = plan_remote(target, cfg.rpc, cfg.rpc_layers, cfg.load, cfg.memory_budget)
    best = options[0]
    workers = ", ".join(f"{link.endpoint} ({link.free_bytes / 2**30:.1f} GiB free, {link.rtt_seconds * 1e3:.2f} ms)"
                        for link in links)
    if not best.remote:
        return None, (f"RPC workers {workers} not used: the target runs faster on this machine alone "
                      f"(predicted {best.tokens_per_second:.1f} tok/s); --rpc-layers N,... spreads it anyway")
    layers = ", ".join(f"{n} on {link.endpoint}" for n, link in zip(best.worker_units, links))
    return best, (f"target spread {best.description}: {best.local_units} layers here, {layers} (workers {workers}; "
                  f"predicted {best.tokens_per_second:.1f} tok/s before speculation)")
