#!/usr/bin/env bash
# The Vulkan check (issue 29, item 3): cached-equals-cold with every layer offloaded to a real Vulkan device that
# runs on these CPU-only machines, Mesa's lavapipe (llvmpipe). Builds the Vulkan venv first when it is missing
# (bench/vulkan_build.sh, ~1 h on 2 shared cores), then, with that venv's llama_cpp:
#   bench/device_check.py on tiny and tiny-q4 (calibration, 50 shared-prefix chats cached vs cold, save/restore,
#   a state saved under the full offload restored under other layouts)
#   tests/test_correctness.py (every test's runtime offloads all layers: Config's default -ngl)
# Results: $OUT (default bench/results/<today>/vulkan/), one log per step, commands.txt with the exact commands.
#
# GGML_VK_VISIBLE_DEVICES=0: without it ggml-vulkan drops CPU-type Vulkan devices (lavapipe is one) and the build
# has no device (ggml-vulkan.cpp, ggml_vk_instance_init: "If only CPU devices are available, return without
# devices"); naming the index makes it use it.
#
# Environment: VK_VENV (default /work/vk-venv), OUT, NICE (default 10), STEPS (default device_check,test_correctness),
# CHECK_ARGS (extra device_check.py arguments, e.g. --dry-run for toy sizes: a full run's first section did not
# finish in 9 minutes on 2 cores shared with 6 other sessions, bench/results/2026-12-01/vulkan/README.md)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
venv="${VK_VENV:-/work/vk-venv}"
out="${OUT:-$repo/bench/results/$(date -u +%F)/vulkan}"
steps="${STEPS:-device_check,test_correctness}"
py="$venv/bin/python"
mkdir -p "$out"
cd "$repo"
export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}" PYTHONPATH="$repo" PYTHONUNBUFFERED=1
if ! [ -x "$py" ] || ! "$py" -c "import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())"; then
  bash "$here/vulkan_build.sh"
fi
run() {  # a step: its command into commands.txt, its output into <name>.log; a failure is recorded, not fatal
  local name="$1"; shift
  echo "GGML_VK_VISIBLE_DEVICES=$GGML_VK_VISIBLE_DEVICES PYTHONPATH=. nice -n ${NICE:-10} $*" >> "$out/commands.txt"
  echo "== $(date -u +%T) $name"
  nice -n "${NICE:-10}" "$@" > "$out/$name.log" 2>&1 || echo "$name: exit status $?" | tee -a "$out/$name.log"
  grep -v " llama.cpp: " "$out/$name.log" | tail -15
}
: > "$out/commands.txt"
vulkaninfo --summary > "$out/vulkaninfo.txt" 2>&1 || true
"$py" -c "import llama_cpp; from orchestrator import devices; print(llama_cpp.__version__, 'gpu offload:', llama_cpp.llama_supports_gpu_offload()); [print(d) for d in devices.available()]; print(llama_cpp.llama_print_system_info().decode())" \
  | tee "$out/devices.txt"
case ",$steps," in *,device_check,*)
  run device_check "$py" bench/device_check.py --preset tiny --preset tiny-q4 ${CHECK_ARGS:-} --out "$out" ;; esac
case ",$steps," in *,test_correctness,*)
  run test_correctness "$py" -m pytest -q -p no:cacheprovider tests/test_correctness.py ;; esac
echo "results: $out"
