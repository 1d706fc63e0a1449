#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 with llama.cpp's Vulkan backend into its own venv (issue 29, item 3).
#
# Device: Mesa's lavapipe (software Vulkan on the CPU, Debian 12 `mesa-vulkan-drivers`), so the check runs on
# machines without a GPU. Debian 12's Vulkan headers (1.3.239) stop the build at ggml-vulkan.cpp
# (`vk::LayerSettingEXT` is newer), so Debian 13's libvulkan-dev (1.4.309) headers are fetched with
# `apt-get download` from the trixie suite (a private apt state under $root/apt; the system's sources are not
# changed), unpacked with `dpkg -x`, and passed as -DVulkan_INCLUDE_DIR. Debian 12's glslc compiles the shaders.
#
# Output: $VK_VENV (default /work/vk-venv) with llama_cpp built for Vulkan, plus the project's runtime
# dependencies. Not in CI (it takes ~1 h on 2 shared cores). Log: whatever the caller redirects to.
#
# Environment:
#   VK_VENV       venv to create (default /work/vk-venv)
#   VK_ROOT       work dir for the sdist, the trixie headers, apt state (default /work/vk-build)
#   LLAMA_SDIST   an already downloaded llama_cpp_python-0.3.36.tar.gz (else pip downloads it)
#   BASE_PYTHON   python to create the venv from (default python3)
#   JOBS          parallel compile jobs (default 2; this machine is shared)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${VK_VENV:-/work/vk-venv}"
root="${VK_ROOT:-/work/vk-build}"
jobs="${JOBS:-2}"
py="${BASE_PYTHON:-python3}"
version="0.3.36"
mkdir -p "$root"

echo "== apt: Debian 12 packages"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q mesa-vulkan-drivers libvulkan-dev glslc spirv-headers vulkan-tools

echo "== apt: Debian 13 (trixie) libvulkan-dev headers"
inc="$root/trixie/usr/include"
if [ ! -f "$inc/vulkan/vulkan.hpp" ]; then
  a="$root/apt"
  mkdir -p "$a/lists/partial" "$a/cache/archives/partial" "$root/debs"
  echo "deb http://deb.debian.org/debian trixie main" > "$a/sources.list"
  opts=(-o Dir::Etc::SourceList="$a/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o Dir::State::Lists="$a/lists" -o Dir::Cache="$a/cache" -o APT::Default-Release=trixie)
  apt-get "${opts[@]}" update -q
  ver="$(apt-cache "${opts[@]}" policy libvulkan-dev | awk '/Candidate:/{print $2}')"
  echo "trixie libvulkan-dev candidate: $ver"
  (cd "$root/debs" && apt-get "${opts[@]}" download "libvulkan-dev=$ver")
  dpkg -x "$root"/debs/libvulkan-dev_*.deb "$root/trixie"
fi
grep -m1 "VK_HEADER_VERSION " "$inc/vulkan/vulkan_core.h"

echo "== sdist"
sdist="${LLAMA_SDIST:-}"
if [ -z "$sdist" ]; then
  sdist="$(ls "$root"/llama_cpp_python-$version.tar.gz 2>/dev/null || true)"
  if [ -z "$sdist" ]; then
    "$py" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root"
    sdist="$root/llama_cpp_python-$version.tar.gz"
  fi
fi
echo "$sdist"

echo "== venv $venv"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip

echo "== build llama-cpp-python $version with GGML_VULKAN (jobs=$jobs)"
# LLAVA_BUILD=OFF: no libmtmd (multimodal; llama_cpp imports it lazily, the engine never does).
export CMAKE_ARGS="-DGGML_VULKAN=on -DVulkan_INCLUDE_DIR=$inc -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="$jobs"
wheels="$root/wheels"
if ! ls "$wheels"/llama_cpp_python-$version-*.whl >/dev/null 2>&1; then
  time "$venv/bin/python" -m pip wheel -v --no-deps -w "$wheels" "$sdist"
fi
"$venv/bin/python" -m pip install --force-reinstall "$wheels"/llama_cpp_python-$version-*.whl
# Then the project's runtime and test dependencies: llama-cpp-python==0.3.36 is already satisfied, so pip
# keeps the Vulkan build.
"$venv/bin/python" -m pip install -q -e "$here/..[test]"
GGML_VK_VISIBLE_DEVICES=0 "$venv/bin/python" - <<'PY'  # lavapipe is a CPU-type device: bench/vulkan_check.sh
import llama_cpp
print("llama_cpp", llama_cpp.__version__, "gpu offload:", llama_cpp.llama_supports_gpu_offload())
PY
echo "built: $venv"
