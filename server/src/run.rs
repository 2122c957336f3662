//! `say` and `chat`: one request through the pipeline, timed with the same
//! definitions as the server and the bench (TTFT, TTFP, RTF).

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use omnistream_codecs::wav::write_wav;
use omnistream_stages::engine::ChatMessage;
use omnistream_stages::engine::{
    Event, Modalities, Pipeline, RequestInput, RequestSpec, SamplingOverrides,
};
use omnistream_stages::models::qwen3_omni::weights::Progress;
use omnistream_stages::profile::Profile;
use omnistream_stages::roles::build_pipeline_placed;

/// Remote stages' inputs and what their replicas announced, by stage index.
pub type RemoteStages = std::collections::HashMap<
    usize,
    (
        std::sync::Arc<dyn omnistream_stages::engine::StageInput>,
        omnistream_stages::engine::remote::StageMeta,
    ),
>;

/// What one request produced, and when.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub text: String,
    pub samples: Vec<f32>,
    pub sample_rate: u32,
    /// Request start -> first text delta.
    pub ttft: Option<Duration>,
    /// Request start -> last text delta.
    pub last_text: Option<Duration>,
    /// Request start -> first audio.
    pub ttfp: Option<Duration>,
    /// Request start -> last audio chunk.
    pub last_audio: Option<Duration>,
    /// Request start -> done.
    pub total: Duration,
    pub completion_tokens: usize,
}

impl Outcome {
    pub fn audio_seconds(&self) -> f64 {
        if self.sample_rate == 0 {
            0.0
        } else {
            self.samples.len() as f64 / self.sample_rate as f64
        }
    }
    /// (time of last audio chunk − request start) / audio seconds.
    pub fn rtf(&self) -> Option<f64> {
        let a = self.audio_seconds();
        self.last_audio
            .filter(|_| a > 0.0)
            .map(|t| t.as_secs_f64() / a)
    }
}

pub fn load_pipeline(profile: &Path) -> Result<Pipeline> {
    let (profile, _) = crate::profile::load(profile)?;
    load_profile(&profile)
}

pub fn load_profile(profile: &Profile) -> Result<Pipeline> {
    load_profile_placed(profile, Default::default())
}

/// [`load_profile`] with the remote stages' inputs (by stage index).
pub fn load_profile_placed(profile: &Profile, remote: RemoteStages) -> Result<Pipeline> {
    // A progress bar for checkpoints read tensor by tensor (Qwen3-Omni's ~70 GB).
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "loading weights {bar:40} {bytes}/{total_bytes} [{elapsed}, {eta} left]",
        )
        .context("progress bar template")?,
    );
    let b = bar.clone();
    let progress: Progress = std::sync::Arc::new(move |read, total| {
        b.set_length(total);
        b.set_position(read);
    });
    let p = build_pipeline_placed(profile, Some(progress), remote)
        .with_context(|| format!("loading {}", profile.file.display()));
    bar.finish_and_clear();
    p
}

/// Submits `spec` and collects its events; `on_text` sees each text delta.
pub fn run_request(
    pipeline: &Pipeline,
    spec: RequestSpec,
    mut on_text: impl FnMut(&str),
) -> Result<Outcome> {
    let start = Instant::now();
    let handle = pipeline.submit(spec)?;
    let mut out = Outcome::default();
    loop {
        let event = handle
            .events()
            .recv_timeout(Duration::from_secs(300))
            .context("no event from the pipeline for 300 s")?;
        match event {
            Event::TextDelta(t) => {
                let now = start.elapsed();
                out.ttft.get_or_insert(now);
                out.last_text = Some(now);
                on_text(&t);
                out.text.push_str(&t);
            }
            Event::Audio {
                samples,
                sample_rate,
                ..
            } => {
                let now = start.elapsed();
                out.ttfp.get_or_insert(now);
                out.last_audio = Some(now);
                out.sample_rate = sample_rate;
                out.samples.extend(samples);
            }
            // `run` offers no tools.
            Event::ToolCall(_) => {}
            Event::Done {
                completion_tokens, ..
            } => {
                out.completion_tokens = completion_tokens;
                out.total = start.elapsed();
                return Ok(out);
            }
            Event::Error(e) => bail!("request failed: {e}"),
        }
    }
}

pub fn speech_spec(text: &str, voice: Option<String>, speed: Option<f32>) -> RequestSpec {
    RequestSpec {
        input: RequestInput::Speech {
            text: text.to_string(),
        },
        modalities: Modalities::TEXT_AUDIO,
        sampling: SamplingOverrides {
            speed,
            ..Default::default()
        },
        voice,
        tools: None,
        style: Default::default(),
    }
}

pub fn chat_spec(prompt: &str, modalities: Modalities, sampling: SamplingOverrides) -> RequestSpec {
    RequestSpec {
        input: RequestInput::Chat {
            messages: vec![ChatMessage::user(prompt)],
        },
        modalities,
        sampling,
        voice: None,
        tools: None,
        style: Default::default(),
    }
}

fn write_audio(out: &Outcome, path: &Path) -> Result<()> {
    write_wav(path, &out.samples, out.sample_rate.max(1))
        .with_context(|| format!("writing {}", path.display()))
}

pub fn say(
    profile: &Path,
    text: &str,
    output: &Path,
    voice: Option<String>,
    speed: Option<f32>,
) -> Result<()> {
    let pipeline = load_pipeline(profile)?;
    let out = run_request(&pipeline, speech_spec(text, voice, speed), |_| {})?;
    write_audio(&out, output)?;
    eprintln!(
        "{}: {:.2} s of audio; TTFP {}, RTF {}",
        output.display(),
        out.audio_seconds(),
        fmt_ms(out.ttfp),
        out.rtf().map_or("-".into(), |r| format!("{r:.3}")),
    );
    Ok(())
}

pub struct ChatOptions {
    pub text_only: bool,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub seed: Option<u64>,
}

pub fn chat(profile: &Path, prompt: &str, output: &Path, o: ChatOptions) -> Result<()> {
    let pipeline = load_pipeline(profile)?;
    let modalities = if o.text_only {
        Modalities::TEXT
    } else {
        Modalities::TEXT_AUDIO
    };
    let sampling = SamplingOverrides {
        max_tokens: o.max_tokens,
        temperature: o.temperature,
        seed: o.seed,
        ..Default::default()
    };
    let mut stdout = std::io::stdout();
    let out = run_request(&pipeline, chat_spec(prompt, modalities, sampling), |t| {
        let _ = write!(stdout, "{t}");
        let _ = stdout.flush();
    })?;
    println!();
    if !o.text_only {
        write_audio(&out, output)?;
    }
    let tps = match (out.ttft, out.completion_tokens) {
        (Some(ttft), n) if n > 1 => {
            format!(
                "{:.1}",
                (n - 1) as f64 / (out.total - ttft).as_secs_f64().max(1e-9)
            )
        }
        _ => "-".into(),
    };
    eprintln!(
        "TTFT {}  TTFP {}  RTF {}  audio {:.2} s  tokens {} ({} tok/s){}",
        fmt_ms(out.ttft),
        fmt_ms(out.ttfp),
        out.rtf().map_or("-".into(), |r| format!("{r:.3}")),
        out.audio_seconds(),
        out.completion_tokens,
        tps,
        if o.text_only {
            String::new()
        } else {
            format!("  -> {}", output.display())
        },
    );
    Ok(())
}

pub fn fmt_ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3))
}
