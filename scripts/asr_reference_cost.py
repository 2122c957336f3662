#!/usr/bin/env python3
"""Cost of the reference recognizer (faster-whisper over the same CTranslate2
files) on the fixtures `asr_cost` times, for a side-by-side ratio:

    python3 scripts/asr_reference_cost.py [--model models/whisper-tiny-en] [--rounds 3]

Decodes as omnistream does (greedy, no timestamps, no previous-text
conditioning) with 2 CPU threads, in float32 (omnistream's arithmetic) and
int8 (CTranslate2's fastest CPU mode). Prints one JSON object: the best
round's RTF (compute seconds / audio seconds) per compute type.
Requirements: tests/python/requirements.txt (faster-whisper).
"""

import argparse
import glob
import json
import time
import wave


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/whisper-tiny-en")
    p.add_argument("--wavs", default="stages/testdata/whisper/*.wav")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from faster_whisper import WhisperModel  # slow import: after the argument checks

    wavs = sorted(glob.glob(args.wavs))
    if not wavs:
        raise SystemExit(f"no WAV files match {args.wavs}")
    audio_s = 0.0
    for w in wavs:
        with wave.open(w) as f:
            audio_s += f.getnframes() / f.getframerate()
    out = {"clips": len(wavs), "audio_s": round(audio_s, 2), "threads": args.threads}
    for compute_type in ["float32", "int8"]:
        model = WhisperModel(args.model, device="cpu", compute_type=compute_type,
                             cpu_threads=args.threads, local_files_only=True)

        def one_round():
            t = time.perf_counter()
            for w in wavs:
                segments, _ = model.transcribe(w, language="en", beam_size=1, temperature=0.0,
                                               without_timestamps=True,
                                               condition_on_previous_text=False)
                "".join(s.text for s in segments)  # decoding is lazy
            return time.perf_counter() - t

        one_round()  # warm-up
        best = min(one_round() for _ in range(args.rounds))
        out[compute_type] = {"rtf": round(best / audio_s, 3),
                             "per_clip_ms": round(1000 * best / len(wavs), 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
