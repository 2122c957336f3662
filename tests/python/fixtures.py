"""Reading the reference's fixtures (tests/fixtures/): safetensors files as
numpy arrays, without torch or the safetensors package in the test
environment, and the 16-bit WAVs the tests send."""

from __future__ import annotations

import io
import json
import struct
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "I16": np.int16}


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(raw[base + a : base + b], dtype=DTYPES[v["dtype"]]).reshape(v["shape"])
    return out


def float_wav(samples: np.ndarray, rate: int = 24_000) -> bytes:
    """A 32-bit float WAV: the samples reach the server bit for bit."""
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def pcm16_wav(samples: np.ndarray, rate: int = 24_000) -> bytes:
    """Mono 16-bit WAV of float samples in [-1, 1] (int16 samples as they are)."""
    if samples.dtype != np.int16:
        samples = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()
