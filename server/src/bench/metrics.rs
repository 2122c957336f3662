//! The bench's metric arithmetic, as shared/DESIGN.md and vLLM-Omni's bench
//! define it. Everything here is pure: one request is a [`Timeline`] of
//! offsets from its start, one load level is a set of timelines over a wall
//! clock.
//!
//! - TTFT: request start → first text delta.
//! - TPOT: (last text delta − TTFT) / (output tokens − 1); requests with fewer
//!   than two tokens have none.
//! - TTFP: request start → first audio bytes.
//! - Audio RTF: (last audio chunk − request start) / audio seconds produced.
//! - E2EL: request start → the response's end.
//! - Audio throughput: Σ audio seconds / wall seconds; output tok/s:
//!   Σ output tokens / wall seconds; req/s: completed requests / wall seconds.
//!
//! - Playback: each answer's audio played at real time from its first packet,
//!   as a listener's player would; an underrun is a moment the next audio
//!   was not there yet (a gap in what the listener hears). A request is
//!   gap-free when none of its gaps is over [`AUDIBLE_GAP_S`].
//!
//! Summaries report mean, median, p90 and p99, with percentiles interpolated
//! linearly between ranks (numpy's default, which vLLM's bench uses).

use serde::{Deserialize, Serialize};

/// One request, as the client saw it. Offsets are seconds from the moment the
/// request was sent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    pub first_text: Option<f64>,
    pub last_text: Option<f64>,
    pub first_audio: Option<f64>,
    pub last_audio: Option<f64>,
    /// Audio seconds received.
    pub audio_seconds: f64,
    /// Output tokens as the server counted them (usage), when it says.
    pub output_tokens: Option<usize>,
    /// Prompt tokens as the server counted them (usage), when it says.
    pub input_tokens: Option<usize>,
    /// The response's end (last byte / `[DONE]` / `response.done`).
    pub end: f64,
    /// The audio played at real time from its first packet.
    #[serde(default)]
    pub playback: Playback,
    /// A spoken turn on Realtime: when the server ended the turn
    /// (`input_audio_buffer.committed`), from the end of speech.
    #[serde(default)]
    pub turn_end: Option<f64>,
}

/// A gap longer than this is heard as a break in the speech.
pub const AUDIBLE_GAP_S: f64 = 0.1;
/// Shorter waits are clock noise, not underruns.
const MIN_GAP_S: f64 = 0.001;

/// Where a real-time player of one answer's audio ran dry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Playback {
    pub underruns: usize,
    /// Silence heard, summed over the underruns.
    pub gap_s: f64,
    pub worst_gap_s: f64,
    /// When the audio received so far has played out (offset like the rest).
    #[serde(skip)]
    played_until: Option<f64>,
}

impl Playback {
    /// `seconds` of audio arrived at `at`.
    fn push(&mut self, at: f64, seconds: f64) {
        let start = match self.played_until {
            None => at,
            Some(until) if at > until + MIN_GAP_S => {
                let gap = at - until;
                self.underruns += 1;
                self.gap_s += gap;
                self.worst_gap_s = self.worst_gap_s.max(gap);
                at
            }
            // Arrived before the player needed it: plays right after.
            Some(until) => until,
        };
        self.played_until = Some(start + seconds);
    }
}

impl Timeline {
    /// `seconds` of audio arrived at offset `at`.
    pub fn audio(&mut self, at: f64, seconds: f64) {
        if seconds <= 0.0 {
            return;
        }
        self.first_audio.get_or_insert(at);
        self.last_audio = Some(at);
        self.audio_seconds += seconds;
        self.playback.push(at, seconds);
    }

    pub fn ttft(&self) -> Option<f64> {
        self.first_text
    }

    pub fn tpot(&self) -> Option<f64> {
        let n = self.output_tokens?;
        if n < 2 {
            return None;
        }
        Some((self.last_text? - self.first_text?) / (n - 1) as f64)
    }

    pub fn ttfp(&self) -> Option<f64> {
        self.first_audio
    }

    pub fn audio_rtf(&self) -> Option<f64> {
        (self.audio_seconds > 0.0).then(|| self.last_audio.unwrap_or(self.end) / self.audio_seconds)
    }

    pub fn e2el(&self) -> f64 {
        self.end
    }
}

/// Mean, median and tail of one metric over a level's requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests that have this metric.
    pub n: usize,
    pub mean: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
}

/// Percentile `p` (0–100) with linear interpolation between closest ranks.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = p.clamp(0.0, 100.0) / 100.0 * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

pub fn summarize(values: &[f64]) -> Summary {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return Summary::default();
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Summary {
        n: v.len(),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        median: percentile(&v, 50.0),
        p90: percentile(&v, 90.0),
        p99: percentile(&v, 99.0),
    }
}

/// Reads one figure off a level (for ratios and plots).
pub type Figure = fn(&LevelMetrics) -> f64;

/// Everything measured at one load level.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LevelMetrics {
    pub completed: usize,
    pub failed: usize,
    /// First request sent → last response ended, seconds.
    pub wall_s: f64,
    pub ttft_ms: Summary,
    pub tpot_ms: Summary,
    pub ttfp_ms: Summary,
    pub audio_rtf: Summary,
    pub e2el_ms: Summary,
    pub input_tokens: Summary,
    pub output_tokens: Summary,
    pub audio_seconds: Summary,
    /// Audio seconds produced per wall second (all streams together).
    pub audio_throughput: f64,
    pub output_tok_s: f64,
    pub req_s: f64,
    /// Playback of the requests with audio: underruns per request, silence
    /// heard per request, the worst gap of the level, and the share of
    /// requests with no gap over [`AUDIBLE_GAP_S`].
    #[serde(default)]
    pub underruns: Summary,
    #[serde(default)]
    pub gap_ms: Summary,
    #[serde(default)]
    pub worst_gap_ms: f64,
    #[serde(default)]
    pub gap_free_share: f64,
    /// Spoken turns: end of speech → the server's end of the turn (the VAD's
    /// silence wait), and that → the first answer audio.
    #[serde(default)]
    pub turn_end_ms: Summary,
    #[serde(default)]
    pub turn_end_to_audio_ms: Summary,
}

/// Aggregates the completed requests of a level that ran for `wall_s`.
pub fn level_metrics(done: &[Timeline], failed: usize, wall_s: f64) -> LevelMetrics {
    let ms = |f: &dyn Fn(&Timeline) -> Option<f64>| {
        summarize(
            &done
                .iter()
                .filter_map(f)
                .map(|s| s * 1e3)
                .collect::<Vec<_>>(),
        )
    };
    let plain = |f: &dyn Fn(&Timeline) -> Option<f64>| {
        summarize(&done.iter().filter_map(f).collect::<Vec<_>>())
    };
    let per_s = |x: f64| if wall_s > 0.0 { x / wall_s } else { 0.0 };
    let audio: f64 = done.iter().map(|t| t.audio_seconds).sum();
    let tokens: usize = done.iter().filter_map(|t| t.output_tokens).sum();
    LevelMetrics {
        completed: done.len(),
        failed,
        wall_s,
        ttft_ms: ms(&|t| t.ttft()),
        tpot_ms: ms(&|t| t.tpot()),
        ttfp_ms: ms(&|t| t.ttfp()),
        audio_rtf: plain(&|t| t.audio_rtf()),
        e2el_ms: ms(&|t| Some(t.e2el())),
        input_tokens: plain(&|t| t.input_tokens.map(|n| n as f64)),
        output_tokens: plain(&|t| t.output_tokens.map(|n| n as f64)),
        audio_seconds: plain(&|t| (t.audio_seconds > 0.0).then_some(t.audio_seconds)),
        audio_throughput: per_s(audio),
        output_tok_s: per_s(tokens as f64),
        req_s: per_s(done.len() as f64),
        underruns: plain(&|t| speaking(t).then_some(t.playback.underruns as f64)),
        gap_ms: ms(&|t| speaking(t).then_some(t.playback.gap_s)),
        worst_gap_ms: done
            .iter()
            .map(|t| t.playback.worst_gap_s * 1e3)
            .fold(0.0, f64::max),
        turn_end_ms: ms(&|t| t.turn_end),
        turn_end_to_audio_ms: ms(&|t| Some(t.first_audio? - t.turn_end?)),
        gap_free_share: {
            let spoken = done.iter().filter(|t| speaking(t)).count();
            let clean = done
                .iter()
                .filter(|t| speaking(t) && t.playback.worst_gap_s <= AUDIBLE_GAP_S)
                .count();
            if spoken > 0 {
                clean as f64 / spoken as f64
            } else {
                0.0
            }
        },
    }
}

fn speaking(t: &Timeline) -> bool {
    t.audio_seconds > 0.0
}

/// One stage's share of a level, from `/metrics` read before and after it
/// (and queue depth sampled while it ran).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageLoad {
    pub stage: String,
    /// Fraction of the wall clock the stage spent stepping.
    pub busy_fraction: f64,
    /// Fraction of the wall clock the stage waited for input.
    pub wait_fraction: f64,
    pub steps: u64,
    /// Mean batch items per step.
    pub mean_batch: f64,
    pub queue_depth_mean: f64,
    pub queue_depth_max: f64,
    /// Requests holding state in the stage (sampled): work it has admitted
    /// but not finished, which an input queue alone does not show.
    pub active_mean: f64,
}

/// The per-stage counters the server exports as
/// `omnistream_stage{stage=..., metric=...}`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageCounters {
    pub step_seconds: f64,
    pub idle_seconds: f64,
    pub steps: f64,
    pub batch_items: f64,
    pub queue_depth: f64,
    pub active: f64,
}

/// Parses the per-stage gauges out of a Prometheus text exposition, in the
/// order the stages first appear; then, for a stage with several replicas,
/// each replica's as `stage[replica]` (which one is the bottleneck).
pub fn parse_stage_counters(text: &str) -> Vec<(String, StageCounters)> {
    let mut stages: Vec<(String, StageCounters)> = Vec::new();
    let mut replicas: Vec<(String, String, StageCounters)> = Vec::new();
    for line in text.lines() {
        let (replica_family, rest) = match line.strip_prefix("omnistream_stage{") {
            Some(rest) => (false, rest),
            None => match line.strip_prefix("omnistream_stage_replica{") {
                Some(rest) => (true, rest),
                None => continue,
            },
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let label = |key: &str| {
            labels.split(',').find_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
            })
        };
        let (Some(stage), Some(metric)) = (label("stage"), label("metric")) else {
            continue;
        };
        let c = if replica_family {
            let Some(replica) = label("replica") else {
                continue;
            };
            let name = format!("{stage}[{replica}]");
            match replicas.iter().position(|(n, _, _)| *n == name) {
                Some(i) => &mut replicas[i].2,
                None => {
                    replicas.push((name, stage, StageCounters::default()));
                    &mut replicas.last_mut().expect("just pushed").2
                }
            }
        } else {
            match stages.iter().position(|(s, _)| *s == stage) {
                Some(i) => &mut stages[i].1,
                None => {
                    stages.push((stage, StageCounters::default()));
                    &mut stages.last_mut().expect("just pushed").1
                }
            }
        };
        match metric.as_str() {
            "step_seconds_total" => c.step_seconds = value,
            "idle_seconds_total" => c.idle_seconds = value,
            "steps_total" => c.steps = value,
            "batch_items_total" => c.batch_items = value,
            "queue_depth" => c.queue_depth = value,
            "active_requests" => c.active = value,
            _ => {}
        }
    }
    let several = |stage: &str| replicas.iter().filter(|(_, s, _)| s == stage).count() > 1;
    let shown: Vec<(String, StageCounters)> = replicas
        .iter()
        .filter(|(_, s, _)| several(s))
        .map(|(n, _, c)| (n.clone(), c.clone()))
        .collect();
    stages.extend(shown);
    stages
}

/// A gauge without labels (`omnistream_process_peak_resident_bytes`, ...).
pub fn parse_gauge(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// Stage loads over a level from counters `before` and `after` it and the
/// queue-depth samples taken while it ran.
pub fn stage_loads(
    before: &[(String, StageCounters)],
    after: &[(String, StageCounters)],
    samples: &[Vec<(String, StageCounters)>],
    wall_s: f64,
) -> Vec<StageLoad> {
    after
        .iter()
        .map(|(name, a)| {
            let b = before
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, c)| c.clone())
                .unwrap_or_default();
            let sampled = |f: fn(&StageCounters) -> f64| -> Vec<f64> {
                samples
                    .iter()
                    .filter_map(|s| s.iter().find(|(n, _)| n == name).map(|(_, c)| f(c)))
                    .collect()
            };
            let mean = |v: &[f64]| {
                if v.is_empty() {
                    0.0
                } else {
                    v.iter().sum::<f64>() / v.len() as f64
                }
            };
            let depths = sampled(|c| c.queue_depth);
            let steps = (a.steps - b.steps).max(0.0);
            let frac = |x: f64| if wall_s > 0.0 { x / wall_s } else { 0.0 };
            StageLoad {
                stage: name.clone(),
                busy_fraction: frac(a.step_seconds - b.step_seconds),
                wait_fraction: frac(a.idle_seconds - b.idle_seconds),
                steps: steps as u64,
                mean_batch: if steps > 0.0 {
                    (a.batch_items - b.batch_items) / steps
                } else {
                    0.0
                },
                queue_depth_mean: mean(&depths),
                queue_depth_max: depths.iter().copied().fold(0.0, f64::max),
                active_mean: mean(&sampled(|c| c.active)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-9, "{a} != {b}");
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        // numpy.percentile([1..10], [50, 90, 99]) = 5.5, 9.1, 9.91
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = summarize(&v);
        assert_eq!(s.n, 10);
        close(s.mean, 5.5);
        close(s.median, 5.5);
        close(s.p90, 9.1);
        close(s.p99, 9.91);
        // Unsorted input, odd count: median is the middle value.
        let s = summarize(&[9.0, 1.0, 5.0]);
        close(s.median, 5.0);
        close(s.p90, 8.2); // 5 + (9 - 5) * 0.8
        assert_eq!(summarize(&[]), Summary::default());
        close(summarize(&[3.0]).p99, 3.0);
        // NaN and infinities are not measurements.
        assert_eq!(summarize(&[f64::NAN, 2.0, f64::INFINITY]).n, 1);
    }

    /// A request sent at 0 s: first text at 0.2 s, 11 tokens, last text at
    /// 1.2 s; first audio at 0.5 s, last at 2.0 s, 4 s of audio; done at 2.1 s.
    fn speaking() -> Timeline {
        Timeline {
            first_text: Some(0.2),
            last_text: Some(1.2),
            first_audio: Some(0.5),
            last_audio: Some(2.0),
            audio_seconds: 4.0,
            output_tokens: Some(11),
            input_tokens: Some(30),
            end: 2.1,
            playback: Playback::default(),
            turn_end: None,
        }
    }

    #[test]
    fn playback_underruns_by_hand() {
        let mut t = Timeline::default();
        // 0.2 s at 1.0 plays to 1.2; 0.2 s at 1.1 (early) to 1.4; 0.5 s at
        // 1.5 (0.1 s late) to 2.0; 0.1 s at 2.3 (0.3 s late).
        for (at, s) in [(1.0, 0.2), (1.1, 0.2), (1.5, 0.5), (2.3, 0.1)] {
            t.audio(at, s);
        }
        t.audio(2.35, 0.0); // nothing: no packet
        assert_eq!(t.playback.underruns, 2);
        close(t.playback.gap_s, 0.4);
        close(t.playback.worst_gap_s, 0.3);
        close(t.audio_seconds, 1.0);
        assert_eq!((t.first_audio, t.last_audio), (Some(1.0), Some(2.3)));
        // A steady stream ahead of the player: no underrun.
        let mut smooth = Timeline::default();
        for k in 0..50 {
            smooth.audio(0.5 + f64::from(k) * 0.05, 0.08);
        }
        assert_eq!(
            smooth.playback,
            Playback {
                played_until: smooth.playback.played_until,
                ..Playback::default()
            }
        );
        // The level: one of the two speaking requests is gap-free.
        let quiet = Timeline {
            end: 1.0,
            ..Timeline::default()
        };
        let m = level_metrics(&[t, smooth, quiet], 0, 3.0);
        close(m.gap_free_share, 0.5);
        close(m.worst_gap_ms, 300.0);
        assert_eq!(m.underruns.n, 2);
        close(m.underruns.mean, 1.0);
        close(m.gap_ms.mean, 200.0);
    }

    #[test]
    fn one_request_by_hand() {
        let t = speaking();
        close(t.ttft().unwrap(), 0.2);
        close(t.tpot().unwrap(), (1.2 - 0.2) / 10.0);
        close(t.ttfp().unwrap(), 0.5);
        close(t.audio_rtf().unwrap(), 2.0 / 4.0);
        close(t.e2el(), 2.1);

        // One token: no TPOT. No audio: no TTFP, no RTF.
        let single = Timeline {
            output_tokens: Some(1),
            ..speaking()
        };
        assert_eq!(single.tpot(), None);
        let text_only = Timeline {
            first_audio: None,
            last_audio: None,
            audio_seconds: 0.0,
            ..speaking()
        };
        assert_eq!(text_only.ttfp(), None);
        assert_eq!(text_only.audio_rtf(), None);
        // Speech endpoint: audio, no text, no token count.
        let speech = Timeline {
            first_text: None,
            last_text: None,
            output_tokens: None,
            input_tokens: None,
            ..speaking()
        };
        assert_eq!(speech.ttft(), None);
        assert_eq!(speech.tpot(), None);
        close(speech.audio_rtf().unwrap(), 0.5);
    }

    #[test]
    fn a_level_by_hand() {
        // Two requests over a 4 s wall clock, one failure.
        let a = speaking();
        let b = Timeline {
            first_text: Some(0.4),
            last_text: Some(3.4),
            first_audio: Some(1.0),
            last_audio: Some(3.9),
            audio_seconds: 2.0,
            output_tokens: Some(31),
            input_tokens: Some(10),
            end: 4.0,
            playback: Playback::default(),
            turn_end: None,
        };
        let m = level_metrics(&[a, b], 1, 4.0);
        assert_eq!((m.completed, m.failed), (2, 1));
        close(m.ttft_ms.mean, 300.0);
        close(m.ttft_ms.median, 300.0);
        close(m.ttft_ms.p90, 200.0 + 200.0 * 0.9);
        close(m.tpot_ms.mean, (100.0 + 100.0) / 2.0); // 1000/10 and 3000/30
        close(m.ttfp_ms.median, 750.0);
        close(m.audio_rtf.mean, (0.5 + 1.95) / 2.0);
        close(m.e2el_ms.p99, 2100.0 + 1900.0 * 0.99);
        close(m.input_tokens.mean, 20.0);
        close(m.output_tokens.mean, 21.0);
        close(m.audio_seconds.mean, 3.0);
        close(m.audio_throughput, 6.0 / 4.0);
        close(m.output_tok_s, 42.0 / 4.0);
        close(m.req_s, 0.5);
        // Nothing finished: zeros, no division by zero.
        let empty = level_metrics(&[], 3, 0.0);
        assert_eq!((empty.completed, empty.failed, empty.req_s), (0, 3, 0.0));
    }

    #[test]
    fn stage_loads_from_two_scrapes() {
        let text = |steps: u64, step_s: f64, idle_s: f64, items: u64, depth: u64| {
            format!(
                "# TYPE omnistream_stage gauge\n\
                 omnistream_stage{{metric=\"steps_total\",stage=\"talker\"}} {steps}\n\
                 omnistream_stage{{metric=\"step_seconds_total\",stage=\"talker\"}} {step_s}\n\
                 omnistream_stage{{metric=\"idle_seconds_total\",stage=\"talker\"}} {idle_s}\n\
                 omnistream_stage{{metric=\"batch_items_total\",stage=\"talker\"}} {items}\n\
                 omnistream_stage{{metric=\"queue_depth\",stage=\"talker\"}} {depth}\n\
                 omnistream_stage{{metric=\"active_requests\",stage=\"talker\"}} {depth}\n\
                 omnistream_stage{{metric=\"steps_total\",stage=\"thinker\"}} 7\n\
                 omnistream_requests_total{{endpoint=\"chat\",outcome=\"ok\"}} 3\n"
            )
        };
        let before = parse_stage_counters(&text(100, 10.0, 5.0, 150, 0));
        assert_eq!(before[0].0, "talker");
        assert_eq!(before[1].0, "thinker");
        close(before[0].1.steps, 100.0);
        let after = parse_stage_counters(&text(140, 12.0, 6.0, 250, 1));
        let samples = vec![
            parse_stage_counters(&text(0, 0.0, 0.0, 0, 2)),
            parse_stage_counters(&text(0, 0.0, 0.0, 0, 4)),
        ];
        let loads = stage_loads(&before, &after, &samples, 4.0);
        let t = &loads[0];
        assert_eq!(t.stage, "talker");
        close(t.busy_fraction, 0.5);
        close(t.wait_fraction, 0.25);
        assert_eq!(t.steps, 40);
        close(t.mean_batch, 2.5);
        close(t.queue_depth_mean, 3.0);
        close(t.queue_depth_max, 4.0);
        close(t.active_mean, 3.0);
        let t = "omnistream_process_peak_resident_bytes 1048576\nomnistream_process_peak_resident_bytes_x 3\n";
        assert_eq!(
            parse_gauge(t, "omnistream_process_peak_resident_bytes"),
            Some(1048576.0)
        );
        assert_eq!(parse_gauge(t, "omnistream_process_resident_bytes"), None);
        // A stage with no steps in the level: no batch, no division by zero.
        assert_eq!(loads[1].steps, 0);
        close(loads[1].mean_batch, 0.0);
    }

    #[test]
    fn a_stage_with_several_replicas_has_a_row_for_each() {
        let text = "omnistream_stage{metric=\"steps_total\",stage=\"talker\"} 30\n\
            omnistream_stage{metric=\"steps_total\",stage=\"thinker\"} 9\n\
            omnistream_stage_replica{metric=\"steps_total\",replica=\"0\",stage=\"talker\"} 10\n\
            omnistream_stage_replica{metric=\"batch_items_total\",replica=\"0\",stage=\"talker\"} 40\n\
            omnistream_stage_replica{metric=\"steps_total\",replica=\"1/00ab\",stage=\"talker\"} 20\n\
            omnistream_stage_replica{metric=\"steps_total\",replica=\"0\",stage=\"thinker\"} 9\n";
        let c = parse_stage_counters(text);
        let names: Vec<&str> = c.iter().map(|(n, _)| n.as_str()).collect();
        // The thinker's one replica is the stage itself: no row of its own.
        assert_eq!(names, ["talker", "thinker", "talker[0]", "talker[1/00ab]"]);
        close(c[2].1.steps, 10.0);
        close(c[2].1.batch_items, 40.0);
        close(c[3].1.steps, 20.0);
    }
}
