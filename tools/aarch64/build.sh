#!/usr/bin/env bash
# Build (idempotently) the aarch64 environment in which tools/aarch64/check.py runs the exactness checks under
# qemu-user emulation (issue 43). Nothing it makes is in git: everything lands under
#   ${ORCHESTRATOR_AARCH64_DIR:-$HOME/.cache/orchestrator-aarch64}/
#     rootfs/            Debian bookworm arm64 (debootstrap, second stage under qemu) with python3.11 and a venv
#                        /opt/venv holding the project's runtime dependencies (aarch64 wheels from PyPI) and
#                        llama-cpp-python 0.3.36's Python package copied from its sdist (not compiled)
#     lib/<variant>/     libllama.so + libggml*.so of the sdist's vendored llama.cpp, cross-compiled with
#                        aarch64-linux-gnu-gcc 12 per ISA variant (-march below); LLAMA_CPP_LIB_PATH selects one
#     build/<variant>/   the CMake build trees (kept: a rerun only relinks what changed)
#     sdist/             llama_cpp_python-0.3.36 (pip download --no-binary :all:)
#     DONE-*             stamps: a finished stage is skipped on the next run (delete one to redo its stage)
# Usage: sudo tools/aarch64/build.sh [stage...]   stages: host rootfs venv libs (default: all, in that order)
# Needs root (apt-get, debootstrap, chroot, binfmt_misc), Debian bookworm's apt and PyPI. JOBS (default 2) caps
# the parallel compile. Measured on a 2-core EPYC shared with other work: see tools/aarch64/README.md.
set -euo pipefail

ROOT=${ORCHESTRATOR_AARCH64_DIR:-$HOME/.cache/orchestrator-aarch64}
JOBS=${JOBS:-2}
LLAMA_CPP_PYTHON=0.3.36
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# variant -> -march. Which qemu -cpu runs which: tools/aarch64/check.py (VARIANTS). armv8-a: NEON (ASIMD) only;
# +dotprod: SDOT/UDOT (ggml's vec_dot_q*_K and the repacked q4_K_8x4 GEMV/GEMM); armv8.6-a+i8mm: SMMLA too (the
# q4_K_8x8 repacked kernels, ggml's *_mmla paths); +sve: ggml's SVE dot products.
declare -A MARCH=(
  [neon]=armv8-a
  [dotprod]=armv8.2-a+dotprod+fp16
  [i8mm]=armv8.6-a+dotprod+i8mm+fp16
  [sve]=armv8.6-a+dotprod+i8mm+fp16+sve
)
VARIANT_ORDER=(neon dotprod i8mm sve)

log() { printf '[aarch64 %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
stamp() { touch "$ROOT/DONE-$1"; }
done_() { [[ -e "$ROOT/DONE-$1" ]]; }

stage_host() {
  done_ host && return 0
  log "host packages: qemu-user-static, binfmt-support, the aarch64 cross compilers, debootstrap, cmake, ninja"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static binfmt-support gcc-aarch64-linux-gnu \
    g++-aarch64-linux-gnu debootstrap cmake ninja-build >/dev/null
  stamp host
}

binfmt() {  # aarch64 binaries run through qemu (also inside the chroot: the F flag keeps the interpreter open)
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
  grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
    || { log "binfmt qemu-aarch64 lacks the F flag: chroot cannot find the interpreter"; exit 1; }
}

stage_rootfs() {
  done_ rootfs && return 0
  binfmt
  log "debootstrap bookworm arm64 into $ROOT/rootfs (first stage: download and unpack)"
  rm -rf "$ROOT/rootfs"
  debootstrap --arch=arm64 --foreign --variant=minbase \
    --include=python3,python3-venv,libgomp1 bookworm "$ROOT/rootfs" "$MIRROR" >/dev/null
  log "debootstrap second stage (runs arm64 dpkg under qemu)"
  chroot "$ROOT/rootfs" /debootstrap/debootstrap --second-stage >/dev/null
  stamp rootfs
}

in_root() {  # run a command in the rootfs with /proc, /dev and /sys mounted (unmounted again on exit)
  local r=$ROOT/rootfs m
  for m in proc sys dev; do mountpoint -q "$r/$m" || mount --rbind "/$m" "$r/$m"; done
  local rc=0
  chroot "$r" /usr/bin/env -i PATH=/opt/venv/bin:/usr/bin:/bin HOME=/root "$@" || rc=$?
  for m in dev sys proc; do umount -R "$r/$m" 2>/dev/null || umount -l "$r/$m" 2>/dev/null || true; done
  return $rc
}

stage_venv() {
  done_ venv && return 0
  binfmt
  log "venv /opt/venv in the rootfs: the runtime dependencies (aarch64 wheels, fetched here by the host's pip)"
  # llama-cpp-python itself is not pip-installed (its build would compile llama.cpp under emulation): its Python
  # package is copied from the sdist below, and its libraries come from LLAMA_CPP_LIB_PATH. Models (the synthetic
  # presets, Gemma 3 270M) are made on the host and bind-mounted by check.py.
  local deps py
  py=$(command -v python3)
  deps=$("$py" - "$REPO/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(" ".join(d for d in p["dependencies"] if not d.startswith("llama-cpp-python")))
PY
)
  # async-timeout: redis needs it below Python 3.11.3 (bookworm has 3.11.2), a marker the host's pip evaluates
  # with its own full version
  deps="$deps typing-extensions>=4.5 async-timeout>=4.0.3 pytest pytest-timeout"
  local guest_py
  guest_py=$(chroot "$ROOT/rootfs" /usr/bin/python3 -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  rm -rf "$ROOT/rootfs/opt/wheels"; mkdir -p "$ROOT/rootfs/opt/wheels"
  # shellcheck disable=SC2086
  "$py" -m pip download -q --only-binary=:all: --implementation cp --python-version "$guest_py" \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
    -d "$ROOT/rootfs/opt/wheels" $deps
  in_root /usr/bin/python3 -m venv /opt/venv
  # shellcheck disable=SC2086
  in_root /opt/venv/bin/pip install -q --no-index --find-links /opt/wheels $deps
  rm -rf "$ROOT/rootfs/opt/wheels"
  local site
  site=$(in_root /opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  fetch_sdist
  rm -rf "${ROOT:?}/rootfs$site/llama_cpp"
  cp -r "$ROOT/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON/llama_cpp" "$ROOT/rootfs$site/llama_cpp"
  # check.py bind-mounts lib/<variant> here: llama_cpp._ggml loads libggml from llama_cpp/lib whatever
  # LLAMA_CPP_LIB_PATH says, and both must be the same copy
  mkdir -p "$ROOT/rootfs$site/llama_cpp/lib"
  stamp venv
}

fetch_sdist() {
  local d=$ROOT/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON
  [[ -d $d/vendor/llama.cpp/ggml ]] && return 0
  mkdir -p "$ROOT/sdist"
  if [[ -d /tmp/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp/ggml ]]; then
    cp -r "/tmp/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON" "$ROOT/sdist/"
  else
    python3 -m pip download -q --no-deps --no-binary :all: -d "$ROOT/sdist" "llama-cpp-python==$LLAMA_CPP_PYTHON"
    tar -xzf "$ROOT/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$ROOT/sdist"
  fi
}

build_variant() {  # $1 variant: a CMake tree of the vendored llama.cpp, CPU backend only, built into lib/$1
  local v=$1 src=$ROOT/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp
  done_ "lib-$v" && return 0
  local b=$ROOT/build/$v
  mkdir -p "$ROOT/build"
  log "llama.cpp for $v: -march=${MARCH[$v]} (CPU backend, static backends, OpenMP, llamafile sgemm, repack)"
  cmake -S "$src" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
    -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=OFF -DGGML_CPU_ARM_ARCH="${MARCH[$v]}" \
    -DGGML_OPENMP=ON -DGGML_LLAMAFILE=ON -DGGML_CPU_REPACK=ON -DGGML_CPU_KLEIDIAI=OFF \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON "-DCMAKE_INSTALL_RPATH=\$ORIGIN" >"$b.cmake.log" 2>&1 \
    || { tail -30 "$b.cmake.log"; exit 1; }
  # libllama.so holds no compute kernel (every op of the graph runs in ggml-cpu), so it is compiled once, for the
  # baseline; each variant compiles ggml-base, ggml-cpu and ggml with its own -march and takes that libllama.so.
  local target=ggml
  [[ $v == "${VARIANT_ORDER[0]}" ]] && target=llama
  cmake --build "$b" -j "$JOBS" --target "$target" >"$b.build.log" 2>&1 || { tail -40 "$b.build.log"; exit 1; }
  rm -rf "${ROOT:?}/lib/$v"; mkdir -p "$ROOT/lib/$v"
  # the files and their soname links (libllama.so needs libggml.so.0, found through its RUNPATH $ORIGIN)
  cp -P "$b"/bin/libggml*.so* "$ROOT/lib/$v/"
  cp -P "$ROOT/build/${VARIANT_ORDER[0]}"/bin/libllama.so* "$ROOT/lib/$v/"
  { echo "ggml: -march=${MARCH[$v]}; libllama.so: -march=${MARCH[${VARIANT_ORDER[0]}]}"
    echo "llama.cpp vendored in llama-cpp-python $LLAMA_CPP_PYTHON; $(aarch64-linux-gnu-gcc --version | head -1)"
  } >"$ROOT/lib/$v/BUILD"
  stamp "lib-$v"
}

stage_libs() {
  fetch_sdist
  local v
  for v in "${VARIANT_ORDER[@]}"; do build_variant "$v"; done
}

mkdir -p "$ROOT"
stages=("$@"); [[ ${#stages[@]} -gt 0 ]] || stages=(host rootfs venv libs)
for s in "${stages[@]}"; do
  start=$SECONDS; "stage_$s"; log "stage $s: $((SECONDS - start)) s"
done
log "ready: $ROOT ($(du -sh "$ROOT" | cut -f1))"
