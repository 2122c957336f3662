//! The bench's results: a versioned JSON document, its Markdown rendering and
//! the ratios of every run to the first.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::metrics::{Figure, LevelMetrics, StageLoad, Summary};

/// Bumped whenever a field changes meaning or goes away.
pub const SCHEMA: &str = "omnistream.bench.v1";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub omnistream_version: String,
    /// Seconds since the Unix epoch when the sweep started.
    pub started_unix: u64,
    pub machine: String,
    /// The command line that produced this report.
    pub command: String,
    /// What every request asked for (endpoint, voice, token cap, ...).
    pub request: serde_json::Value,
    pub dataset: Dataset,
    pub runs: Vec<Run>,
    /// Every run after the first, metric by metric, over the first.
    pub ratios: Vec<Ratio>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Dataset {
    /// `random` or the prompts file.
    pub source: String,
    /// Words per random prompt (about one token each).
    pub input_len: Option<usize>,
    pub num_prompts: usize,
    pub warmup: usize,
    pub seed: u64,
}

/// One server configuration swept over every load level.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    pub label: String,
    /// The profile the bench started the server with (`--compare`).
    pub profile: Option<String>,
    pub url: String,
    /// What the server's stages ran on, from its `/health` (`cuda:0 (NVIDIA
    /// H200)`, `cpu`, `remote`), each once.
    #[serde(default)]
    pub devices: Vec<String>,
    pub levels: Vec<Level>,
}

/// How load was applied at one level.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum Load {
    /// A fixed number of requests in flight.
    Closed { concurrency: usize },
    /// Poisson arrivals at `rate` per second (none: all at once, `inf`), at
    /// most `max_concurrency` in flight.
    Open {
        rate: Option<f64>,
        max_concurrency: Option<usize>,
    },
}

impl Load {
    pub fn name(&self) -> String {
        match self {
            Load::Closed { concurrency } => format!("c={concurrency}"),
            Load::Open { rate: None, .. } => "rate=inf".into(),
            Load::Open { rate: Some(r), .. } => format!("rate={r}/s"),
        }
    }

    /// The plots' x value (0 for `rate=inf`, which a log axis cannot show).
    pub fn x(&self) -> f64 {
        match self {
            Load::Closed { concurrency } => *concurrency as f64,
            Load::Open { rate, .. } => rate.unwrap_or(0.0),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Level {
    pub load: Load,
    pub x: f64,
    #[serde(flatten)]
    pub metrics: LevelMetrics,
    /// Each stage's busy/wait share, batch and queue at this level.
    pub stages: Vec<StageLoad>,
    /// The first distinct failure messages (all failures are counted).
    pub errors: Vec<String>,
    /// The server's resident memory after the level, and its peak so far
    /// (MiB; from `/metrics`, absent when the server does not say).
    #[serde(default)]
    pub server_rss_mib: Option<f64>,
    #[serde(default)]
    pub server_peak_rss_mib: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ratio {
    pub label: String,
    pub baseline: String,
    pub load: String,
    /// metric name → this run's value / the baseline's.
    pub values: BTreeMap<String, f64>,
}

/// The figures compared between runs: what a change buys or costs.
const COMPARED: &[(&str, Figure)] = &[
    ("ttft_ms.median", |m| m.ttft_ms.median),
    ("tpot_ms.median", |m| m.tpot_ms.median),
    ("ttfp_ms.median", |m| m.ttfp_ms.median),
    ("ttfp_ms.p90", |m| m.ttfp_ms.p90),
    ("audio_rtf.median", |m| m.audio_rtf.median),
    ("e2el_ms.median", |m| m.e2el_ms.median),
    ("audio_throughput", |m| m.audio_throughput),
    ("output_tok_s", |m| m.output_tok_s),
    ("req_s", |m| m.req_s),
];

/// Each later run over the first, level by level (matched by load).
pub fn ratios(runs: &[Run]) -> Vec<Ratio> {
    let Some((base, rest)) = runs.split_first() else {
        return vec![];
    };
    let mut out = vec![];
    for run in rest {
        for level in &run.levels {
            let Some(b) = base.levels.iter().find(|l| l.load == level.load) else {
                continue;
            };
            let values = COMPARED
                .iter()
                .filter_map(|(name, f)| {
                    let (v, bv) = (f(&level.metrics), f(&b.metrics));
                    (bv > 0.0 && v.is_finite()).then(|| (name.to_string(), v / bv))
                })
                .collect();
            out.push(Ratio {
                label: run.label.clone(),
                baseline: base.label.clone(),
                load: level.load.name(),
                values,
            });
        }
    }
    out
}

fn ms(v: f64) -> String {
    format!("{v:.0}")
}

pub fn markdown(r: &Report) -> String {
    let mut md = format!(
        "# omnistream bench\n\n\
         - Machine: {}\n- Command: `{}`\n- Request: `{}`\n\
         - Dataset: {} ({} prompts per level{}, {} warm-up, seed {})\n\
         - omnistream {}, schema `{}`\n\n\
         Times in ms; RTF is seconds of compute per second of audio (below 1 keeps up); \
         p50/p90 interpolated between ranks.\n",
        r.machine,
        r.command,
        r.request,
        r.dataset.source,
        r.dataset.num_prompts,
        r.dataset
            .input_len
            .map_or(String::new(), |n| format!(", {n} words each")),
        r.dataset.warmup,
        r.dataset.seed,
        r.omnistream_version,
        r.schema,
    );
    for run in &r.runs {
        md += &format!(
            "\n## {}{}\n\n\
             | load | ok | failed | TTFT p50 | TTFT p90 | TPOT p50 | TTFP p50 | TTFP p90 | TTFP p99 | RTF p50 | RTF p90 | E2EL p50 | audio s/s | tok/s | req/s | server peak RSS MiB |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            run.label,
            run.profile
                .as_ref()
                .map_or(String::new(), |p| format!(" (`{p}`)")),
        );
        for l in &run.levels {
            let m = &l.metrics;
            md += &format!(
                "| {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {:.3} | {:.3} | {} | {:.2} | {:.1} | {:.2} | {} |\n",
                l.load.name(),
                m.completed,
                m.failed,
                ms(m.ttft_ms.median),
                ms(m.ttft_ms.p90),
                m.tpot_ms.median,
                ms(m.ttfp_ms.median),
                ms(m.ttfp_ms.p90),
                ms(m.ttfp_ms.p99),
                m.audio_rtf.median,
                m.audio_rtf.p90,
                ms(m.e2el_ms.median),
                m.audio_throughput,
                m.output_tok_s,
                m.req_s,
                l.server_peak_rss_mib.map_or("–".into(), |v| format!("{v:.0}")),
            );
        }
        if run.levels.iter().any(|l| l.metrics.underruns.n > 0) {
            md += "\nPlayback: each answer's audio played at real time from its first packet; \
                   an underrun is a moment the player ran dry.\n\n\
                   | load | gap-free (no gap over 100 ms) | underruns per request mean | p99 | silence per request mean ms | worst gap ms |\n\
                   |---|---|---|---|---|---|\n";
            for l in &run.levels {
                let m = &l.metrics;
                md += &format!(
                    "| {} | {:.0}% | {:.2} | {:.0} | {} | {} |\n",
                    l.load.name(),
                    m.gap_free_share * 100.0,
                    m.underruns.mean,
                    m.underruns.p99,
                    ms(m.gap_ms.mean),
                    ms(m.worst_gap_ms),
                );
            }
        }
        if run.levels.iter().any(|l| !l.stages.is_empty()) {
            md += "\nStages (from `/metrics`): busy and waiting-for-input as shares of the \
                   level's wall clock, mean batch per step, input queue depth and requests held (active) sampled every 250 ms.\n\n\
                   | load | stage | busy | waiting | steps | mean batch | queue mean | queue max | active mean |\n\
                   |---|---|---|---|---|---|---|---|---|\n";
            for l in &run.levels {
                for s in &l.stages {
                    md += &format!(
                        "| {} | {} | {:.0}% | {:.0}% | {} | {:.2} | {:.2} | {:.0} | {:.1} |\n",
                        l.load.name(),
                        s.stage,
                        s.busy_fraction * 100.0,
                        s.wait_fraction * 100.0,
                        s.steps,
                        s.mean_batch,
                        s.queue_depth_mean,
                        s.queue_depth_max,
                        s.active_mean,
                    );
                }
            }
        }
        md += "\n<details><summary>mean / median / p90 / p99</summary>\n\n\
               | load | metric | n | mean | median | p90 | p99 |\n|---|---|---|---|---|---|---|\n";
        for l in &run.levels {
            let m = &l.metrics;
            let rows: [(&str, &Summary); 10] = [
                ("TTFT ms", &m.ttft_ms),
                ("TPOT ms", &m.tpot_ms),
                ("TTFP ms", &m.ttfp_ms),
                ("turn end ms (VAD)", &m.turn_end_ms),
                ("turn end → audio ms", &m.turn_end_to_audio_ms),
                ("audio RTF", &m.audio_rtf),
                ("E2EL ms", &m.e2el_ms),
                ("input tokens", &m.input_tokens),
                ("output tokens", &m.output_tokens),
                ("audio s", &m.audio_seconds),
            ];
            for (name, s) in rows {
                if s.n == 0 {
                    continue;
                }
                md += &format!(
                    "| {} | {name} | {} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
                    l.load.name(),
                    s.n,
                    s.mean,
                    s.median,
                    s.p90,
                    s.p99
                );
            }
        }
        md += "\n</details>\n";
        let errors: Vec<&String> = run.levels.iter().flat_map(|l| &l.errors).collect();
        if !errors.is_empty() {
            md += "\nFailures (first of each kind):\n\n";
            for e in errors {
                md += &format!("- {e}\n");
            }
        }
    }
    if !r.ratios.is_empty() {
        let names: Vec<&str> = COMPARED.iter().map(|(n, _)| *n).collect();
        md += &format!(
            "\n## Ratios to `{}` (same machine, same run)\n\n| run | load | {} |\n|---|---|{}\n",
            r.ratios[0].baseline,
            names.join(" | "),
            "---|".repeat(names.len())
        );
        for ratio in &r.ratios {
            let cells: Vec<String> = names
                .iter()
                .map(|n| {
                    ratio
                        .values
                        .get(*n)
                        .map_or("–".into(), |v| format!("{v:.2}×"))
                })
                .collect();
            md += &format!(
                "| {} | {} | {} |\n",
                ratio.label,
                ratio.load,
                cells.join(" | ")
            );
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(label: &str, ttfp: f64, thr: f64) -> Run {
        let mut metrics = LevelMetrics {
            completed: 2,
            audio_throughput: thr,
            ..Default::default()
        };
        metrics.ttfp_ms.median = ttfp;
        Run {
            label: label.into(),
            profile: None,
            url: "http://x".into(),
            devices: vec![],
            levels: vec![Level {
                load: Load::Closed { concurrency: 4 },
                x: 4.0,
                metrics,
                stages: vec![],
                errors: vec![],
                server_rss_mib: None,
                server_peak_rss_mib: None,
            }],
        }
    }

    #[test]
    fn ratios_against_the_first_run() {
        let r = ratios(&[run("on", 200.0, 2.0), run("off", 1000.0, 1.0)]);
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].label.as_str(), r[0].baseline.as_str()), ("off", "on"));
        assert_eq!(r[0].load, "c=4");
        assert_eq!(r[0].values["ttfp_ms.median"], 5.0);
        assert_eq!(r[0].values["audio_throughput"], 0.5);
        // A baseline of zero (no text measured) gives no ratio, not infinity.
        assert!(!r[0].values.contains_key("ttft_ms.median"));
        assert!(ratios(&[run("only", 1.0, 1.0)]).is_empty());
    }

    #[test]
    fn load_names() {
        assert_eq!(Load::Closed { concurrency: 16 }.name(), "c=16");
        let open = |rate| Load::Open {
            rate,
            max_concurrency: None,
        };
        assert_eq!(open(Some(2.5)).name(), "rate=2.5/s");
        assert_eq!(open(None).name(), "rate=inf");
    }
}
