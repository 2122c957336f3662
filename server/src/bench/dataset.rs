//! Prompts for the bench: a seeded random dataset of a given length, or the
//! lines of a file.

use std::path::Path;

use anyhow::{bail, Context, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// Common English words that BPE vocabularies (SmolLM2's, Qwen's) keep as one
/// token each with a leading space, so N words are close to N prompt tokens.
/// The server's `usage.prompt_tokens` reports the exact count.
const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "time",
    "people",
    "water",
    "house",
    "city",
    "river",
    "tree",
    "light",
    "night",
    "day",
    "year",
    "world",
    "school",
    "music",
    "book",
    "story",
    "family",
    "friend",
    "road",
    "market",
    "garden",
    "window",
    "table",
    "morning",
    "summer",
    "winter",
    "color",
    "green",
    "blue",
    "small",
    "large",
    "old",
    "new",
    "good",
    "long",
    "great",
    "little",
    "right",
    "high",
    "different",
    "place",
    "work",
    "life",
    "hand",
    "part",
];

/// `n` prompts. From `file` (one prompt per non-empty line, cycled when the
/// file is shorter than `n`) or, without one, random word sequences of
/// `input_len` words each, reproducible from `seed`.
pub fn prompts(file: Option<&Path>, n: usize, input_len: usize, seed: u64) -> Result<Vec<String>> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading prompts from {}", path.display()))?;
        let lines: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect();
        if lines.is_empty() {
            bail!("{}: no prompts (one per line expected)", path.display());
        }
        return Ok(lines.iter().cycle().take(n).cloned().collect());
    }
    if input_len == 0 {
        bail!("--input-len must be at least 1");
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    Ok((0..n)
        .map(|_| {
            let words: Vec<&str> = (0..input_len)
                .map(|_| *WORDS.choose(&mut rng).unwrap_or(&"the"))
                .collect();
            words.join(" ")
        })
        .collect())
}

/// A spoken question: the file as chat sends it (`input_audio`), and the
/// 24 kHz pcm16 a Realtime microphone streams, its trailing silence cut so
/// that the time from the end of speech counts none of it.
#[derive(Debug)]
pub struct Question {
    pub wav_b64: String,
    pub pcm: Vec<u8>,
    pub seconds: f64,
}

/// Realtime's input rate.
const MIC_RATE: u32 = 24_000;
/// Quieter than this is silence (about -40 dBFS).
const SILENCE: f32 = 0.01;

/// The WAV files at `path` (one file, or every `*.wav` in a folder, sorted).
pub fn questions(path: &Path) -> Result<Vec<Question>> {
    let files: Vec<std::path::PathBuf> = if path.is_dir() {
        let mut v: Vec<_> = std::fs::read_dir(path)
            .with_context(|| format!("reading {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x.eq_ignore_ascii_case("wav")))
            .collect();
        v.sort();
        v
    } else {
        vec![path.to_path_buf()]
    };
    if files.is_empty() {
        bail!("{}: no .wav files", path.display());
    }
    files.iter().map(|f| question(f)).collect()
}

fn question(path: &Path) -> Result<Question> {
    use base64::Engine as _;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let (samples, rate) = omnistream_codecs::wav::parse_wav(&bytes)
        .with_context(|| format!("{}: not a WAV file", path.display()))?;
    let mut r = omnistream_codecs::resample::StreamResampler::new(rate, MIC_RATE)
        .with_context(|| format!("{}: resampling from {rate} Hz", path.display()))?;
    let mut mic = r.process(&samples)?;
    mic.extend(r.flush()?);
    let end = mic
        .iter()
        .rposition(|x| x.abs() > SILENCE)
        .map_or(0, |i| i + 1);
    if end == 0 {
        bail!("{}: silent", path.display());
    }
    mic.truncate(end);
    Ok(Question {
        wav_b64: base64::engine::general_purpose::STANDARD.encode(&bytes),
        pcm: omnistream_codecs::pcm::f32_to_pcm16_le(&mic),
        seconds: mic.len() as f64 / f64::from(MIC_RATE),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn questions_are_resampled_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        // 0.5 s of a tone then 0.5 s of silence at 16 kHz.
        let x: Vec<f32> = (0..16_000)
            .map(|i| {
                if i < 8_000 {
                    (i as f32 * 0.1).sin() * 0.5
                } else {
                    0.0
                }
            })
            .collect();
        omnistream_codecs::wav::write_wav(&dir.path().join("q.wav"), &x, 16_000).unwrap();
        let q = questions(dir.path()).unwrap();
        assert_eq!(q.len(), 1);
        assert!((q[0].seconds - 0.5).abs() < 0.01, "{}", q[0].seconds);
        assert_eq!(
            q[0].pcm.len(),
            (q[0].seconds * 24_000.0).round() as usize * 2
        );
        assert!(questions(&dir.path().join("none")).is_err());
    }

    #[test]
    fn random_prompts_are_reproducible_and_sized() {
        let a = prompts(None, 5, 12, 7).unwrap();
        let b = prompts(None, 5, 12, 7).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 5);
        assert!(a.iter().all(|p| p.split(' ').count() == 12));
        assert_ne!(a, prompts(None, 5, 12, 8).unwrap());
        assert!(prompts(None, 1, 0, 0).is_err());
    }

    #[test]
    fn file_prompts_cycle_and_skip_blank_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.txt");
        std::fs::write(&path, "first\n\n  second  \n").unwrap();
        let p = prompts(Some(&path), 3, 0, 0).unwrap();
        assert_eq!(p, ["first", "second", "first"]);
        std::fs::write(&path, "\n \n").unwrap();
        let err = prompts(Some(&path), 3, 0, 0).unwrap_err().to_string();
        assert!(err.contains("no prompts"), "{err}");
        assert!(prompts(Some(&dir.path().join("missing")), 1, 0, 0).is_err());
    }
}
