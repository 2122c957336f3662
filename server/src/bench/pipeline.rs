//! `bench-pipeline`: the in-process pipeline benchmark. Configurations are
//! compared in one run, interleaved request by request, so that machine noise
//! hits both alike; ratios are the figures to quote. Percentiles as in
//! `bench::metrics` (linear between ranks).

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use omnistream_stages::engine::{Modalities, SamplingOverrides};
use serde::Serialize;

use super::machine;
use super::metrics::{summarize, Summary};
use crate::run::{chat_spec, load_profile, run_request, speech_spec};

/// Short questions: the Thinker answers in a sentence or two.
const PROMPTS: &[&str] = &[
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "Which planet do we live on?",
    "What animal says moo?",
    "What season comes after winter?",
];

/// Sentences for the Talker + Code2Wav real-time factor.
const SENTENCES: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech should start playing long before the answer is complete.",
    "Please call me back tomorrow morning at nine o'clock.",
    "A staged pipeline joins a thinker, a talker and a waveform decoder.",
];

#[derive(Debug, Serialize)]
struct Report {
    schema: &'static str,
    profile: String,
    machine: String,
    requests: usize,
    warmup: usize,
    ttfp_ms_async: Summary,
    ttfp_ms_sync: Summary,
    ttfp_p50_ratio_sync_over_async: f64,
    ttft_ms_async: Summary,
    audio_seconds_per_answer: Summary,
    /// Talker + Code2Wav alone on given text (pipelines whose Talker speaks text).
    tts_rtf: Option<Summary>,
    /// A whole spoken answer (Thinker, Talker, Code2Wav) over its audio length,
    /// async_chunk on.
    answer_rtf: Summary,
    thinker_tok_s_single: f64,
    thinker_tok_s_batch8: f64,
    peak_rss_mib: f64,
}

/// Peak resident memory of this process (VmHWM).
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

pub fn bench_pipeline(
    profile_path: &Path,
    requests: usize,
    warmup: usize,
    out: &Path,
) -> Result<()> {
    let (base, _) = crate::profile::load(profile_path)?;
    let mut on = base.clone();
    on.async_chunk = true;
    let mut off = base.clone();
    off.async_chunk = false;
    eprintln!(
        "loading two pipelines (async_chunk on / off) from {}",
        profile_path.display()
    );
    let p_on = load_profile(&on)?;
    let p_off = load_profile(&off)?;

    let bar = indicatif::ProgressBar::new((2 * (requests + warmup)) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>14} {bar:40} {pos}/{len} [{elapsed}]")
            .context("progress bar template")?,
    );
    bar.set_message("TTFP on/off");
    let (mut ttfp_on, mut ttfp_off, mut ttft_on, mut audio_s) = (vec![], vec![], vec![], vec![]);
    let mut answer_rtf = vec![];
    for i in 0..(requests + warmup) {
        // Unique prompts: the prefix cache may reuse the system prompt, never a
        // whole earlier question.
        let prompt = format!("Question {}: {}", i + 1, PROMPTS[i % PROMPTS.len()]);
        let sampling = SamplingOverrides {
            max_tokens: Some(48),
            ..Default::default()
        };
        // Alternate which configuration goes first.
        let order: [bool; 2] = if i % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for is_on in order {
            let p = if is_on { &p_on } else { &p_off };
            let o = run_request(
                p,
                chat_spec(&prompt, Modalities::TEXT_AUDIO, sampling.clone()),
                |_| {},
            )?;
            bar.inc(1);
            if i < warmup {
                continue;
            }
            let ttfp = o.ttfp.context("an answer produced no audio")?.as_secs_f64() * 1e3;
            if is_on {
                ttfp_on.push(ttfp);
                ttft_on.push(o.ttft.map_or(0.0, |d| d.as_secs_f64() * 1e3));
                audio_s.push(o.audio_seconds());
                answer_rtf.push(o.total.as_secs_f64() / o.audio_seconds().max(1e-9));
            } else {
                ttfp_off.push(ttfp);
            }
        }
    }

    bar.set_message("TTS RTF");
    let mut rtf = vec![];
    // A Talker that speaks only its Thinker's states (Qwen3-Omni) has no TTS path.
    if p_on.speaks_text() {
        for s in SENTENCES.iter().cycle().take(requests.max(SENTENCES.len())) {
            let o = run_request(&p_on, speech_spec(s, None, None), |_| {})?;
            // Whole synthesis time over audio length: the cost of speech alone.
            rtf.push(o.total.as_secs_f64() / o.audio_seconds().max(1e-9));
        }
    }

    bar.set_message("Thinker tok/s");
    let text_only = |n: usize| -> Result<f64> {
        let sampling = SamplingOverrides {
            max_tokens: Some(64),
            ignore_eos: true,
            ..Default::default()
        };
        let t0 = Instant::now();
        let handles: Vec<_> = (0..n)
            .map(|i| {
                p_on.submit(chat_spec(
                    PROMPTS[i % PROMPTS.len()],
                    Modalities::TEXT,
                    sampling.clone(),
                ))
            })
            .collect::<Result<_, _>>()?;
        let mut tokens = 0;
        for h in &handles {
            loop {
                match h.next_event() {
                    Some(omnistream_stages::engine::Event::Done {
                        completion_tokens, ..
                    }) => {
                        tokens += completion_tokens;
                        break;
                    }
                    Some(omnistream_stages::engine::Event::Error(e)) => anyhow::bail!(e),
                    Some(_) => {}
                    None => anyhow::bail!("request ended without Done"),
                }
            }
        }
        Ok(tokens as f64 / t0.elapsed().as_secs_f64())
    };
    text_only(1)?; // warm-up
    let tok_single = text_only(1)?;
    let tok_batch = text_only(8)?;
    bar.finish_and_clear();

    let s_on = summarize(&ttfp_on);
    let s_off = summarize(&ttfp_off);
    let report = Report {
        schema: "omnistream.bench-pipeline.v1",
        profile: profile_path.display().to_string(),
        machine: machine(),
        requests,
        warmup,
        ttfp_p50_ratio_sync_over_async: s_off.median / s_on.median.max(1e-9),
        ttfp_ms_async: s_on,
        ttfp_ms_sync: s_off,
        ttft_ms_async: summarize(&ttft_on),
        audio_seconds_per_answer: summarize(&audio_s),
        tts_rtf: (!rtf.is_empty()).then(|| summarize(&rtf)),
        answer_rtf: summarize(&answer_rtf),
        thinker_tok_s_single: tok_single,
        thinker_tok_s_batch8: tok_batch,
        peak_rss_mib: peak_rss_mib(),
    };
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(out.join("bench-pipeline.json"), &json)?;
    let md = markdown(&report);
    std::fs::write(out.join("bench-pipeline.md"), &md)?;
    println!("{md}");
    Ok(())
}

fn markdown(r: &Report) -> String {
    let row = |name: &str, s: &Summary| {
        // Ratios (RTF) need three decimals; milliseconds one.
        let d = if s.mean < 10.0 { 3 } else { 1 };
        format!(
            "| {name} | {} | {:.d$} | {:.d$} | {:.d$} | {:.d$} |\n",
            s.n, s.mean, s.median, s.p90, s.p99
        )
    };
    let mut md = format!(
        "## bench-pipeline: {}\n\nMachine: {}. {} measured requests per configuration after {} warm-up, \
         concurrency 1, configurations interleaved in one run.\n\n\
         | metric | n | mean | median | p90 | p99 |\n|---|---|---|---|---|---|\n",
        r.profile, r.machine, r.requests, r.warmup
    );
    md += &row("TTFP ms, async_chunk on", &r.ttfp_ms_async);
    md += &row("TTFP ms, async_chunk off", &r.ttfp_ms_sync);
    md += &row("TTFT ms, async_chunk on", &r.ttft_ms_async);
    md += &row("audio s per answer", &r.audio_seconds_per_answer);
    md += &row("whole answer RTF, async_chunk on", &r.answer_rtf);
    if let Some(t) = &r.tts_rtf {
        md += &row("Talker+Code2Wav RTF (TTS)", t);
    }
    md += &format!(
        "\nTTFP p50 ratio off/on: **{:.2}x**. Thinker: {:.1} tok/s (1 sequence), {:.1} tok/s \
         (8 sequences batched). Peak RSS {:.0} MiB (both pipelines loaded).\n",
        r.ttfp_p50_ratio_sync_over_async,
        r.thinker_tok_s_single,
        r.thinker_tok_s_batch8,
        r.peak_rss_mib
    );
    md
}
