#!/usr/bin/env bash
# The wheels that run the reference (scripts/qwen3_tts/ref_bench.py) on the GPU
# host, which has Python 3.12, PyTorch and a newer transformers but no network:
# qwen-tts 0.1.1 pins transformers 4.57.3 (and with it tokenizers < 0.23 and
# huggingface_hub < 1.0). Downloaded here for that Python and platform, carried
# to the host, and installed there with
#   pip install --no-index --no-deps --target "$T" target/refwheels/*.whl
# then run with PYTHONPATH="$T".
set -euo pipefail
cd "$(dirname "$0")/../.."
D=target/refwheels
mkdir -p "$D"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --no-deps -d "$D" \
  qwen-tts==0.1.1 transformers==4.57.3 tokenizers==0.22.2 huggingface_hub==0.36.2 \
  librosa==0.11.0 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 sox==1.4.1 audioread==3.1.0 \
  lazy_loader==0.6 pooch==1.9.0 msgpack==1.2.4 joblib==1.6.0 decorator==5.3.2 soxr==1.1.0 \
  standard-aifc==3.13.0 standard-sunau==3.13.0 platformdirs==4.3.8
du -sh "$D"
