//! Cost of the Whisper recognizer: real-time factor (seconds of compute per second of audio)
//! over the fixtures in stages/testdata/whisper/, split into log-mel / encoder / decoder.
//!
//!     cargo run -p omnistream-stages --example asr_cost [-- MODEL_DIR [ROUNDS]]
//!
//! One warm-up clip, then ROUNDS (default 3) timed passes over every fixture; the fastest
//! pass is reported (the spread on a shared machine is other load).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Device;
use omnistream_stages::models::whisper::{read_wav_16k, WhisperAsr, SAMPLE_RATE};

fn main() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("../models/whisper-tiny-en"));
    let rounds: usize = match args.next() {
        Some(r) => r.parse().context("ROUNDS must be a number")?,
        None => 3,
    };

    let t = Instant::now();
    let asr = WhisperAsr::load(&dir, &Device::Cpu)
        .with_context(|| format!("loading {}", dir.display()))?;
    println!("model {} loaded in {:.2?}", dir.display(), t.elapsed());

    let data = root.join("testdata/whisper");
    let mut wavs: Vec<PathBuf> = std::fs::read_dir(&data)
        .with_context(|| format!("reading {}", data.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "wav"))
        .collect();
    wavs.sort();
    let clips = wavs
        .iter()
        .map(|p| read_wav_16k(p).with_context(|| format!("reading {}", p.display())))
        .collect::<Result<Vec<_>>>()?;
    anyhow::ensure!(!clips.is_empty(), "no WAV files in {}", data.display());
    let audio_s: f64 = clips
        .iter()
        .map(|c| c.len() as f64 / SAMPLE_RATE as f64)
        .sum();

    // Warm-up (page faults, allocator, thread pools).
    asr.transcribe(&clips[0])?;

    // Per round: (total, mel, encoder, decoder) seconds and tokens. The best round is
    // reported, the others only listed: on a shared machine the spread is other load.
    let mut results = Vec::new();
    for _ in 0..rounds {
        let (mut mel, mut enc, mut dec, mut total, mut tokens) = (0.0, 0.0, 0.0, 0.0, 0usize);
        for c in &clips {
            let t = Instant::now();
            let r = asr.transcribe_detailed(c)?;
            total += t.elapsed().as_secs_f64();
            mel += r.mel_s;
            enc += r.encoder_s;
            dec += r.decoder_s;
            tokens += r.tokens.len() + 1; // + <|endoftext|>
        }
        results.push((total, mel, enc, dec, tokens));
    }
    let n = clips.len() as f64;
    println!(
        "{} clips, {audio_s:.1} s of audio, {} rayon threads; RTF per round: {}",
        clips.len(),
        rayon::current_num_threads(),
        results
            .iter()
            .map(|r| format!("{:.3}", r.0 / audio_s))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let Some(&(total, mel, enc, dec, tokens)) = results.iter().min_by(|a, b| a.0.total_cmp(&b.0))
    else {
        anyhow::bail!("ROUNDS must be at least 1");
    };
    println!(
        "best round: RTF {:.3} (compute s / audio s); per clip {:.0} ms: mel {:.1} ms, \
         encoder {:.0} ms, decoder {:.0} ms ({:.1} ms / token, {:.1} tokens / clip)",
        total / audio_s,
        1e3 * total / n,
        1e3 * mel / n,
        1e3 * enc / n,
        1e3 * dec / n,
        1e3 * dec / tokens as f64,
        tokens as f64 / n
    );
    println!(
        "split of the RTF: mel {:.4}, encoder {:.3}, decoder {:.3}",
        mel / audio_s,
        enc / audio_s,
        dec / audio_s
    );
    Ok(())
}
