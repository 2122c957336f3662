#!/usr/bin/env bash
# Builds the CUDA omnistream binary on a machine with no GPU and no CUDA toolkit:
# nvcc, headers and libraries of the CUDA 13.0 line come from PyPI wheels (the
# GPU host's driver is CUDA 13.0, which rejects PTX from newer toolkits), and
# libcuda is a link-time stub (the real driver resolves the symbols at run time).
#
#   scripts/cuda/build.sh            # -> cuda-bin/omnistream (+ .xz), libopus.so.0
#                                    #    and nats-server.xz
#   WITH_TESTS=1 scripts/cuda/build.sh   # also cuda-bin/stages-tests: the engine's
#                                        # unit tests, the GPU-only ones included
#
# CUDA_TOOLCHAIN (default .cuda-toolchain, git-ignored) holds the wheels' files.
# The binary carries an rpath to /usr/local/cuda/lib64 and $ORIGIN, so on the GPU
# host it finds libcublas/libcurand/libcudart there (or beside itself) and
# libcuda.so.1 through the dynamic loader's usual paths; nothing needs setting.
set -euo pipefail
cd "$(dirname "$0")/../.."
# As for the CPU build (scripts/setup.sh): the system libopus, found through
# pkg-config, and protoc for candle-onnx.
if ! pkg-config --exists opus 2>/dev/null || ! command -v protoc >/dev/null; then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq pkg-config libopus-dev protobuf-compiler >/dev/null
fi
ROOT=$(realpath -m "${CUDA_TOOLCHAIN:-.cuda-toolchain}")
CUDA_ROOT=$ROOT/nvidia/cu13
if [ ! -x "$CUDA_ROOT/bin/nvcc" ]; then
  # One pip call: a second `pip install --target` into the same folder wipes the
  # shared nvidia/ dir. --no-deps with pins: nvcc's own deps would otherwise come
  # at the newest 13.x.
  python3 -m pip install -q --no-deps --target "$ROOT" \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
    nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
  # The wheels ship only versioned sonames; the linker wants lib<name>.so.
  (cd "$CUDA_ROOT/lib" && for p in cublas.so.13 cublasLt.so.13 cudart.so.13 curand.so.10 nvrtc.so.13; do
    ln -sf "lib$p" "lib${p%.so.*}.so"; done)
fi
export CUDA_HOME=$CUDA_ROOT CUDA_PATH=$CUDA_ROOT PATH=$CUDA_ROOT/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}   # no GPU to ask: Hopper
if [ ! -f "$CUDA_ROOT/lib/stubs/libcuda.so" ]; then
  # candle turns on cudarc's dynamic linking, so libcuda.so must exist at link
  # time: a stub with every driver entry point cudarc declares.
  CUDARC=$(cargo metadata --format-version 1 --features cuda --manifest-path server/Cargo.toml |
    python3 -c 'import json,sys,os;print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"]=="cudarc"))')
  mkdir -p "$CUDA_ROOT/lib/stubs"
  grep -ohE '^ *pub unsafe fn cu[A-Za-z0-9_]+' -r "$CUDARC/src/driver/sys/" |
    awk '{print "void "$4"(void){}"}' | sort -u >"$ROOT/cuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA_ROOT/lib/stubs/libcuda.so" "$ROOT/cuda_stub.c"
fi
export LIBRARY_PATH=$CUDA_ROOT/lib:$CUDA_ROOT/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
# shellcheck disable=SC2016
export RUSTFLAGS='-C target-cpu=x86-64-v3 -C link-arg=-Wl,-rpath,$ORIGIN:/usr/local/cuda/lib64:/usr/local/cuda-13.0/lib64'
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
cargo build --profile gpu --features cuda -p omnistream "$@"
mkdir -p cuda-bin
cp "$CARGO_TARGET_DIR/gpu/omnistream" cuda-bin/omnistream
# The GPU host has no libopus: it travels beside the binary ($ORIGIN is on the rpath).
cp -L "$(ldconfig -p | awk '/libopus.so.0 /{print $NF; exit}')" cuda-bin/libopus.so.0
xz -T0 -6 -kf cuda-bin/omnistream
# Nor has it nats-server (the split pipeline's bench, step `split`): Debian's
# static build travels too, when this machine has it (scripts/setup.sh --dev).
if command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ]; then
  cp "$(command -v nats-server || echo /usr/sbin/nats-server)" cuda-bin/nats-server
  xz -T0 -6 -kf cuda-bin/nats-server
fi
if [ -n "${WITH_TESTS:-}" ]; then
  # With the binary's package in the same call, features resolve as for the
  # binary and nothing is rebuilt but the engine's test harness.
  exe=$(cargo test --profile gpu --features omnistream/cuda -p omnistream -p omnistream-stages --lib --no-run --message-format json |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "omnistream_stages":
        print(m["executable"])')
  cp "$exe" cuda-bin/stages-tests
  xz -T0 -6 -kf cuda-bin/stages-tests
fi
ls -l cuda-bin
