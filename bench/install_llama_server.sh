#!/usr/bin/env bash
# Build llama.cpp's own server (llama-server) from source, for the side-by-side benchmark (issue 5).
#
# Source: the llama.cpp vendored by the llama-cpp-python 0.3.36 sdist, i.e. the very llama.cpp that this
# project's engine runs, so the three systems differ only in their server and cache logic.
# Output: bench/.llama-server/build/bin/llama-server (gitignored). Release, CPU only, only the llama-server
# target, -j${JOBS:-2}. About 5-10 minutes on 2 cores.
#
# Environment:
#   LLAMA_SDIST   path to an already downloaded llama_cpp_python-0.3.36.tar.gz (else pip downloads it)
#   PYTHON        python with pip (default: .venv/bin/python, else python3)
#   JOBS          parallel compile jobs (default 2)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.llama-server"
version="0.3.36"
jobs="${JOBS:-2}"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$here/../.venv/bin/python" ]; then py="$here/../.venv/bin/python"; else py=python3; fi
fi
mkdir -p "$root"
bin="$root/build/bin/llama-server"
if [ -x "$bin" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "already built: $bin"; exit 0
fi
sdist="${LLAMA_SDIST:-}"
if [ -z "$sdist" ]; then
  sdist="$root/llama_cpp_python-$version.tar.gz"
  if [ ! -f "$sdist" ]; then
    "$py" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root"
  fi
fi
src="$root/llama_cpp_python-$version"
if [ ! -d "$src/vendor/llama.cpp" ]; then
  tar -xzf "$sdist" -C "$root"
fi
command -v cmake >/dev/null || "$py" -m pip install cmake ninja
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src/vendor/llama.cpp" -B "$root/build" "${gen[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
cmake --build "$root/build" --config Release --target llama-server -j "$jobs"
"$bin" --version
echo "built: $bin"
