//! What Silero VAD costs per second of audio, per stream.
//!
//! Runs the model window by window over a fixture WAV (looped to `--seconds` of audio,
//! default 60) and prints, per weights file, the time per 32 ms step, the CPU ms spent
//! per second of audio and the real-time factor; then the same for the turn segmenter
//! (`VadSegmenter::push` in 20 ms chunks, model included).
//!
//! `cargo run -p omnistream-stages --example vad_cost [-- --wav speech.wav --seconds 60]`
//! (the dev profile is optimised here; `--release` works too)
//! (WAV names are looked up in stages/testdata/silero_vad/; needs models/silero-vad).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use omnistream_stages::models::silero_vad::{SileroVad, ONNX_FILE, SAFETENSORS_FILE};
use omnistream_stages::vad::{VadConfig, VadSegmenter};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const SAMPLE_RATE: usize = 16_000;

/// A 16 kHz mono 16-bit PCM WAV as samples / 32768.
fn read_wav(path: &Path) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() < 12 || &bytes[0..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        return Err(format!("{}: not a WAV file", path.display()).into());
    }
    let mut at = 12;
    while at + 8 <= bytes.len() {
        let len = u32::from_le_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]])
            as usize;
        let body = &bytes[at + 8..(at + 8 + len).min(bytes.len())];
        match &bytes[at..at + 4] {
            b"fmt " if body.len() >= 16 => {
                let channels = u16::from_le_bytes([body[2], body[3]]);
                let rate = u32::from_le_bytes([body[4], body[5], body[6], body[7]]);
                let bits = u16::from_le_bytes([body[14], body[15]]);
                if (channels, rate, bits) != (1, SAMPLE_RATE as u32, 16) {
                    return Err(format!(
                        "{}: {channels} ch, {rate} Hz, {bits} bit; want mono 16 kHz 16-bit",
                        path.display()
                    )
                    .into());
                }
            }
            b"data" => {
                return Ok(body
                    .chunks_exact(2)
                    .map(|b| i16::from_le_bytes([b[0], b[1]]) as f32 / 32768.0)
                    .collect())
            }
            _ => {}
        }
        at += 8 + len + (len & 1);
    }
    Err(format!("{}: no data chunk", path.display()).into())
}

/// CPU time of the calling thread, in ns resolution (Linux schedstat; None elsewhere).
fn thread_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// This process's user + system CPU time, all threads, in 10 ms ticks (Linux /proc).
fn process_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the ")" that ends the command name; utime and stime are 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux this runs on.
    Some(Duration::from_millis(ticks * 10))
}

struct Row {
    what: String,
    steps: usize,
    wall: Duration,
    thread_cpu: Option<Duration>,
    process_cpu: Option<Duration>,
    audio_s: f64,
}

impl Row {
    fn print(&self) {
        let per_s = |d: Duration| d.as_secs_f64() * 1e3 / self.audio_s;
        let cpu = |d: Option<Duration>| {
            d.map(|c| format!("{:>10.2}", per_s(c)))
                .unwrap_or_else(|| format!("{:>10}", "n/a"))
        };
        println!(
            "{:<48} {:>6} {:>8.1} {} {} {:>10.2} {:>8.5}",
            self.what,
            self.steps,
            self.wall.as_secs_f64() * 1e6 / self.steps as f64,
            cpu(self.thread_cpu),
            cpu(self.process_cpu),
            per_s(self.wall),
            self.wall.as_secs_f64() / self.audio_s,
        );
    }
}

fn measure(
    what: String,
    audio_s: f64,
    steps: usize,
    run: impl FnOnce() -> Result<()>,
) -> Result<Row> {
    let (thread0, process0) = (thread_cpu_time(), process_cpu_time());
    let t = Instant::now();
    run()?;
    let wall = t.elapsed();
    let since =
        |a: Option<Duration>, b: Option<Duration>| a.zip(b).map(|(a, b)| b.saturating_sub(a));
    Ok(Row {
        what,
        steps,
        wall,
        thread_cpu: since(thread0, thread_cpu_time()),
        process_cpu: since(process0, process_cpu_time()),
        audio_s,
    })
}

fn main() -> Result<()> {
    let mut wav = "mix.wav".to_string();
    let mut seconds = 60.0f64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--wav" => wav = args.next().ok_or("--wav needs a file name")?,
            "--seconds" => {
                seconds = args.next().ok_or("--seconds needs a number")?.parse()?;
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let wav_path = manifest.join("testdata/silero_vad").join(&wav);
    let clip = read_wav(&wav_path)?;
    if clip.len() < 512 {
        return Err(format!("{wav}: shorter than one window").into());
    }
    // Loop the clip to the requested length, whole windows only.
    let n = ((seconds * SAMPLE_RATE as f64) as usize / 512).max(1) * 512;
    let audio: Vec<f32> = clip.iter().copied().cycle().take(n).collect();
    let audio_s = n as f64 / SAMPLE_RATE as f64;
    let models_dir: PathBuf = manifest.join("../models/silero-vad");

    println!(
        "silero vad v6 16 kHz, {wav} looped to {audio_s:.1} s ({} windows of 32 ms), 1 stream, {} build",
        n / 512,
        if cfg!(debug_assertions) { "debug" } else { "release" }
    );
    println!("(ms/s: ms per second of audio; RTF: wall time / audio time)");
    println!(
        "{:<48} {:>6} {:>8} {:>10} {:>10} {:>10} {:>8}",
        "", "steps", "us/step", "thread cpu", "proc cpu", "wall", "RTF"
    );
    println!(
        "{:<48} {:>6} {:>8} {:>10} {:>10} {:>10} {:>8}",
        "", "", "(wall)", "ms/s", "ms/s", "ms/s", ""
    );
    for file in [ONNX_FILE, SAFETENSORS_FILE] {
        let vad = Arc::new(SileroVad::load(&models_dir.join(file), &Device::Cpu)?);
        // Warm-up: first calls allocate and page in.
        let mut state = vad.new_state();
        for w in audio.chunks_exact(512).take(50) {
            vad.step(&mut state, w)?;
        }
        state.reset();
        let mut speech = 0usize;
        let row = measure(
            format!("SileroVad::step ({file})"),
            audio_s,
            n / 512,
            || {
                for w in audio.chunks_exact(512) {
                    if vad.step(&mut state, w)? >= 0.5 {
                        speech += 1;
                    }
                }
                Ok(())
            },
        )?;
        row.print();

        let mut seg = VadSegmenter::new(vad.clone(), VadConfig::default())?;
        let mut events = 0usize;
        let row = measure(
            format!("VadSegmenter::push ({file})"),
            audio_s,
            n / 512,
            || {
                for chunk in audio.chunks(320) {
                    events += seg.push(chunk)?.len();
                }
                Ok(())
            },
        )?;
        row.print();
        eprintln!(
            "  ({file}: {speech} of {} windows >= 0.5, {events} segmenter events)",
            n / 512
        );
    }
    Ok(())
}
