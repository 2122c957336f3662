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

#[cfg(test)]
mod tests {
    use super::*;

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
