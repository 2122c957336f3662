#!/usr/bin/env python3
"""Intelligibility check: transcribe WAVs with faster-whisper, score word error rate.

    python3 tests/python/wer.py --model models/whisper-tiny-en --ref "expected text" a.wav [b.wav ...]
    python3 tests/python/wer.py --model models/whisper-tiny-en --pairs pairs.json

`--ref` once applies to every WAV; given as many times as there are WAVs, the
n-th ref goes with the n-th WAV. `pairs.json` is `[{"wav": ..., "ref": ...}]`
(relative paths are taken from the JSON file's folder).

Audio of any sample rate / channel count is decoded and resampled to 16 kHz
mono by faster-whisper (PyAV). Text is normalised (lower case, no punctuation,
numbers and clock times spelled out, contractions written out, American
spelling, compounds written apart on one side joined) before a word-level
Levenshtein distance.

Prints `{"items": [{"wav", "ref", "hyp", "wer"}], "wer": aggregate}` (the
aggregate is total word errors / total reference words) and exits 0; exits 2 on
bad arguments or unreadable input. Requirements: tests/python/requirements.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import unicodedata

# Never reach for the network: the model is a local CTranslate2 folder.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = [(10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand")]


def _int_words(n: int) -> str:
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, rest = divmod(n, 10)
        return _TENS[tens] + ("" if rest == 0 else " " + _ONES[rest])
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return _ONES[hundreds] + " hundred" + ("" if rest == 0 else " " + _int_words(rest))
    for value, name in _SCALES:
        if n >= value:
            high, rest = divmod(n, value)
            return _int_words(high) + " " + name + ("" if rest == 0 else " " + _int_words(rest))
    raise AssertionError(n)


def _number_words(match: re.Match) -> str:
    text = match.group(0).replace(",", "")
    whole, _, frac = text.partition(".")
    if len(whole) > 15:  # a digit string, not a number: read digit by digit
        return " ".join(_ONES[int(d)] for d in text if d.isdigit())
    words = _int_words(int(whole))
    if frac:
        words += " point " + " ".join(_ONES[int(d)] for d in frac)
    return f" {words} "


# British spellings Whisper writes the American way (and the other way round:
# both sides are mapped), so a spelling is not an error of hearing; shared with
# tests/lib.rs's word_error_rate.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "spelling.json"), encoding="utf-8") as _f:
    SPELLING: dict[str, str] = json.load(_f)


def _clock(match: re.Match) -> str:
    """9:10 (or 9.10 before a.m./p.m.) -> nine ten; 9:05 -> nine oh five; 9:00 -> nine."""
    hour, minute = int(match.group(1)), match.group(2)
    words = _int_words(hour)
    if minute != "00":
        words += (" oh " if minute[0] == "0" else " ") + _int_words(int(minute))
    return f" {words} "


def join_compounds(words: list[str], other: list[str]) -> list[str]:
    """Two neighbours of `words` that make one word of `other` ("window sill",
    "windowsill") become that word: a compound's spelling is not an error of
    hearing either."""
    vocab, out, i = set(other), [], 0
    while i < len(words):
        if i + 1 < len(words) and words[i] + words[i + 1] in vocab and words[i] not in vocab:
            out.append(words[i] + words[i + 1])
            i += 2
        else:
            out.append(words[i])
            i += 1
    return out


# The same list as tests/lib.rs's word_error_rate.
_CONTRACTIONS = [
    (r"\bwon't\b", "will not"),
    (r"\bcan't\b", "can not"),
    (r"\bshan't\b", "shall not"),
    (r"\bcannot\b", "can not"),
    (r"(?<=[a-z])n't\b", " not"),
    (r"(?<=[a-z])'re\b", " are"),
    (r"(?<=[a-z])'ve\b", " have"),
    (r"(?<=[a-z])'ll\b", " will"),
    (r"(?<=[a-z])'m\b", " am"),
]


def normalize(text: str) -> list[str]:
    """Lower case, accents and punctuation removed, numbers and clock times as
    words, contractions written out, American spelling; the words."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = text.replace("%", " percent ").replace("&", " and ")
    text = re.sub(r"\b([ap])\.\s?m\b\.?", r"\1m", text)  # a.m. / p. m. -> am / pm
    text = re.sub(r"\b(\d{1,2}):(\d{2})\b", _clock, text)
    text = re.sub(r"\b(\d{1,2})\.(\d{2})(?=\s*[ap]m\b)", _clock, text)
    text = re.sub(r"\$\s?(\d[\d,]*(?:\.\d+)?)", r"\1 dollars", text)  # $3.5 -> 3.5 dollars
    # 1,000 / 3.5 / 42 -> words (before punctuation goes).
    text = re.sub(r"\d+(?:,\d{3})*(?:\.\d+)?", _number_words, text)
    # Contractions written out (they're -> they are): Whisper writes either for
    # the same sound. Only the unambiguous ones ('s and 'd are not).
    text = re.sub(r"[\u2019`]", "'", text)
    for pattern, words in _CONTRACTIONS:
        text = re.sub(pattern, words, text)
    # Other apostrophes join (o'clock -> oclock); other punctuation separates words.
    text = text.replace("'", "")
    text = re.sub(r"[^\w\s]|_", " ", text)
    return [SPELLING.get(w, w) for w in text.split()]


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    """Word-level Levenshtein distance (substitutions + deletions + insertions)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def wer(ref: str, hyp: str) -> tuple[float, int, int]:
    """(word error rate, errors, reference words) of one pair."""
    r, h = normalize(ref), normalize(hyp)
    r, h = join_compounds(r, h), join_compounds(h, r)
    errors = edit_distance(r, h)
    if not r:
        return (0.0 if not h else 1.0), errors, 0
    return errors / len(r), errors, len(r)


def _pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.pairs:
        if args.wavs or args.ref:
            raise SystemExit("wer.py: give either --pairs or --ref with WAV files, not both")
        with open(args.pairs, encoding="utf-8") as f:
            data = json.load(f)
        base = os.path.dirname(os.path.abspath(args.pairs))
        if not isinstance(data, list) or not all(
            isinstance(d, dict) and isinstance(d.get("wav"), str) and isinstance(d.get("ref"), str)
            for d in data
        ):
            raise SystemExit(f'wer.py: {args.pairs}: expected [{{"wav": str, "ref": str}}, ...]')
        return [(os.path.join(base, d["wav"]), d["ref"]) for d in data]
    if not args.wavs or not args.ref:
        raise SystemExit("wer.py: give --ref TEXT and WAV files, or --pairs FILE")
    if len(args.ref) == 1:
        return [(w, args.ref[0]) for w in args.wavs]
    if len(args.ref) == len(args.wavs):
        return list(zip(args.wavs, args.ref))
    raise SystemExit(f"wer.py: {len(args.ref)} --ref for {len(args.wavs)} WAV files (give 1 or one per WAV)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wavs", nargs="*", metavar="WAV")
    p.add_argument("--model", default="models/whisper-tiny-en", help="CTranslate2 Whisper model folder")
    p.add_argument("--ref", action="append", help="expected text (once for all WAVs, or once per WAV)")
    p.add_argument("--pairs", help='JSON file: [{"wav": ..., "ref": ...}]')
    p.add_argument("--compute-type", default="int8", choices=["int8", "float32"])
    p.add_argument("--beam-size", type=int, default=5)
    p.add_argument("--language", default="en")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: CTranslate2's default)")
    args = p.parse_args(argv)

    try:
        pairs = _pairs(args)
    except (OSError, ValueError) as e:
        print(f"wer.py: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model, "model.bin")):
        print(f"wer.py: {args.model}: no model.bin (a CTranslate2 Whisper model folder)", file=sys.stderr)
        return 2
    missing = [w for w, _ in pairs if not os.path.isfile(w)]
    if missing:
        print(f"wer.py: no such WAV file: {', '.join(missing)}", file=sys.stderr)
        return 2

    from faster_whisper import WhisperModel  # slow import: after the argument checks

    model = WhisperModel(
        args.model, device="cpu", compute_type=args.compute_type, cpu_threads=args.threads, local_files_only=True
    )
    items = []
    total_errors = total_words = 0
    for wav, ref in pairs:
        try:
            segments, _info = model.transcribe(
                wav,
                language=args.language,
                beam_size=args.beam_size,
                condition_on_previous_text=False,
                vad_filter=False,
            )
            hyp = " ".join(s.text.strip() for s in segments).strip()
        except Exception as e:  # undecodable audio and the like
            print(f"wer.py: {wav}: {e}", file=sys.stderr)
            return 2
        rate, errors, words = wer(ref, hyp)
        total_errors += errors
        total_words += words
        items.append({"wav": wav, "ref": ref, "hyp": hyp, "wer": round(rate, 4)})
    aggregate = total_errors / total_words if total_words else (0.0 if total_errors == 0 else 1.0)
    json.dump({"items": items, "wer": round(aggregate, 4)}, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
