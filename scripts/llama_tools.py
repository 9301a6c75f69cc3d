"""Build llama.cpp's own C++ tools from the sources that the installed llama-cpp-python vendors.

Benchmarks compare edgespec with these binaries, so both must come from the same
llama.cpp commit and the same compiler defaults. The sdist is fetched with pip
(usually from pip's cache) and built with CMake into .cache/llama.cpp/build. `--avx2` builds them
with AVX-512 off, as scripts/build_llama_avx2.sh builds the Python package, into .cache/llama.cpp/build-avx2:
a benchmark under that package compares with tools that run the same kernels.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_ROOT = ROOT / ".cache" / "llama.cpp"
TOOLS = ("llama-bench", "llama-completion", "llama-speculative-simple", "llama-lookup")
SERVER = "llama-server"  # the editors' peer (scripts/bench_editor.py), built on its own
# The flags of scripts/build_llama_avx2.sh: the named kernels, not this CPU's best.
AVX2_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
              "-DGGML_AVX_VNNI=OFF")


def source_dir() -> Path:
    version = importlib.metadata.version("llama-cpp-python")
    src = BUILD_ROOT / f"llama-cpp-python-{version}"
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        return src / "vendor" / "llama.cpp"
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-d", tmp,
                        f"llama-cpp-python=={version}"], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as t:
            t.extractall(BUILD_ROOT, filter="data")
    extracted = next(BUILD_ROOT.glob(f"llama_cpp_python-{version}"))
    extracted.rename(src)
    return src / "vendor" / "llama.cpp"


def tool(name: str, build: bool, avx2: bool = False) -> Path | None:
    """Path of a built tool; builds it first when asked and missing (all of TOOLS, or llama-server alone: it takes
    about 20 minutes on 2 cores)."""
    build_dir = BUILD_ROOT / ("build-avx2" if avx2 else "build")
    binary = build_dir / "bin" / name
    if binary.exists():
        return binary
    if not build:
        return None
    src = source_dir()
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON",
                    *(AVX2_FLAGS if avx2 else ())], check=True)
    targets = [SERVER] if name == SERVER else list(TOOLS)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", "2", "--target", *targets], check=True)
    return binary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--avx2", action="store_true", help="AVX-512 off, into .cache/llama.cpp/build-avx2")
    ap.add_argument("--server", action="store_true", help=f"build {SERVER} instead of {', '.join(TOOLS)}")
    args = ap.parse_args()
    for t in [SERVER] if args.server else TOOLS:
        print(t, tool(t, build=True, avx2=args.avx2))
