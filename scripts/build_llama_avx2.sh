#!/usr/bin/env bash
# A second llama-cpp-python, built without AVX-512, for benchmarking an AVX2-only machine's curve on an
# AVX-512 one (issue 22): installed into a folder of its own, used with PYTHONPATH=<folder>.
#   bash scripts/build_llama_avx2.sh [DIR]    # default ~/.cache/edgespec/llama-avx2; ~6 min on 2 cores
#   PYTHONPATH=~/.cache/edgespec/llama-avx2 python scripts/bench_spec.py ...
set -euo pipefail
DIR=${1:-$HOME/.cache/edgespec/llama-avx2}
VERSION=$(python -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')
SRC=$(mktemp -d)
trap 'rm -rf "$SRC"' EXIT
pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
# GGML_NATIVE off: the kernels are the ones the flags name, not this CPU's best.
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DLLAVA_BUILD=OFF" \
  pip install -q --no-deps --no-cache-dir --target "$DIR" "$SRC"/llama_cpp_python-*.tar.gz
PYTHONPATH="$DIR" python -c "import llama_cpp; print(llama_cpp.__file__); print(llama_cpp.llama_print_system_info().decode())"
