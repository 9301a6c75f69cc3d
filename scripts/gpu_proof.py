"""The GPU proof: from a bare GPU machine with no network to one JSON of results, resumable across short calls.

    python scripts/gpu_proof.py --kit .cache/gpu-kit --out .cache/gpu-proof          # a GPU machine (CUDA)
    python scripts/gpu_proof.py --cpu --installed --kit KIT --out OUT                # any machine, small models
    python scripts/gpu_proof.py curves .cache/gpu-proof/results.json                 # merge measured curves

The kit is what scripts/gpu_kit.py packed (docs/gpu-kit.md). Steps, in order, each written to
OUT/steps/NAME.json as it ends, and all of them to OUT/results.json:

  kit       parts present and checked against the manifest's sha256, reassembled; missing ones named
  wheels    the carried wheels installed into OUT/work/site (first on PYTHONPATH for every step after)
  llama     llama-cpp-python built from the sdist (CUDA unless --cpu) in a build folder that survives a
            stopped call, and installed into the site folder; --installed uses the one already installed
  ggufs     random-weight GGUFs with the target's and the draft's exact layouts (scripts/random_gguf.py fill)
  crash     the checks for the load crash, cheapest first, each in a process of its own; crash.json's verdict
  timing    t(B) per model: every layer on the GPU, half of them, none (--cpu: none only, B up to 16)
  lockstep  plain, auto, draft:2/4/8 and ngram in lockstep, the target as its own draft (the upper bound)
  replay    the real draft's recorded acceptance priced under the measured curve (REPLAYED, not live)
  onnx      the draft exported to ONNX and timed on each onnxruntime provider next to the target
  curves    the measured curve, by device name, ready for edgespec/planning/measured_curves.json

A step whose result exists is not run again, so a second call continues where the first stopped (at
--deadline, ahead of the device tool's 10 minutes). Everything that loads llama.cpp runs in a subprocess
with a time limit, so a crash is a recorded answer (return code, signal, faulthandler's traceback, the
tail of stderr), never the end of the kit. Exit status: 0 every step has its answer, 2 waiting for
parts of the kit, 3 stopped at the deadline (call again).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gpu_kit

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).with_name("gpu_workers.py")
RANDOM_GGUF = Path(__file__).with_name("random_gguf.py")
BATCHES = {"gpu": (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64), "cpu": (1, 2, 3, 4, 6, 8, 12, 16)}
LAYOUTS = {"gpu": ("full", "half", "cpu"), "cpu": ("cpu",)}
# Per mode: (lockstep tokens, lockstep prompts, replayed traces per mode (0: all), ONNX precisions, ONNX tokens)
SIZES = {"gpu": (128, 3, 0, "fp16,int4", 64), "cpu": (16, 1, 2, "fp32", 12)}
CHECK_SECONDS = 180  # one crash check; a hang past this is an answer too ("hung")
BUILD_SECONDS = 3600
STEP_SECONDS = 600
TAIL_LINES = 40
PRELOAD = "libstdc++.so.6"  # the C++ runtime, for builds whose libraries carry copies of their own
DEADLINE = 540  # seconds a call may spend: the device tool stops a command at 600


class Waiting(Exception):
    """A step's inputs are not there yet (parts of the kit, an earlier step): it runs on a later call."""


class Stopped(Exception):
    """The call's deadline came during a step: it continues on the next call."""


@dataclass
class Run:
    kit: Path
    out: Path
    cpu: bool
    installed: bool
    end: float
    jobs: int
    threads: int
    check_scripts: list[Path] = field(default_factory=list)
    build_tools: bool = True
    cmake_args: list[str] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return "cpu" if self.cpu else "gpu"

    @property
    def work(self) -> Path:
        return self.out / "work"

    @property
    def site(self) -> Path:
        return self.work / "site"

    @property
    def neutral(self) -> Path:
        """The working folder of every child: outside any source tree, so no ./llama_cpp shadows the install."""
        path = self.work / "neutral"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(self.site), str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1",
                   EDGESPEC_CACHE=str(self.work / "cache" / "models"), EDGESPEC_MEMORY_DIR=str(self.work / "memory"))
        if self.preload and not env.get("LD_PRELOAD"):
            env["LD_PRELOAD"] = PRELOAD
        return env

    @property
    def preload(self) -> bool:
        """Whether the crash checks found that edgespec's load dies unless the C++ runtime is preloaded."""
        checks = (self.done("crash") or {}).get("checks", {})
        return (checks.get("load-edgespec", {}).get("status") == "crashed"
                and checks.get("load-edgespec-preload", {}).get("status") == "ok")

    def result_path(self, name: str) -> Path:
        return self.out / "steps" / f"{name}.json"

    def done(self, name: str) -> dict | None:
        path = self.result_path(name)
        return json.loads(path.read_text()) if path.is_file() else None

    def save(self, name: str, result: dict) -> dict:
        path = self.result_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
        tmp.replace(path)
        return result

    def file(self, role: str) -> Path:
        """The reassembled kit file of `role`; Waiting while any of its parts is missing or damaged."""
        kit = self.done("kit") or {}
        entry = next((f for f in kit.get("files", {}).values() if f["role"] == role), None)
        if entry is None:
            raise Waiting(f"the kit has no {role} (scripts/gpu_kit.py pack puts one in)")
        if entry["state"] != "complete":
            raise Waiting(f"{role} incomplete: {entry['state']}")
        return Path(entry["path"])


# -- isolation ----------------------------------------------------------------------------------------------


def isolated(run: Run, name: str, cmd: list[str], limit: float, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> dict:
    """Run `cmd` in its own process group, output to a log; whatever it does, return how it ended.

    Raises Stopped when the call's deadline, not `limit`, cut it short."""
    log = run.work / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    timeout = max(1.0, min(limit, run.remaining()))
    t = time.monotonic()
    with open(log, "wb") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=cwd or run.neutral, env=run.env() | (env or {}), start_new_session=True)
        try:
            rc, timed_out = child.wait(timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the group: a build's compilers, a tool's threads
            rc, timed_out = child.wait(), True
    if timed_out and timeout < limit:
        raise Stopped(f"{name} stopped at the call's deadline after {time.monotonic() - t:.0f} s")
    lines = log.read_text(errors="replace").splitlines()
    fatal = next((i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")), None)
    return {"command": cmd, "rc": rc, "signal": signal.Signals(-rc).name if rc < 0 else None,
            "timed_out": timed_out, "seconds": round(time.monotonic() - t, 2), "log": str(log),
            "tail": lines[-TAIL_LINES:], "faulthandler": lines[fatal:fatal + 60] if fatal is not None else None}


def status_of(ended: dict) -> str:
    if ended["signal"]:
        return "crashed"
    if ended["timed_out"]:
        return "hung"
    return "ok" if ended["rc"] == 0 else "failed"


def worker(run: Run, name: str, args: list[str], limit: float = STEP_SECONDS, env: dict[str, str] | None = None
           ) -> dict:
    """One gpu_workers.py subcommand under faulthandler: how it ended, and its answer when it wrote one."""
    answer = run.work / "answers" / f"{name}.json"
    answer.unlink(missing_ok=True)
    ended = isolated(run, name, [sys.executable, "-X", "faulthandler", str(WORKERS), "--result", str(answer), *args],
                     limit, env=env)
    ended["status"] = status_of(ended)
    if answer.is_file():
        ended["answer"] = json.loads(answer.read_text())
    return ended


# -- steps: the kit, the installs, the models ---------------------------------------------------------------


def step_kit(run: Run) -> dict:
    try:
        manifest = gpu_kit.read_manifest(run.kit)
    except FileNotFoundError as e:
        raise Waiting(str(e)) from None
    files = {}
    for entry in manifest["files"]:
        problems = gpu_kit.check_file(run.kit, entry)
        state, path = "; ".join(problems) or "complete", None
        if not problems:
            path = str(gpu_kit.assemble(run.kit, entry, run.work / "kit"))
        files[entry["name"]] = {"role": entry["role"], "size": entry["size"], "state": state, "path": path}
    missing = [f"{name}: {f['state']}" for name, f in files.items() if f["state"] != "complete"]
    result = {"status": "incomplete" if missing else "ok", "kit": manifest["kit"], "created": manifest["created"],
              "files": files, "sdist": next(({k: v for k, v in f.items() if k != "parts"} for f in manifest["files"]
                                             if f["role"] == "sdist"), None)}
    run.save("kit", result)  # also when incomplete: the steps whose files are here can go on
    if missing:
        raise Waiting("parts missing or damaged; carry the call folders named and run again:\n  "
                      + "\n  ".join(missing))
    return result


def step_wheels(run: Run) -> dict:
    entries = [f for f in (run.done("kit") or {"files": {}})["files"].values() if f["role"] == "wheel"]
    if any(f["state"] != "complete" for f in entries):
        raise Waiting("wheels incomplete: " + "; ".join(f["state"] for f in entries if f["state"] != "complete"))
    wheels = [Path(f["path"]) for f in entries]
    if not wheels:
        return {"status": "skipped", "reason": "the kit carries no wheels (packed with --no-wheels)"}
    ended = isolated(run, "wheels", [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                                     "--upgrade", "--target", str(run.site), *map(str, wheels)], STEP_SECONDS)
    return ended | {"status": status_of(ended), "wheels": [w.name for w in wheels], "site": str(run.site)}


def cuda_architecture() -> str:
    """The GPU's compute capability as CMake wants it ("90" for an H100), else CMake's "native"."""
    try:
        cap = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], check=False,
                             capture_output=True, text=True, timeout=30).stdout.split()[0]
        return cap.replace(".", "")
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "native"


def source_tree(run: Run) -> Path:
    """The sdist unpacked at a path that stays put, so a stopped build continues in the same build folder."""
    sdist = run.file("sdist")
    dest = run.work / "src"
    marker = dest / f".{sdist.name}.unpacked"
    if not marker.exists():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with tarfile.open(sdist) as t:
            t.extractall(dest, filter="data")
        marker.touch()
    return next(p for p in dest.iterdir() if p.is_dir())


def installed_llama(run: Run) -> dict:
    code = "import importlib.metadata as m, importlib.util as u; print(m.version('llama-cpp-python')); " \
           "print(u.find_spec('llama_cpp').origin)"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=run.env(),
                         cwd=run.neutral).stdout.split()
    return {"version": out[0], "location": out[1]} if len(out) == 2 else {"version": None, "location": None}


def step_llama(run: Run) -> dict:
    if run.installed:
        return {"status": "skipped", "reason": "--installed: the llama-cpp-python installed for this Python is used, "
                                               "not built from the kit's sdist"} | installed_llama(run)
    src = source_tree(run)
    cmake_args = ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", *run.cmake_args]  # no multimodal projector
    if not run.cpu:
        cmake_args = ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_architecture()}", *cmake_args]
    # Without network the build backend must be installed already (the GPU image has scikit-build-core).
    no_isolation = ["--no-build-isolation", "--no-index"] if importable("scikit_build_core") else []
    wheels = run.work / "wheels"
    build = isolated(run, "llama-build", [sys.executable, "-m", "pip", "wheel", "--no-deps", *no_isolation,
                                          "-w", str(wheels), "-C", f"build-dir={run.work / 'build' / 'llama'}",
                                          str(src)], BUILD_SECONDS,
                     env={"CMAKE_ARGS": " ".join(cmake_args), "CMAKE_BUILD_PARALLEL_LEVEL": str(run.jobs)})
    result = {"status": status_of(build), "cmake_args": cmake_args, "build": build, "source": str(src),
              "build_isolation": not no_isolation}
    if result["status"] != "ok":
        return result
    wheel = max(wheels.glob("llama_cpp_python-*.whl"), key=lambda p: p.stat().st_mtime)
    install = isolated(run, "llama-install", [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                                              "--no-compile", "--upgrade", "--target", str(run.site), str(wheel)],
                       STEP_SECONDS)
    stale = src / "llama_cpp" / "lib"  # llama-cpp-python's CMake also installs into its source tree
    return result | {"status": status_of(install), "install": install, "wheel": wheel.name,
                     "wheel_bytes": wheel.stat().st_size, "source_tree_lib": sorted(p.name for p in stale.glob("*"))
                     if stale.is_dir() else []} | installed_llama(run)


def importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def step_ggufs(run: Run) -> dict:
    out: dict = {"status": "ok", "seed": 0}
    skeletons = {role: run.file(f"{role}-skeleton") for role in ("target", "draft")}
    for role in ("target", "draft"):
        run.file(f"{role}-sidecar")  # beside its skeleton, where fill reads it
        side = json.loads(Path(f"{skeletons[role]}.json").read_text())
        if role == "draft" and gpu_kit.sha256(skeletons["draft"]) == gpu_kit.sha256(skeletons["target"]):
            out["draft"] = out["target"] | {"same_file_as_target": True}
            continue
        path = run.work / "models" / f"{role}.gguf"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (path.is_file() and path.stat().st_size == side["file_size"]):
            ended = isolated(run, f"fill-{role}", [sys.executable, str(RANDOM_GGUF), "fill", str(skeletons[role]),
                                                   str(path), "--seed", "0"], STEP_SECONDS)
            if status_of(ended) != "ok":
                return {"status": status_of(ended), "role": role, "fill": ended}
        out[role] = {"path": str(path), "bytes": path.stat().st_size, "layout_of": side["source"],
                     "architecture": side["architecture"], "tensors": len(side["tensors"])}
    return out


def gguf(run: Run, role: str) -> Path:
    models = run.done("ggufs")
    if not models or models.get("status") != "ok":
        raise Waiting("the random-weight GGUFs are not written yet")
    return Path(models[role]["path"])


# -- the crash: checks, cheapest first --------------------------------------------------------------------


def check_imports(run: Run) -> dict:
    """Which llama_cpp a neutral folder imports, which libllama.so it maps, what the loader cannot resolve."""
    ended = worker(run, "crash-imports", ["imports"], CHECK_SECONDS)
    a = ended.get("answer")
    if a:
        package = Path(a["llama_cpp_file"]).parent
        libllama = [p for p in a["mapped"] if Path(p).name.startswith("libllama")]
        ended["libllama"] = libllama
        ended["lib_outside_package"] = [p for p in libllama if not Path(p).is_relative_to(package)]
        if not run.installed:
            ended["from_site"] = Path(a["llama_cpp_file"]).is_relative_to(run.site)
            if not ended["from_site"]:  # the new build is not what got imported
                ended["status"] = "failed"
                ended["reason"] = f"imported {a['llama_cpp_file']}, not the build installed in {run.site}"
    return ended


def header_dirs(run: Run, version: str | None) -> tuple[list[Path], str] | None:
    """Include folders of llama.h and the ggml headers: the vendored tree (the kit's sdist, else the one
    scripts/llama_tools.py unpacked), else the headers the installed wheel ships."""
    vendored = [run.work / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp",
                ROOT / ".cache" / "llama.cpp" / f"llama-cpp-python-{version}" / "vendor" / "llama.cpp"]
    for tree in vendored:
        if (tree / "include" / "llama.h").is_file():
            return [tree / "include", tree / "ggml" / "include"], f"vendored tree {tree}"
    code = "import importlib.metadata as m; print(next(f.locate() for f in m.files('llama-cpp-python') " \
           "if str(f).endswith('include/llama.h')))"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=run.env(),
                         cwd=run.neutral)
    if out.returncode == 0 and Path(out.stdout.strip()).is_file():
        return [Path(out.stdout.strip()).parent], "headers installed with llama-cpp-python (no vendored tree here)"
    return None


def check_layout(run: Run) -> dict:
    """ctypes' llama_model_params and llama_context_params against the C header: sizeof and every offset."""
    imports = run.done("crash/imports") or {}
    layouts = (imports.get("answer") or {}).get("layouts")
    if not layouts:
        return {"status": "skipped", "reason": "the import check gave no ctypes layouts"}
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    found = header_dirs(run, imports["answer"]["version"])
    if compiler is None or found is None:
        return {"status": "skipped", "reason": "no C compiler on PATH" if compiler is None else "no llama.h here"}
    dirs, source = found
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "llama.h"', "int main(void) {"]
    for struct, layout in layouts.items():
        lines.append(f'  printf("{struct} %zu\\n", sizeof(struct {struct}));')
        lines += [f'  printf("{struct}.{f} %zu\\n", offsetof(struct {struct}, {f}));' for f in layout["fields"]]
    c = run.work / "layout" / "layout.c"
    c.parent.mkdir(parents=True, exist_ok=True)
    c.write_text("\n".join(lines + ["  return 0;", "}"]) + "\n")
    built = isolated(run, "crash-layout-cc", [compiler, "-std=c11", *[f"-I{d}" for d in dirs], str(c), "-o",
                                              str(c.with_suffix(""))], CHECK_SECONDS)
    if built["rc"] != 0:  # a field the binding names that the header lacks fails here: the answer is in the tail
        return {"status": "failed", "headers": source, "compile": built}
    printed = subprocess.run([str(c.with_suffix(""))], check=False, capture_output=True, text=True, timeout=60).stdout
    c_side = dict(line.rsplit(" ", 1) for line in printed.splitlines())
    differ = []
    for struct, layout in layouts.items():
        pairs = [(struct, layout["sizeof"])] + [(f"{struct}.{f}", v["offset"]) for f, v in layout["fields"].items()]
        differ += [f"{key}: ctypes {py}, C {c_side.get(key)}" for key, py in pairs if str(py) != c_side.get(key)]
    return {"status": "ok" if not differ else "failed", "headers": source, "compiler": compiler, "differ": differ,
            "compared": len(c_side)}


def load_check(gguf_path: Path, ngl: int = 0, no_mmap: bool = False, no_repack: bool = False,
               edgespec: bool = False, env: dict[str, str] | None = None) -> Callable:
    args = ["load", str(gguf_path), "--ngl", str(ngl), *(["--no-mmap"] if no_mmap else []),
            *(["--no-repack"] if no_repack else []), *(["--edgespec"] if edgespec else [])]

    def check(run: Run, name: str) -> dict:
        ended = worker(run, f"crash-{name}", args, CHECK_SECONDS, env)
        if ended["status"] == "ok" and not (ended.get("answer") or {}).get("loaded"):
            ended["status"] = "failed"
        return ended | {"params": {"n_gpu_layers": ngl, "mmap": not no_mmap, "use_extra_bufts": not no_repack}}

    return check


def completion_tool(run: Run) -> tuple[Path | None, str]:
    """llama.cpp's own llama-completion: built from the kit's vendored tree where there is one (the sources of the
    library under test), for the CPU only (a second CUDA build would cost the call's time; the crash was seen in
    CPU-only builds too); else one scripts/llama_tools.py built earlier."""
    build = run.work / "build" / "tools"
    built = build / "bin" / "llama-completion"
    tree = run.work / "src"
    vendored = next(tree.glob("*/vendor/llama.cpp"), None) if tree.is_dir() else None
    if vendored is not None and run.build_tools and not built.is_file():
        for step in (["cmake", "-S", str(vendored), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=OFF",
                      "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"],
                     ["cmake", "--build", str(build), "-j", str(run.jobs), "--target", "llama-completion"]):
            ended = isolated(run, "tools-build", step, BUILD_SECONDS)
            if ended["rc"] != 0:
                return None, f"building llama-completion failed: {' | '.join(ended['tail'][-5:])}"
    if built.is_file():
        return built, f"built by the kit from {vendored} (CPU only)"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import llama_tools

    existing = llama_tools.tool("llama-completion", build=False)
    if existing is not None:
        return existing, f"built earlier by scripts/llama_tools.py ({existing})"
    why = "--no-build-tools" if vendored is not None else "the kit's sdist is not unpacked here (--installed)"
    return None, f"no llama-completion: {why}; scripts/llama_tools.py builds one"


def completion_check(gguf_path: Path, load_mode: str) -> Callable:
    def check(run: Run, name: str) -> dict:
        tool, how = completion_tool(run)
        if tool is None:
            return {"status": "skipped", "reason": how}
        # -no-cnv: a GGUF with a chat template would otherwise wait for a conversation on stdin.
        cmd = [str(tool), "-m", str(gguf_path), "-p", "Hello", "-n", "8", "--temp", "0", "-no-cnv", "-ngl", "0",
               "-c", "256", "--no-warmup", "-t", str(run.threads), "-lm", load_mode]
        ended = isolated(run, f"crash-{name}", cmd, CHECK_SECONDS)
        return ended | {"status": status_of(ended), "tool": how}

    return check


def script_check(script: Path) -> Callable:
    def check(run: Run, name: str) -> dict:
        ended = isolated(run, f"crash-{name}", [sys.executable, "-X", "faulthandler", str(script.resolve())],
                         CHECK_SECONDS)
        return ended | {"status": status_of(ended)}

    return check


def debugger() -> str | None:
    """gdb, else cuda-gdb (the GPU image has only that one; it debugs programs without GPU code too)."""
    return shutil.which("gdb") or shutil.which("cuda-gdb")


def check_backtrace(run: Run, crashed: list[tuple[str, dict]]) -> dict:
    """The first crashed check again, under a debugger, for the native backtrace faulthandler cannot give."""
    if not crashed:
        return {"status": "skipped", "reason": "no check crashed"}
    gdb = debugger()
    if gdb is None:
        return {"status": "skipped", "reason": "neither gdb nor cuda-gdb is on PATH"}
    name, first = crashed[0]
    cmd = [gdb, "-batch", "-ex", "run", "-ex", "bt", "-ex", "info sharedlibrary", "--args", *first["command"]]
    ended = isolated(run, "crash-backtrace", cmd, CHECK_SECONDS * 2)
    lines = Path(ended["log"]).read_text(errors="replace").splitlines()
    at = next((i for i, ln in enumerate(lines) if "received signal" in ln), None)
    return ended | {"status": "ok" if at is not None else "failed", "of": name, "debugger": gdb,
                    "backtrace": lines[at:at + 80] if at is not None else None}


def crash_checks(run: Run) -> list[tuple[str, Callable]]:
    """(name, check) in the order they run: what costs least and says most first."""
    target = gguf(run, "target")
    checks: list[tuple[str, Callable]] = [
        ("imports", lambda run, name: check_imports(run)),
        ("layout", lambda run, name: check_layout(run)),
        ("load-default", load_check(target)),  # the crash as it was seen: mmap (load_mode auto) and repacking
        ("load-no-mmap", load_check(target, no_mmap=True)),  # gVisor turns a failed mapping into SIGSEGV
        ("load-no-repack", load_check(target, no_repack=True)),  # the CPU's extra buffer types
        ("load-no-mmap-no-repack", load_check(target, no_mmap=True, no_repack=True)),
        ("load-gpu", load_check(target, ngl=999) if not run.cpu else
         lambda run, name: {"status": "skipped", "reason": "--cpu: no GPU to offload to"}),
        # edgespec's own load (numpy first): on the H200's image only this one died, and the C++ runtime preloaded
        # saved it; when it does again, every measurement runs with that preload (Run.env)
        ("load-edgespec", load_check(target, edgespec=True)),
        ("load-edgespec-preload", load_check(target, edgespec=True, env={"LD_PRELOAD": PRELOAD})),
        ("completion-default", completion_check(target, "auto")),
        ("completion-no-mmap", completion_check(target, "none")),
    ]
    checks += [(f"script-{p.stem}", script_check(p)) for p in run.check_scripts]
    return checks


def verdict(checks: dict[str, dict]) -> str:
    """One line from the checks' answers."""
    st = {name: c.get("status") for name, c in checks.items()}
    imports = checks.get("imports", {})
    if st.get("imports") != "ok":
        where = imports.get("reason") or imports.get("signal") or " | ".join(imports.get("tail", [])[-2:])
        return f"llama_cpp does not import cleanly from a neutral folder ({st.get('imports')}: {where})"
    notes = []
    if checks.get("layout", {}).get("differ"):
        notes.append(f"ctypes layout differs from llama.h: {'; '.join(checks['layout']['differ'][:3])}")
    if imports.get("lib_outside_package"):
        notes.append(f"libllama.so mapped from outside the package: {imports['lib_outside_package']}")
    if st.get("load-default") == "ok":
        line = "llama.cpp loads the random GGUF here with its defaults (mmap, repacking): no crash on this machine"
        if st.get("load-gpu") not in ("ok", "skipped", None):
            line = f"loads on the CPU, but with every layer on the GPU it {st['load-gpu']}"
        elif st.get("load-edgespec") == "crashed":
            line = ("llama.cpp's own load works, but edgespec's (numpy imported first) crashes: " +
                    (f"the measurements run with LD_PRELOAD={PRELOAD}, which saves it"
                     if st.get("load-edgespec-preload") == "ok" else f"LD_PRELOAD={PRELOAD} does not save it"))
    elif st.get("load-no-mmap") == "ok" and st.get("load-no-repack") != "ok":
        line = ("crashes only when the file is mapped: load with mmap off (LoadConfig(mmap=False), "
                "llama.cpp's -lm none); a failed mapping, as gVisor reports it")
    elif st.get("load-no-repack") == "ok" and st.get("load-no-mmap") != "ok":
        line = "crashes in the CPU's repacked buffers: use_extra_bufts=False (llama.cpp's --no-repack) avoids it"
    elif st.get("load-no-mmap-no-repack") == "ok":
        line = "crashes unless mmap and repacking are both off"
    elif st.get("completion-default") == "crashed" or st.get("completion-no-mmap") == "crashed":
        line = "llama.cpp's own llama-completion crashes too: the fault is in llama.cpp, not in the Python binding"
    else:
        line = (f"the default load {st.get('load-default')} and every variation tried too; see the backtrace "
                f"({st.get('backtrace')})")
    others = [f"{n} {c.get('status')}" + (f" ({c['signal']})" if c.get("signal") else "")
              for n, c in checks.items() if n.startswith("script-") and c.get("status") != "ok"]
    notes += [f"extra checks: {', '.join(others)}"] if others else []
    return "; ".join([line, *notes])


def step_crash(run: Run) -> dict:
    answers: dict[str, dict] = {}
    for name, check in crash_checks(run):
        done = run.done(f"crash/{name}")
        if done is None:
            if run.remaining() < 5:
                raise Stopped(f"crash check {name} not started: the call's deadline")
            done = run.save(f"crash/{name}", check(run, name))
            print(f"  crash check {name}: {done['status']}"
                  f"{' (' + done['signal'] + ')' if done.get('signal') else ''}", flush=True)
        answers[name] = done
    crashed = [(n, c) for n, c in answers.items() if c.get("status") == "crashed" and "command" in c]
    answers["backtrace"] = run.done("crash/backtrace") or run.save("crash/backtrace", check_backtrace(run, crashed))
    result = {"status": "ok", "verdict": verdict(answers), "order": list(answers), "checks": answers}
    (run.out / "crash.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


# -- measurements ----------------------------------------------------------------------------------------


def mmap_flag(run: Run) -> list[str]:
    """--no-mmap for the measurements when the checks found that only a load without mmap survives."""
    checks = (run.done("crash") or {}).get("checks", {})
    survives = checks.get("load-no-mmap", {}).get("status") == "ok"
    return ["--no-mmap"] if checks.get("load-default", {}).get("status") != "ok" and survives else []


def step_timing(run: Run) -> dict:
    if run.done("crash") is None:
        raise Waiting("the crash checks run first")
    units = {}
    paths = {role: gguf(run, role) for role in ("target", "draft")}
    for role, path in paths.items():
        for layout in LAYOUTS[run.mode]:
            name = f"timing/{role}-{layout}"
            done = run.done(name)
            if done is None and role == "draft" and paths["draft"] == paths["target"]:
                done = run.save(name, run.done(f"timing/target-{layout}") | {"same_file_as_target": True})
            if done is None:
                args = ["timing", str(path), "--layout", layout, "--batches", ",".join(map(str, BATCHES[run.mode])),
                        "--threads", str(run.threads), *mmap_flag(run)]
                done = run.save(name, worker(run, name.replace("/", "-"), args))
                print(f"  timing {role} {layout}: {done['status']}", flush=True)
            units[f"{role}-{layout}"] = done
    basis = "full" if not run.cpu else "cpu"  # the layout the replay and the curves use
    measured = {role: (units[f"{role}-{basis}"].get("answer")) for role in ("target", "draft")}
    ok = all(measured.values())
    return {"status": "ok" if ok else "failed", "basis": basis, "loaded_without_mmap": bool(mmap_flag(run)),
            "ld_preload": PRELOAD if run.preload else None,
            "units": units, "target": measured["target"], "draft": measured["draft"]}


def step_lockstep(run: Run) -> dict:
    target = gguf(run, "target")
    tokens, prompts, *_ = SIZES[run.mode]
    return worker(run, "lockstep", ["lockstep", "--target", str(target), "--draft", str(target), "--max-tokens",
                                    str(tokens), "--prompts", str(prompts), "--threads", str(run.threads),
                                    *(["--cpu"] if run.cpu else []), *mmap_flag(run)])


def step_replay(run: Run) -> dict:
    timing = run.done("timing")
    if not timing or timing["status"] != "ok":
        raise Waiting("the replay prices traces under the measured curve: timing first")
    limit = SIZES[run.mode][2]
    return worker(run, "replay", ["replay", str(run.result_path("timing")), "--limit", str(limit)])


def step_onnx(run: Run) -> dict:
    *_, precisions, tokens = SIZES[run.mode]
    return worker(run, "onnx", ["onnx", "--target", str(gguf(run, "target")), "--draft", str(gguf(run, "draft")),
                                "--precisions", precisions, "--max-tokens", str(tokens), "--export-dir",
                                str(run.work / "onnx"), "--threads", str(run.threads), *(["--cpu"] if run.cpu else []),
                                *mmap_flag(run)])


def step_curves(run: Run) -> dict:
    """The target's measured t(B)/t(1), keyed by the device it ran on, as measured_curves.json holds them."""
    timing = run.done("timing")
    if not timing or timing["status"] != "ok":
        raise Waiting("no measured curve yet: timing first")
    t = timing["target"]
    on = [d for d in t["devices"] if (d["kind"] == "cpu") == run.cpu]
    name = on[0]["description"] if on else t["cpu"]
    kind = "cpu" if run.cpu else gpu_kind(on[0]["name"] if on else "")
    layout = "every layer on the CPU" if run.cpu else "every layer on the GPU"
    entry = {"kind": kind, "batches": t["batches"], "ratio": t["ratio"], "t1_ms": round(t["seconds"][0] * 1e3, 3),
             "model": f"{t['model']}: random weights in the layout of {timing_source(run)}, {layout}",
             "source": {"kit": gpu_kit.KIT_VERSION, "date": time.strftime("%Y-%m-%d"),
                        "cpu": f"{t['cpu']} ({t['cpu_vector']})",
                        "threads": t["threads"], "llama_cpp_python": llama_version(run)}}
    return {"status": "ok", "devices": {name: entry}}


def gpu_kind(device_name: str) -> str:
    from_name = {"cuda": "cuda", "metal": "metal", "mtl": "metal", "vulkan": "vulkan", "rocm": "rocm"}
    return next((k for key, k in from_name.items() if device_name.lower().startswith(key)), "gpu")


def timing_source(run: Run) -> str:
    return (run.done("ggufs") or {}).get("target", {}).get("layout_of", "?")


def llama_version(run: Run) -> str | None:
    imports = (run.done("crash/imports") or {}).get("answer") or {}
    return imports.get("version")


STEPS: list[tuple[str, Callable[[Run], dict]]] = [
    ("kit", step_kit), ("wheels", step_wheels), ("llama", step_llama), ("ggufs", step_ggufs), ("crash", step_crash),
    ("timing", step_timing), ("lockstep", step_lockstep), ("replay", step_replay), ("onnx", step_onnx),
    ("curves", step_curves)]
# Steps that need only kit files wait on those files (Run.file), not on the whole kit: a call that brings some parts
# gets on with what they allow.
NEEDS = {"llama": ("wheels",), "crash": ("llama", "ggufs"),
         "timing": ("crash",), "lockstep": ("crash",), "replay": ("timing",), "onnx": ("crash", "wheels"),
         "curves": ("timing",)}


# -- the run --------------------------------------------------------------------------------------------


def summary(name: str, r: dict) -> str:
    """One line per step for a person."""
    a = r.get("answer") or {}
    if name == "crash":
        return f"verdict: {r['verdict']}"
    if name == "timing" and r.get("target"):
        t = r["target"]
        return (f"target {t['model']} ({r['basis']}): t(1) {t['seconds'][0] * 1e3:.2f} ms, t(B)/t(1) {t['ratio']} "
                f"for B = {t['batches']}; draft t(1) {r['draft']['seconds'][0] * 1e3:.2f} ms")
    if name == "lockstep" and a:
        cells = [f"{m} {row['ratio_to_plain']:.2f}x" + (f" ({row['acceptance']:.0%})" if row["acceptance"] is not None
                                                        else "") for m, row in a["modes"].items() if m != "none"]
        return f"plain {a['modes']['none']['tokens_per_second']:.1f} tok/s; " + ", ".join(cells)
    if name == "replay" and a:
        return f"REPLAYED (not live), speedup over plain: {a['speedup_over_plain']}"
    if name == "onnx" and a:
        return f"per token (ms): {a['per_token_ms']}; target t(1) {a['target_t1_ms']:.2f} ms; live draft:4 " \
               f"{a['live']['draft4_tokens_per_second']:.1f} tok/s vs plain {a['live']['plain_tokens_per_second']:.1f}"
    if name == "curves":
        return f"measured curve of {', '.join(r['devices'])}"
    how = f"{r.get('status')}" + (f" ({r['signal']})" if r.get("signal") else "")
    return r.get("reason") or (how + (f": {r['tail'][-1]}" if how != "ok" and r.get("tail") else ""))


def write_results(run: Run, pending: dict[str, str]) -> dict:
    steps = {name: run.done(name) or {"status": "pending", "why": pending.get(name, "not reached")}
             for name, _ in STEPS}
    results = {"kit": gpu_kit.KIT_VERSION, "mode": run.mode, "updated": time.strftime("%Y-%m-%d %H:%M:%S %z"),
               "platform": platform.platform(), "python": sys.version.split()[0], "steps": steps}
    (run.out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return results


def proof(run: Run, redo: list[str]) -> int:
    for name in redo:
        run.result_path(name).unlink(missing_ok=True)
        shutil.rmtree(run.out / "steps" / name, ignore_errors=True)
    pending: dict[str, str] = {}
    stopped = False
    for name, step in STEPS:
        done = run.done(name)
        if done is not None and name != "kit":  # the kit is checked on every call: parts may have arrived
            print(f"[{name}] done before, not run again: {summary(name, done)}", flush=True)
            continue
        blocked = [n for n in NEEDS.get(name, ()) if (run.done(n) or {}).get("status") not in ("ok", "skipped")]
        if blocked or stopped:
            pending[name] = "the call's deadline" if stopped else f"waiting for {', '.join(blocked)}"
            print(f"[{name}] {pending[name]}", flush=True)
            continue
        t = time.monotonic()
        try:
            result = run.save(name, step(run))
            print(f"[{name}] {result['status']} in {time.monotonic() - t:.0f} s: {summary(name, result)}", flush=True)
        except Waiting as e:
            pending[name] = str(e)
            print(f"[{name}] waiting: {e}", flush=True)
        except Stopped as e:
            pending[name], stopped = str(e), True
            print(f"[{name}] {e}; run the same command again to continue", flush=True)
        write_results(run, pending)
    write_results(run, pending)
    if stopped:
        return 3
    return 2 if pending else 0


def default_threads() -> int:
    """edgespec's default thread count (the physical cores), without importing llama.cpp into this process."""
    sys.path.insert(0, str(ROOT))
    from edgespec.config import default_threads as physical_cores

    return physical_cores()


def merge_curves(results: Path, into: Path) -> int:
    """Put the measured curves of a results.json into measured_curves.json (by device name; others kept)."""
    data = json.loads(results.read_text())
    curves = (data.get("steps", {}).get("curves") or {}).get("devices")
    if not curves:
        raise SystemExit(f"{results} holds no measured curve (its curves step has not run)")
    table = json.loads(into.read_text()) if into.is_file() else {"format": 1, "devices": {}}
    for name, entry in curves.items():
        print(f"{'replaced' if name in table['devices'] else 'added'} {name} ({entry['kind']}): {entry['ratio']} "
              f"for B = {entry['batches']}")
        table["devices"][name] = entry
    into.write_text(json.dumps(table, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["curves"]:
        cp = argparse.ArgumentParser(prog="gpu_proof.py curves", description=merge_curves.__doc__)
        cp.add_argument("results", type=Path)
        cp.add_argument("--into", type=Path, default=ROOT / "edgespec" / "planning" / "measured_curves.json")
        a = cp.parse_args(argv[1:])
        return merge_curves(a.results, a.into)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kit", type=Path, required=True, help="the kit's folder (scripts/gpu_kit.py pack)")
    ap.add_argument("--out", type=Path, required=True, help="results and work; keep it between calls")
    ap.add_argument("--cpu", action="store_true", help="no GPU: CPU layouts, small sizes (the test's run)")
    ap.add_argument("--installed", action="store_true", help="use the installed llama-cpp-python, build nothing")
    ap.add_argument("--deadline", type=float, default=DEADLINE, help="seconds this call may take [%(default)s]")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel build jobs [%(default)s]")
    # On a shared CPU, OpenMP threads spinning at llama.cpp's barriers while other work holds the cores ran at
    # seconds per token: the test runs with one.
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads [edgespec's default]")
    ap.add_argument("--check-script", type=Path, action="append", default=[],
                    help="a Python file to run as one more crash check (repeatable)")
    ap.add_argument("--no-build-tools", action="store_true", help="never build llama-completion")
    ap.add_argument("--cmake-arg", action="append", default=[],
                    help="one more CMake flag for the llama-cpp-python build, e.g. -DGGML_CUDA_FA=OFF (repeatable)")
    ap.add_argument("--redo", action="append", default=[], choices=[n for n, _ in STEPS],
                    help="forget a step's result and run it again (repeatable)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    threads = a.threads or default_threads()
    run = Run(a.kit.resolve(), a.out.resolve(), a.cpu, a.installed, time.monotonic() + a.deadline, a.jobs, threads,
              a.check_script, not a.no_build_tools, a.cmake_arg)
    code = proof(run, a.redo)
    print({0: f"done: {run.out / 'results.json'}", 2: "not finished: steps are waiting (see above)",
           3: "stopped at the deadline: run the same command again"}[code], flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
