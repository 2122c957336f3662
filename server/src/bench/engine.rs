//! `bench-engine`: fixed-length workloads at set concurrencies, in-process, on
//! whatever device the profile names (the GPU benchmark of Qwen3-Omni at its
//! real shapes). Each level keeps `concurrency` requests in flight until
//! `requests` have finished; every answer is forced to its full length
//! (`ignore_eos`), so runs compare like for like, and each request has its own
//! prompt of the set length (words drawn by a seeded RNG): requests batched
//! together route to different experts, as different conversations do (one
//! prompt for all, with greedy decoding, gives every row the same tokens and so
//! the same few experts a layer). With random weights, greedy answers to
//! different prompts still fall into the same tokens after a while (the report's
//! `distinct_answer_tails` shows it); `--temperature` samples them instead, which
//! keeps the rows apart. Reports TTFT, TPOT, TTFP,
//! RTF, audio seconds per second and tokens per second, and, for a Qwen3-Omni
//! Thinker, the memory-bandwidth bound on its decode step.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use omnistream_stages::engine::ChatMessage;
use omnistream_stages::engine::{Modalities, Pipeline, SamplingOverrides};
use omnistream_stages::models::qwen3_omni::omni::Qwen3OmniConfig;
use omnistream_stages::models::tokenizer::ChatTokenizer;
use omnistream_stages::profile::{ModelType, StageKind};
use serde::{Deserialize, Serialize};

use super::machine;
use super::metrics::{summarize, Summary};
use super::pipeline::peak_rss_mib;
use crate::run::{chat_spec, load_profile, run_request, Outcome};

#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    #[command(flatten)]
    pub profile: crate::ProfileArg,
    /// Workload name in the report (e.g. `long`, `chat`).
    #[arg(long, default_value = "chat")]
    pub name: String,
    /// Prompt length in tokens (the chat template included).
    #[arg(long, default_value_t = 100)]
    pub prompt_tokens: usize,
    /// Answer length in tokens (generated to the end; end-of-turn ignored).
    #[arg(long, default_value_t = 200)]
    pub output_tokens: usize,
    /// Audio frames (80 ms each) every answer speaks: the Talker goes on past
    /// the text on `tts_pad`, as the model does until it draws its end code,
    /// which random weights never do. Default: one frame per text vector (every
    /// token but the last), 12.5 tokens a second, about four times faster than
    /// people talk (vLLM-Omni's published c=32 figures give 57.1 audio-s/s over
    /// 185.8 tok/s: 3.84 frames a token; 768 frames for 200 tokens).
    #[arg(long)]
    pub audio_frames: Option<usize>,
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub concurrency: Vec<usize>,
    /// Requests per level (default: the level's concurrency).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Text out only (no Talker, no Code2Wav).
    #[arg(long)]
    pub text_only: bool,
    /// Decode without CUDA graphs in every stage (the profile's `enforce_eager`),
    /// to measure what the graphs save: name the workload apart (`--name chat-eager`).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Sample the answers at this temperature (unseeded, so on a GPU each draw is
    /// a Gumbel-max on the device) instead of the profile's sampling. With random
    /// weights, greedy answers to different prompts fall into the same tokens
    /// (see `distinct_answer_tails` in the report), and batched rows then route to the
    /// same few experts; sampled ones stay apart, as real conversations do.
    #[arg(long)]
    pub temperature: Option<f64>,
    /// H200 HBM3e bandwidth, bytes/s, for the decode-step bound.
    #[arg(long, default_value_t = 4.8e12)]
    pub bandwidth: f64,
    /// Folder for `engine-<name>[-text].json`, `.md` and the PNG plots.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// Run nothing: draw the plots of these earlier reports (JSON) into `--out`.
    #[arg(long, num_args = 1..)]
    pub plot: Vec<PathBuf>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Level {
    concurrency: usize,
    requests: usize,
    wall_s: f64,
    ttft_ms: Summary,
    tpot_ms: Summary,
    ttfp_ms: Option<Summary>,
    /// Request time over its audio length.
    rtf: Option<Summary>,
    audio_s_per_s: f64,
    tok_s: f64,
    /// The Thinker's decode-step lower bound at this batch (weights read once per
    /// step at `bandwidth`), and mean TPOT over it.
    thinker_step_bound_ms: Option<f64>,
    tpot_over_bound: Option<f64>,
    /// Per stage over the level: steps, mean step time and batch, and the share of
    /// the wall time its worker spent stepping.
    #[serde(default)]
    stages: Vec<StageLevel>,
    /// How many different second halves (by characters) the level's answers
    /// have: 1 means every request decoded the same text there, so its batched
    /// rows routed to the same experts.
    #[serde(default)]
    distinct_answer_tails: Option<usize>,
}

#[derive(Debug, Serialize, Deserialize)]
struct StageLevel {
    name: String,
    steps: u64,
    step_ms: f64,
    batch: f64,
    busy: f64,
}

/// What each stage did between two snapshots of the pipeline's counters.
fn stage_levels(
    before: &omnistream_stages::engine::PipelineStats,
    after: &omnistream_stages::engine::PipelineStats,
    wall: f64,
) -> Vec<StageLevel> {
    before
        .stages
        .iter()
        .zip(&after.stages)
        .map(|(b, a)| {
            let steps = a.steps - b.steps;
            let secs = a.step_seconds_total - b.step_seconds_total;
            let items = a.batch_items_total - b.batch_items_total;
            StageLevel {
                name: a.name.clone(),
                steps,
                step_ms: secs * 1e3 / steps.max(1) as f64,
                batch: items as f64 / steps.max(1) as f64,
                busy: secs / wall,
            }
        })
        .collect()
}

#[derive(Debug, Serialize, Deserialize)]
struct Report {
    schema: String,
    profile: String,
    machine: String,
    workload: String,
    prompt_tokens: usize,
    output_tokens: usize,
    /// Frames each answer spoke (`None`: one per text vector).
    #[serde(default)]
    audio_frames: Option<usize>,
    text_only: bool,
    /// Decode steps ran eagerly (no CUDA graphs).
    #[serde(default)]
    enforce_eager: bool,
    /// Each request had its own prompt (reports before this field gave every
    /// request the same one).
    #[serde(default)]
    distinct_prompts: bool,
    /// The answers' sampling temperature (`None`: the profile's, greedy here).
    #[serde(default)]
    temperature: Option<f64>,
    levels: Vec<Level>,
    peak_rss_mib: f64,
}

pub fn bench_engine(args: EngineArgs) -> Result<()> {
    if !args.plot.is_empty() {
        let reports = args
            .plot
            .iter()
            .map(|p| {
                let label = p
                    .file_stem()
                    .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading {}", p.display()))?;
                let r: Report = serde_json::from_str(&text)
                    .with_context(|| format!("parsing {}", p.display()))?;
                Ok((label, r))
            })
            .collect::<Result<Vec<_>>>()?;
        return plot(&reports, &args.out);
    }
    let (mut profile, _) = crate::profile::load(&args.profile.profile)?;
    if args.enforce_eager {
        for s in profile.stages.iter_mut().filter(|s| {
            s.kind == StageKind::Ar || s.model.model_type == ModelType::Qwen3OmniCode2wav
        }) {
            s.enforce_eager = true;
        }
    }
    let thinker = profile
        .stages
        .first()
        .filter(|s| s.model.model_type == ModelType::Qwen3OmniThinker)
        .context("bench-engine drives a Qwen3-Omni Thinker profile")?;
    let tok_dir = profile.resolve(
        thinker
            .model
            .tokenizer
            .as_ref()
            .unwrap_or(&thinker.model.path),
    );
    let tokenizer = ChatTokenizer::from_hf_dir(&tok_dir)
        .with_context(|| format!("tokenizer in {}", tok_dir.display()))?;
    let most = args
        .concurrency
        .iter()
        .map(|&c| args.requests.unwrap_or(c).max(c))
        .max()
        .unwrap_or(1)
        .max(2);
    let prompts = (0..most)
        .map(|i| prompt_of_length(&tokenizer, args.prompt_tokens, i as u64))
        .collect::<Result<Vec<_>>>()?;
    let cfg =
        Qwen3OmniConfig::from_file(&profile.resolve(&thinker.model.path).join("config.json"))?;
    let weight_bytes = if thinker.model.dtype == omnistream_stages::profile::Dtype::Bf16 {
        2.0
    } else {
        4.0
    };

    eprintln!("loading {}", args.profile.profile.display());
    let pipeline = load_profile(&profile)?;
    // Every stage's start-up work (CUDA graph captures) done before the clock
    // runs: otherwise it shares the GPU with the first level.
    let t = Instant::now();
    while !pipeline.stats().stages.iter().all(|s| s.alive) {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(600),
            "stages not started after 10 minutes"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let modalities = if args.text_only {
        Modalities::TEXT
    } else {
        Modalities::TEXT_AUDIO
    };
    let sampling = SamplingOverrides {
        max_tokens: Some(args.output_tokens),
        ignore_eos: true,
        temperature: args.temperature,
        audio_frames: args.audio_frames,
        ..Default::default()
    };
    // Warm-up, a small batch and the largest level: every kernel of both
    // (small and large prefills take different ones) is compiled (PTX JIT), and
    // every CUDA graph bucket the levels reach (batch, key/value length) is
    // captured, before the clock runs.
    let top = args.concurrency.iter().copied().max().unwrap_or(1);
    for c in std::iter::once(2).chain((top > 2).then_some(top)) {
        eprintln!("warm-up: {c} requests");
        run_level(&pipeline, &prompts, modalities, &sampling, c, c)?;
    }

    let mut levels = Vec::new();
    for &c in &args.concurrency {
        let n = args.requests.unwrap_or(c).max(c);
        eprintln!("concurrency {c}: {n} requests");
        let start = Instant::now();
        let before = pipeline.stats();
        let done = run_level(&pipeline, &prompts, modalities, &sampling, c, n)?;
        let wall = start.elapsed().as_secs_f64();
        let stages = stage_levels(&before, &pipeline.stats(), wall);
        for st in &stages {
            eprintln!(
                "  {}: {} steps, {:.2} ms per step, batch {:.1}, busy {:.0}%",
                st.name,
                st.steps,
                st.step_ms,
                st.batch,
                st.busy * 100.0
            );
        }
        let tails = distinct_tails(&done);
        eprintln!(
            "  answers: {tails} different second halves of {}",
            done.len()
        );
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let tpot: Vec<f64> = done
            .iter()
            .filter(|t| t.completion_tokens > 1)
            .filter_map(|t| Some(ms(t.last_text? - t.ttft?) / (t.completion_tokens - 1) as f64))
            .collect();
        let audio: f64 = done.iter().map(Outcome::audio_seconds).sum();
        let tokens: usize = done.iter().map(|t| t.completion_tokens).sum();
        let bound = thinker_step_bound(&cfg, c, weight_bytes, args.bandwidth);
        let tpot = summarize(&tpot);
        levels.push(Level {
            concurrency: c,
            requests: n,
            wall_s: wall,
            ttft_ms: summarize(
                &done
                    .iter()
                    .map(|t| ms(t.ttft.unwrap_or(t.total)))
                    .collect::<Vec<_>>(),
            ),
            ttfp_ms: (!args.text_only).then(|| {
                summarize(
                    &done
                        .iter()
                        .filter_map(|t| t.ttfp.map(ms))
                        .collect::<Vec<_>>(),
                )
            }),
            rtf: (!args.text_only).then(|| {
                summarize(
                    &done
                        .iter()
                        .filter(|t| t.audio_seconds() > 0.0)
                        .map(|t| t.total.as_secs_f64() / t.audio_seconds())
                        .collect::<Vec<_>>(),
                )
            }),
            audio_s_per_s: audio / wall,
            tok_s: tokens as f64 / wall,
            thinker_step_bound_ms: Some(bound * 1e3),
            tpot_over_bound: Some(tpot.mean / (bound * 1e3)),
            tpot_ms: tpot,
            stages,
            distinct_answer_tails: Some(tails),
        });
    }
    let report = Report {
        schema: "omnistream.bench-engine.v1".into(),
        profile: args.profile.profile.display().to_string(),
        machine: machine(),
        workload: args.name.clone(),
        prompt_tokens: args.prompt_tokens,
        output_tokens: args.output_tokens,
        audio_frames: args.audio_frames.filter(|_| !args.text_only),
        text_only: args.text_only,
        enforce_eager: args.enforce_eager,
        distinct_prompts: true,
        temperature: args.temperature,
        levels,
        peak_rss_mib: peak_rss_mib(),
    };
    write_report(&report, &args.out)?;
    let label = format!("{}{}", args.name, if args.text_only { " text" } else { "" });
    // The report is written; a machine without fonts (the GPU host) still gets it,
    // and `--plot` draws the figures later where fonts are.
    if let Err(e) = plot(&[(label, report)], &args.out) {
        eprintln!("warning: no plots: {e:#}");
    }
    Ok(())
}

/// How many different second halves the answers' texts have.
fn distinct_tails(done: &[Outcome]) -> usize {
    let tails: std::collections::HashSet<String> = done
        .iter()
        .map(|o| {
            let chars: Vec<char> = o.text.chars().collect();
            chars[chars.len() / 2..].iter().collect()
        })
        .collect();
    tails.len()
}

/// Request `seed`'s user message: common words drawn by a seeded RNG, as many
/// as keep the templated prompt at `n` tokens (or the nearest below).
fn prompt_of_length(tok: &ChatTokenizer, n: usize, seed: u64) -> Result<String> {
    use rand::{Rng, SeedableRng};
    const WORDS: [&str; 48] = [
        "the", "sea", "river", "light", "stone", "window", "garden", "morning", "city", "road",
        "music", "paper", "winter", "summer", "friend", "story", "table", "bread", "water",
        "train", "quiet", "bright", "small", "old", "green", "cold", "fast", "slow", "happy",
        "long", "walks", "sings", "reads", "opens", "finds", "keeps", "takes", "makes", "and",
        "with", "under", "over", "near", "every", "night", "house", "cloud", "field",
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let words: Vec<&str> = (0..n.max(1) * 2)
        .map(|_| WORDS[rng.gen_range(0..WORDS.len())])
        .collect();
    let text = |count: usize| words[..count.min(words.len())].join(" ");
    let len = |count: usize| -> Result<usize> {
        let t = tok.apply_chat_template(&[ChatMessage::user(text(count))], true)?;
        Ok(tok.encode(&t)?.len())
    };
    let (mut lo, mut hi) = (0usize, n.max(1));
    while len(hi)? < n && hi < words.len() {
        hi = (hi * 2).min(words.len());
    }
    // The largest word count whose prompt is at most n tokens.
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if len(mid)? <= n {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(text(lo))
}

/// The Thinker's decode step at batch `b`, if it only read its weights once at
/// `bandwidth`: attention, norms, the head and every dense layer; of each MoE
/// layer the router and the experts that `b` tokens are expected to pick.
fn thinker_step_bound(cfg: &Qwen3OmniConfig, b: usize, bytes: f64, bandwidth: f64) -> f64 {
    let t = &cfg.thinker.text_config;
    let (h, hd) = (t.hidden_size as f64, t.head_dim() as f64);
    let attn = h * hd * (2.0 * t.num_attention_heads as f64 + 2.0 * t.num_key_value_heads as f64);
    let expert = 3.0 * h * t.moe_intermediate_size as f64;
    let (e, k) = (t.num_experts as f64, t.num_experts_per_tok as f64);
    let touched = e * (1.0 - (1.0 - k / e).powi(b as i32));
    let mut params = h * t.vocab_size as f64; // lm_head
    for i in 0..t.num_hidden_layers {
        params += attn;
        params += if t.is_sparse_layer(i) {
            h * e + touched * expert
        } else {
            3.0 * h * t.intermediate_size as f64
        };
    }
    params * bytes / bandwidth
}

/// Keeps `c` requests in flight until `n` have finished.
fn run_level(
    pipeline: &Pipeline,
    prompts: &[String],
    modalities: Modalities,
    sampling: &SamplingOverrides,
    c: usize,
    n: usize,
) -> Result<Vec<Outcome>> {
    let next = AtomicUsize::new(0);
    let results = std::thread::scope(|s| {
        let workers: Vec<_> = (0..c)
            .map(|_| {
                s.spawn(|| -> Result<Vec<Outcome>> {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        if i >= n {
                            break;
                        }
                        let prompt = &prompts[i % prompts.len()];
                        let spec = chat_spec(prompt, modalities, sampling.clone());
                        mine.push(run_request(pipeline, spec, |_| {})?);
                    }
                    Ok(mine)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .map_err(|_| anyhow::anyhow!("a bench thread panicked"))?
            })
            .collect::<Result<Vec<_>>>()
    })?;
    Ok(results.into_iter().flatten().collect())
}

fn write_report(r: &Report, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let stem = format!(
        "engine-{}{}",
        r.workload,
        if r.text_only { "-text" } else { "" }
    );
    let json = out.join(format!("{stem}.json"));
    std::fs::write(&json, serde_json::to_string_pretty(r)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let opt = |s: &Option<Summary>| {
        s.as_ref()
            .map_or("-".to_string(), |s| format!("{:.0}", s.mean))
    };
    let frames = r
        .audio_frames
        .map_or(String::new(), |n| format!(", {n} audio frames"));
    let mut md = format!(
        "# {} (prompt {}, answer {} tokens{}{}{}) on {}\n\n\
         | c | requests | TTFT mean ms | TPOT mean ms | TTFP mean ms | RTF mean | audio-s/s | tok/s | step bound ms | TPOT / bound |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
        r.workload,
        r.prompt_tokens,
        r.output_tokens,
        if r.text_only { ", text only" } else { ", audio on" },
        frames,
        if r.enforce_eager { ", eager" } else { "" },
        r.machine
    );
    for l in &r.levels {
        md.push_str(&format!(
            "| {} | {} | {:.0} | {:.1} | {} | {} | {:.1} | {:.0} | {:.2} | {:.1} |\n",
            l.concurrency,
            l.requests,
            l.ttft_ms.mean,
            l.tpot_ms.mean,
            opt(&l.ttfp_ms),
            l.rtf
                .as_ref()
                .map_or("-".to_string(), |s| format!("{:.3}", s.mean)),
            l.audio_s_per_s,
            l.tok_s,
            l.thinker_step_bound_ms.unwrap_or(0.0),
            l.tpot_over_bound.unwrap_or(0.0),
        ));
    }
    let path = out.join(format!("{stem}.md"));
    std::fs::write(&path, &md).with_context(|| format!("writing {}", path.display()))?;
    print!("{md}");
    Ok(())
}

/// One plotted quantity of a report's levels.
type Pick = fn(&Level) -> Option<f64>;

/// TTFP, RTF, audio throughput and tokens per second against concurrency, one
/// line per report, as `engine-*.png` in `out`.
fn plot(reports: &[(String, Report)], out: &Path) -> Result<()> {
    use super::plot::{line_chart, ChartSpec, Line};
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let charts: [(&str, &str, &str, Option<f64>, Pick); 4] = [
        (
            "engine-ttfp.png",
            "Time to first audio (mean)",
            "TTFP (ms)",
            None,
            |l| l.ttfp_ms.as_ref().map(|s| s.mean),
        ),
        (
            "engine-rtf.png",
            "Audio real-time factor (mean; below 1 keeps up)",
            "RTF",
            Some(1.0),
            |l| l.rtf.as_ref().map(|s| s.mean),
        ),
        (
            "engine-audio.png",
            "Audio throughput",
            "audio seconds per second",
            None,
            |l| (l.audio_s_per_s > 0.0).then_some(l.audio_s_per_s),
        ),
        (
            "engine-tokens.png",
            "Text throughput",
            "tokens per second",
            None,
            |l| Some(l.tok_s),
        ),
    ];
    for (file, title, y_label, reference, pick) in charts {
        let lines: Vec<Line> = reports
            .iter()
            .enumerate()
            .map(|(i, (label, r))| Line {
                label: label.clone(),
                points: r
                    .levels
                    .iter()
                    .filter_map(|l| pick(l).map(|y| (l.concurrency as f64, y)))
                    .collect(),
                color: i,
                bold: true,
            })
            .filter(|l| !l.points.is_empty())
            .collect();
        if lines.is_empty() {
            continue;
        }
        let path = out.join(file);
        let spec = ChartSpec {
            title,
            x_label: "concurrency",
            y_label,
            reference,
        };
        line_chart(&path, &spec, &lines).with_context(|| format!("drawing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
