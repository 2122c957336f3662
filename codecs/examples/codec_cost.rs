//! CPU cost of the codecs per 20 ms frame of audio on this machine, one
//! thread: Opus encode (at three complexities) and decode (raw RTP packets,
//! 48 kHz mono, VoIP, default bitrate), the streaming resampler between the
//! rates the server uses, G.711 and the Ogg Opus writer/reader. Prints a
//! Markdown table; docs/bench/codecs.md has a run.
//!
//!   cargo run -p omnistream-codecs --example codec_cost [--release] [-- SECONDS]
//!
//! SECONDS (default 2) is the measuring time per row. The input is synthetic
//! speech: a voiced source with a wandering pitch through three formant
//! resonators, syllable envelopes with pauses, and noise bursts for
//! fricatives, so that the codecs meet speech-like content, not a steady tone.

use std::hint::black_box;
use std::time::{Duration, Instant};

use omnistream_codecs::g711;
use omnistream_codecs::opus_frames::{OpusFrameDecoder, OpusFrameEncoder};
use omnistream_codecs::pcm::f32_to_i16;
use omnistream_codecs::{OggOpusDecoder, OggOpusEncoder, StreamResampler};

/// Length of the test signal; every round runs through all of it.
const SIGNAL_SECONDS: usize = 10;

/// Speech-like mono signal in [-1, 1] at `rate`.
fn speech(rate: u32) -> Vec<f32> {
    let n = rate as usize * SIGNAL_SECONDS;
    let fs = rate as f32;
    let tau = 2.0 * std::f32::consts::PI;
    // xorshift32: deterministic noise without a dependency.
    let mut seed = 0x9E37_79B9u32;
    let mut noise = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed as f32 / u32::MAX as f32 * 2.0 - 1.0
    };
    // Two-pole resonators (formants), kept below Nyquist for 8 kHz.
    let formants: Vec<(f32, f32)> = [(500.0, 80.0), (1500.0, 120.0), (2500.0, 160.0)]
        .iter()
        .map(|&(f, bw): &(f32, f32)| {
            let f = f.min(0.45 * fs);
            let r = (-std::f32::consts::PI * bw / fs).exp();
            (2.0 * r * (tau * f / fs).cos(), -r * r)
        })
        .collect();
    let mut state = vec![(0.0f32, 0.0f32); formants.len()];
    let mut phase = 0.0f32;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = i as f32 / fs;
        // Syllables of ~250 ms; every fourth one is a pause, every third
        // unvoiced (fricative noise).
        let syl = (t * 4.0) as usize;
        let within = t * 4.0 - syl as f32;
        let env = (std::f32::consts::PI * within).sin().powi(2);
        let f0 = 110.0 + 40.0 * (tau * 0.7 * t).sin() + 15.0 * (tau * 3.1 * t).sin();
        phase = (phase + f0 / fs) % 1.0;
        // Glottal-like pulse: a short decaying spike per period.
        let pulse = (-phase * 30.0).exp() - 0.06;
        let excitation = match syl % 4 {
            3 => 0.0,
            2 => 0.3 * noise(),
            _ => pulse + 0.02 * noise(),
        };
        let mut y = 0.0;
        for ((a1, a2), (s1, s2)) in formants.iter().zip(state.iter_mut()) {
            let v = excitation + a1 * *s1 + a2 * *s2;
            *s2 = *s1;
            *s1 = v;
            y += v;
        }
        out.push(y * env);
    }
    let peak = out.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    out.iter().map(|v| 0.7 * v / peak).collect()
}

/// One measured row.
struct Row {
    what: String,
    /// µs per 20 ms frame: median and fastest round.
    median: f64,
    min: f64,
    rounds: usize,
}

/// Runs `round` (which processes `frames` frames and returns a value kept
/// from the optimiser) until `budget` has passed, at least 5 times, after
/// one warm-up round; per-frame cost per round.
fn measure(what: &str, frames: usize, budget: Duration, mut round: impl FnMut() -> usize) -> Row {
    black_box(round());
    let mut per_frame = Vec::new();
    let start = Instant::now();
    while per_frame.len() < 5 || start.elapsed() < budget {
        let t = Instant::now();
        black_box(round());
        per_frame.push(t.elapsed().as_secs_f64() * 1e6 / frames as f64);
    }
    per_frame.sort_by(f64::total_cmp);
    Row {
        what: what.to_string(),
        median: per_frame[per_frame.len() / 2],
        min: per_frame[0],
        rounds: per_frame.len(),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let secs: f64 = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 2.0,
    };
    let budget = Duration::from_secs_f64(secs);
    let frames = SIGNAL_SECONDS * 50;
    let mut rows = Vec::new();

    // Opus, raw packets as RTP carries them: 48 kHz mono, VoIP, auto bitrate.
    let x48 = speech(48_000);
    let x48_i16: Vec<i16> = x48.iter().map(|&v| f32_to_i16(v)).collect();
    let default_complexity = OpusFrameEncoder::new(48_000)?.complexity()?;
    for complexity in [None, Some(5), Some(1)] {
        let mut enc = OpusFrameEncoder::new(48_000)?;
        let label = match complexity {
            None => format!("Opus encode, 48 kHz mono, VoIP, default bitrate (complexity {default_complexity}, the default)"),
            Some(c) => {
                enc.set_complexity(c)?;
                format!("Opus encode, 48 kHz mono, VoIP, default bitrate, complexity {c}")
            }
        };
        rows.push(measure(&label, frames, budget, || {
            let mut bytes = 0;
            for f in x48_i16.chunks_exact(960) {
                bytes += enc.encode(f).map(|p| p.len()).unwrap_or(0);
            }
            bytes
        }));
    }
    let mut enc = OpusFrameEncoder::new(48_000)?;
    let packets: Vec<Vec<u8>> = x48_i16
        .chunks_exact(960)
        .map(|f| enc.encode(f))
        .collect::<Result<_, _>>()?;
    let kbps = packets.iter().map(|p| p.len()).sum::<usize>() as f64 * 8.0
        / SIGNAL_SECONDS as f64
        / 1000.0;
    let mut dec = OpusFrameDecoder::new(48_000)?;
    rows.push(measure("Opus decode, 48 kHz mono", frames, budget, || {
        let mut n = 0;
        for p in &packets {
            n += dec.decode(p).map(|y| y.len()).unwrap_or(0);
        }
        n
    }));
    let mut dec = OpusFrameDecoder::new(48_000)?;
    rows.push(measure(
        "Opus decode, 48 kHz mono, every 5th frame lost (concealed)",
        frames,
        budget,
        || {
            let mut n = 0;
            for (k, p) in packets.iter().enumerate() {
                n += if k % 5 == 4 {
                    dec.decode_lost().len()
                } else {
                    dec.decode(p).map(|y| y.len()).unwrap_or(0)
                };
            }
            n
        },
    ));

    // The streaming resampler, fed 20 ms of input per call.
    for (from, to) in [
        (22_050u32, 48_000u32),
        (24_000, 48_000),
        (48_000, 16_000),
        (48_000, 24_000),
        (8_000, 24_000),
        (24_000, 8_000),
    ] {
        let x = speech(from);
        // 22,050 Hz: 441 samples is exactly 20 ms.
        let chunk = from as usize / 50;
        let mut r = StreamResampler::new(from, to)?;
        rows.push(measure(
            &format!("Resample {from} -> {to} Hz"),
            frames,
            budget,
            || {
                let mut n = 0;
                for c in x.chunks(chunk) {
                    n += r.process(c).map(|y| y.len()).unwrap_or(0);
                }
                n
            },
        ));
    }

    // G.711 at 8 kHz: 160 samples a frame.
    let x8: Vec<i16> = speech(8_000).iter().map(|&v| f32_to_i16(v)).collect();
    rows.push(measure(
        "G.711 μ-law encode, 8 kHz",
        frames,
        budget,
        || {
            x8.chunks_exact(160)
                .map(|f| g711::ulaw_encode(f).len())
                .sum()
        },
    ));
    let codes = g711::ulaw_encode(&x8);
    rows.push(measure(
        "G.711 μ-law decode, 8 kHz",
        frames,
        budget,
        || {
            codes
                .chunks_exact(160)
                .map(|f| g711::ulaw_decode(f).len())
                .sum()
        },
    ));
    rows.push(measure("G.711 A-law encode, 8 kHz", frames, budget, || {
        x8.chunks_exact(160)
            .map(|f| g711::alaw_encode(f).len())
            .sum()
    }));

    // Ogg Opus as the HTTP endpoints stream it: 24 kHz speech in (resampled
    // to 48 kHz inside), and the streaming decoder on its output.
    let x24 = speech(24_000);
    rows.push(measure(
        "Ogg Opus encode (OggOpusEncoder), 24 kHz in, auto bitrate",
        frames,
        budget,
        || {
            let mut e = match OggOpusEncoder::new(24_000, None) {
                Ok(e) => e,
                Err(_) => return 0,
            };
            let mut n = 0;
            for c in x24.chunks(480) {
                n += e.push(c).map(|b| b.len()).unwrap_or(0);
            }
            n + e.finish().map(|b| b.len()).unwrap_or(0)
        },
    ));
    let mut e = OggOpusEncoder::new(24_000, None)?;
    let mut ogg = Vec::new();
    for c in x24.chunks(480) {
        ogg.extend(e.push(c)?);
    }
    ogg.extend(e.finish()?);
    rows.push(measure(
        "Ogg Opus decode (OggOpusDecoder), 48 kHz out",
        frames,
        budget,
        || {
            let mut d = OggOpusDecoder::new();
            // Network-sized pieces.
            let n = ogg
                .chunks(1400)
                .map(|c| d.push(c).map(|y| y.len()).unwrap_or(0))
                .sum();
            d.finish().map(|_| n).unwrap_or(0)
        },
    ));

    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let profile = if cfg!(debug_assertions) {
        "dev"
    } else {
        "release"
    };
    println!(
        "CPU: {cpu}, {cores} cores, {} build, one thread; {secs} s per row; \
         Opus {}; 48 kHz VoIP packets average {kbps:.1} kb/s on this input.\n",
        profile,
        opus::version()
    );
    println!("| Operation (per 20 ms frame) | µs, median | µs, fastest round | frames/s of one core | real-time streams per core | rounds |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.2} | {:.2} | {:.0} | {:.0} | {} |",
            r.what,
            r.median,
            r.min,
            1e6 / r.median,
            20_000.0 / r.median,
            r.rounds
        );
    }
    Ok(())
}
