"""The GPU kit: everything scripts/gpu_proof.py needs on a GPU machine with no network, packed to travel.

    python scripts/gpu_kit.py pack .cache/gpu-kit      # here: PyPI and the cached models at hand
    python scripts/gpu_kit.py check .cache/gpu-kit     # anywhere: which parts are there, missing or damaged

`pack` gathers:
- the llama-cpp-python sdist of the version installed here (pip download), trimmed of what no build reads
  (its .git folder, llama.cpp's docs, benches, web UI and test vocabularies: 76.6 MB -> 9.8 MB); the
  manifest keeps the published sdist's sha256 and what was left out (--full-sdist keeps it whole);
- wheels the GPU image lacks (diskcache, which llama_cpp imports; gguf, which the ONNX export reads with),
  and onnxruntime-gpu with --onnxruntime (large: several calls);
- the skeletons of the target and the draft GGUF (scripts/random_gguf.py skeleton: the header and tokenizer,
  a few MB), from which the GPU machine writes random weights of exactly the real layout.

A file larger than a part is split. The device tool carries at most 64 MiB a call, the working tree
included, so the parts are laid out in folders call-1, call-2, ... each of which fits one call beside this
checkout's tree; every folder holds a copy of manifest.json (each part's and each whole file's size and
sha256). Parts may arrive over several calls: `check` (and gpu_proof.py) name the missing ones with
their sizes and folders.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT_VERSION = 1
MANIFEST = "manifest.json"
MiB = 1 << 20
CALL_BYTES = 64 * MiB  # what one device call carries: the working tree and the carried paths together
MAX_PART_BYTES = 60 * MiB
CALL_MARGIN = 1 * MiB  # the tree changes a little between packing and the call
GPU_PYTHON = "3.12"  # the python3 of the GPU image (/work/.library/device/KINDS.md)
GPU_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
WHEELS = ("diskcache", "gguf")  # missing from the GPU image: llama_cpp imports diskcache; the ONNX export, gguf
# Members of the sdist no build reads (relative to its top folder): git history, docs, benchmark notes, the
# server's web UI (built only with LLAMA_BUILD_SERVER) and the tokenizer test vocabularies (*.gguf, tests only).
TRIM_PREFIXES = (".git/", "vendor/llama.cpp/docs/", "vendor/llama.cpp/benches/", "vendor/llama.cpp/tools/ui/")
TRIM_SUFFIX_UNDER = ("vendor/llama.cpp/models/", ".gguf")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


# -- packing ------------------------------------------------------------------------------------------


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree a device call sends: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    return sum((root / name).stat().st_size for name in out.decode().split("\0") if name and (root / name).is_file())


def trim_sdist(sdist: Path, out: Path) -> list[str]:
    """Write `sdist` without the members no build reads (TRIM_*), reproducibly; returns what was left out."""
    dropped: list[str] = []
    with tarfile.open(sdist) as src, open(out, "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if rel.startswith(TRIM_PREFIXES) or (rel.startswith(TRIM_SUFFIX_UNDER[0])
                                                 and rel.endswith(TRIM_SUFFIX_UNDER[1])):
                dropped.append(rel)
                continue
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    return dropped


def download(args: list[str], dest: Path) -> Path:
    """One file by `pip download ARGS` into `dest`."""
    before = set(dest.iterdir())
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *args], check=True)
    (new,) = set(dest.iterdir()) - before
    return new


def wheel_args(name: str, python: str) -> list[str]:
    """pip download arguments for a wheel of `name` for the GPU image (the version installed here, if any)."""
    try:
        spec = f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        spec = name
    plats = [a for p in GPU_PLATFORMS for a in ("--platform", p)]
    return ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", *plats, spec]


def gather(args: argparse.Namespace, staging: Path) -> list[tuple[Path, str, dict]]:
    """(file, role, notes) of everything the kit carries, written into `staging`."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import random_gguf

    files: list[tuple[Path, str, dict]] = []
    for role, ref in (("target", args.target), ("draft", args.draft)):
        path = Path(ref) if Path(ref).exists() else _resolve(ref)
        skel = staging / f"{role}.skel"
        random_gguf.cmd_skeleton(str(path), str(skel))
        files += [(skel, f"{role}-skeleton", {"source": path.name}), (Path(f"{skel}.json"), f"{role}-sidecar", {})]
    if not args.no_sdist:
        version = importlib.metadata.version("llama-cpp-python")
        sdist = Path(args.sdist) if args.sdist else download(
            ["--no-binary=:all:", f"llama-cpp-python=={version}"], staging)
        notes = {"published_sha256": sha256(sdist), "published_size": sdist.stat().st_size, "version": version}
        if not args.full_sdist:
            trimmed = staging / sdist.name.replace(".tar.gz", "-trimmed.tar.gz")
            dropped = trim_sdist(sdist, trimmed)
            notes |= {"trimmed": True, "left_out": len(dropped),
                      "left_out_prefixes": [*TRIM_PREFIXES, "*".join(TRIM_SUFFIX_UNDER)]}
            sdist = trimmed
        files.append((sdist, "sdist", notes))
    names = [*WHEELS, *(["onnxruntime-gpu"] if args.onnxruntime else [])]
    for name in names if not args.no_wheels else ():
        files.append((download(wheel_args(name, args.python), staging), "wheel", {"package": name}))
    return files


def _resolve(ref: str) -> Path:
    from edgespec.models import resolve

    return Path(resolve(ref))


@dataclass
class Part:
    name: str
    size: int
    sha256: str
    folder: str = ""


def split(path: Path, part_bytes: int, dest: Path) -> list[Part]:
    """Cut `path` into parts of at most `part_bytes` in `dest` (one part, under the file's own name, if it fits)."""
    size = path.stat().st_size
    if size <= part_bytes:
        shutil.copyfile(path, dest / path.name)
        return [Part(path.name, size, sha256(dest / path.name))]
    parts = []
    with open(path, "rb") as f:
        for i in range(1, -(-size // part_bytes) + 1):
            name = f"{path.name}.part{i:02d}"
            (dest / name).write_bytes(f.read(part_bytes))
            parts.append(Part(name, (dest / name).stat().st_size, sha256(dest / name)))
    return parts


def lay_out(parts: list[Part], room: int) -> list[int]:
    """Folders' byte counts after putting each part in the first folder with room (largest parts first)."""
    loads: list[int] = []
    for p in sorted(parts, key=lambda p: -p.size):
        i = next((i for i, used in enumerate(loads) if used + p.size <= room), len(loads))
        if i == len(loads):
            loads.append(0)
        loads[i] += p.size
        p.folder = f"call-{i + 1}"
    return loads


def pack(args: argparse.Namespace) -> dict:
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; give a new folder (or remove it)")
    tree = tree_bytes() if args.tree_mib is None else int(args.tree_mib * MiB)
    room = int(args.call_mib * MiB) - tree - CALL_MARGIN - 64 * 1024  # 64 KiB: the manifest copy in each folder
    part_bytes = min(int(args.part_mib * MiB), MAX_PART_BYTES, room)
    if room < MiB:
        raise SystemExit(f"the working tree is {tree / MiB:.1f} MiB, leaving {room / MiB:.1f} MiB a call: too little")
    files, entries, cut = [], [], out / ".cut"
    with tempfile.TemporaryDirectory() as tmp:
        cut.mkdir(parents=True)
        for path, role, notes in gather(args, Path(tmp)):
            parts = split(path, part_bytes, cut)
            files.append(parts)
            entries.append({"name": path.name, "role": role, "size": path.stat().st_size, "sha256": sha256(path),
                            **notes})
    loads = lay_out([p for parts in files for p in parts], room)
    for entry, parts in zip(entries, files):
        entry["parts"] = [vars(p) for p in parts]
        for p in parts:
            (out / p.folder).mkdir(exist_ok=True)
            (cut / p.name).rename(out / p.folder / p.name)
    cut.rmdir()
    manifest = {"kit": KIT_VERSION, "created": time.strftime("%Y-%m-%d %H:%M:%S %z"), "made_on": platform.platform(),
                "python": args.python, "part_bytes": part_bytes, "tree_bytes": tree,
                "calls": [{"folder": f"call-{i + 1}", "bytes": b} for i, b in enumerate(loads)], "files": entries}
    text = json.dumps(manifest, indent=1) + "\n"
    (out / MANIFEST).write_text(text)
    for i in range(len(loads)):
        (out / f"call-{i + 1}" / MANIFEST).write_text(text)
    return manifest


# -- checking and assembling (used by gpu_proof.py, standard library only) ----------------------------------


def read_manifest(kit: Path) -> dict:
    """The kit's manifest: at its top, or in any call folder (each carries a copy)."""
    for path in [kit / MANIFEST, *sorted(kit.glob(f"*/{MANIFEST}"))]:
        if path.is_file():
            return json.loads(path.read_text())
    raise FileNotFoundError(f"no {MANIFEST} in {kit} or its call folders: carry the kit's call-1 folder (it was "
                            f"written by scripts/gpu_kit.py pack)")


def find_part(kit: Path, part: dict) -> Path | None:
    expected = kit / part["folder"] / part["name"]
    if expected.is_file():
        return expected
    return next((p for p in kit.rglob(part["name"]) if p.is_file()), None)


def check_file(kit: Path, entry: dict) -> list[str]:
    """What is wrong with one file's parts: '' for none; else one line per missing or damaged part."""
    problems = []
    for part in entry["parts"]:
        where = f"{part['folder']}/{part['name']} ({part['size']:,} bytes)"
        found = find_part(kit, part)
        if found is None:
            problems.append(f"missing {where}")
        elif found.stat().st_size != part["size"]:
            problems.append(f"damaged {where}: {found.stat().st_size:,} bytes here")
        elif sha256(found) != part["sha256"]:
            problems.append(f"damaged {where}: sha256 differs")
    return problems


def assemble(kit: Path, entry: dict, dest: Path) -> Path:
    """The whole file in `dest`, from its parts, checked against the manifest's sha256 (kept if already there)."""
    target = dest / entry["name"]
    if target.is_file() and target.stat().st_size == entry["size"] and sha256(target) == entry["sha256"]:
        return target
    dest.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".partial")
    with open(tmp, "wb") as out:
        for part in entry["parts"]:
            with open(find_part(kit, part), "rb") as f:
                shutil.copyfileobj(f, out, 8 * MiB)
    if sha256(tmp) != entry["sha256"]:
        tmp.unlink()
        raise ValueError(f"{entry['name']} reassembled from its parts does not match the manifest's sha256")
    tmp.replace(target)
    return target


def check(kit: Path) -> int:
    manifest = read_manifest(kit)
    bad = 0
    for entry in manifest["files"]:
        problems = check_file(kit, entry)
        bad += bool(problems)
        print(f"{entry['name']} ({entry['role']}, {entry['size']:,} bytes): {'; '.join(problems) or 'complete'}")
    print(f"{len(manifest['files']) - bad} of {len(manifest['files'])} files complete")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="gather, split and list what travels")
    p.add_argument("out", help="a new folder, inside this checkout and ignored by git (e.g. .cache/gpu-kit)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="GGUF path or catalog name [%(default)s]")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="GGUF path or catalog name [%(default)s]")
    p.add_argument("--sdist", help="a llama-cpp-python sdist already here (else pip downloads it)")
    p.add_argument("--full-sdist", action="store_true", help="carry the published sdist whole, not trimmed")
    p.add_argument("--no-sdist", action="store_true", help="no sdist: gpu_proof.py must then run with --installed")
    p.add_argument("--no-wheels", action="store_true", help=f"leave out the wheels ({', '.join(WHEELS)})")
    p.add_argument("--onnxruntime", action="store_true", help="carry onnxruntime-gpu's wheel too")
    p.add_argument("--python", default=GPU_PYTHON, help="the GPU machine's Python, for wheels [%(default)s]")
    p.add_argument("--part-mib", type=float, default=MAX_PART_BYTES / MiB,
                   help="largest part, MiB (also kept within what one call carries beside the tree)")
    p.add_argument("--call-mib", type=float, default=CALL_BYTES / MiB,
                   help="what one device call carries, the working tree included, MiB [%(default)s]")
    p.add_argument("--tree-mib", type=float, help="the working tree a call sends, MiB [measured with git]")
    c = sub.add_parser("check", help="which parts of a kit are here, missing or damaged")
    c.add_argument("kit")
    args = ap.parse_args(argv)
    if args.command == "check":
        return check(Path(args.kit))
    manifest = pack(args)
    where = Path(args.out)
    print(f"kit {where}: {len(manifest['files'])} files in {len(manifest['calls'])} call folder(s); the working "
          f"tree is {manifest['tree_bytes'] / MiB:.1f} MiB, parts at most {manifest['part_bytes'] / MiB:.1f} MiB")
    for call in manifest["calls"]:
        print(f"  {where / call['folder']}: {call['bytes'] / MiB:.1f} MiB: carry it in one device call")
    if note := carry_note(where):
        print(note)
    return 0


def carry_note(out: Path) -> str | None:
    """Why the device tool could not carry `out` as it is, if it could not."""
    try:
        rel = out.resolve().relative_to(ROOT)
    except ValueError:
        return f"note: {out} is outside this checkout; the device tool carries ignored paths inside it (.cache/...)"
    if subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(rel)], check=False).returncode != 0:
        return f"note: git does not ignore {rel}: every call would send it with the tree; pack into .cache/gpu-kit"
    return None


if __name__ == "__main__":
    sys.exit(main())
