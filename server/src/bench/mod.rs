//! Benchmarks. `omnistream bench` drives a running server, several at once
//! (`servers`), or servers it starts, one profile at a time, for
//! `--compare`, with sweeps of load and
//! reports the metrics vLLM-Omni's bench defines (see `metrics`);
//! `omnistream bench-pipeline` measures the engine in-process (`pipeline`).

mod client;
mod dataset;
mod engine;
pub mod metrics;
mod pipeline;
mod plot;
mod report;
mod servers;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use indicatif::{ProgressBar, ProgressStyle};
use rand::SeedableRng;
use rand_distr::Distribution;

pub use client::Endpoint;
use client::RequestShape;
pub use engine::{bench_engine, EngineArgs};
use metrics::{level_metrics, stage_loads, Timeline};
pub use pipeline::bench_pipeline;
use report::{Dataset, Level, Load, Report, Run};
use servers::Servers;

/// The CPU and core count, for every report.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(String::new(), |kb| format!(", {:.0} GiB", kb / 1048576.0));
    format!("{cpu}, {cores} cores{mem_gib}")
}

/// `omnistream bench` options.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The server to drive (http://HOST:PORT). Several, comma-separated:
    /// one run over all of them (whole pipelines replicated, a server a
    /// GPU), each request to the one with the fewest in flight, as a load
    /// balancer's leastconn. Ignored with --compare.
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:8091")]
    pub url: Vec<String>,
    /// API key sent as `Authorization: Bearer`.
    #[arg(long, env = "OMNISTREAM_API_KEY")]
    pub api_key: Option<String>,
    /// What each request is.
    #[arg(long, value_enum, default_value = "chat")]
    pub endpoint: Endpoint,
    /// Closed loop: these numbers of requests in flight, one level each.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Open loop instead: Poisson arrivals at these rates (requests/s; `inf`
    /// sends all at once), one level each.
    #[arg(long, value_delimiter = ',')]
    pub request_rate: Vec<String>,
    /// Open loop: at most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Measured requests per level.
    #[arg(long, default_value_t = 16)]
    pub num_prompts: usize,
    /// Requests sent (and not measured) before each run's first level.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Prompts, one per line (cycled). Without it: random prompts.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Random prompts: words per prompt (about one token each).
    #[arg(long, default_value_t = 32)]
    pub input_len: usize,
    /// Output tokens per answer (max_tokens); exact with ignore_eos.
    #[arg(long, default_value_t = 32)]
    pub output_len: usize,
    /// Speech: every answer is exactly this many codec frames (`max_tokens`
    /// with `ignore_eos`; a Talker that speaks frame by frame, Qwen3-TTS:
    /// 12.5 a second). Without it each ends where the Talker ends it.
    #[arg(long)]
    pub speech_frames: Option<usize>,
    /// Speech: a reference clip (WAV) sent as `ref_audio` with every request,
    /// so each clones a voice (the server encodes it each time).
    #[arg(long)]
    pub ref_audio: Option<PathBuf>,
    /// Speech: the --ref-audio clip's words, sent as `ref_text`: in-context
    /// cloning (the clip's codes in every prompt).
    #[arg(long, requires = "ref_audio")]
    pub ref_text: Option<String>,
    /// Speech: `instructions` with every request (the voice described in
    /// words for a VoiceDesign checkpoint, a style for CustomVoice).
    #[arg(long)]
    pub instructions: Option<String>,
    /// Stop at the model's end of sequence instead of generating exactly --output-len.
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Text only (chat/realtime): no audio.
    #[arg(long)]
    pub text_only: bool,
    /// Spoken questions instead of text prompts: a WAV file or a folder of
    /// them (cycled). Chat sends each as `input_audio`; Realtime streams it
    /// as a microphone at real time and lets server VAD end the turn. Times
    /// then run from the end of speech.
    #[arg(long)]
    pub spoken_input: Option<PathBuf>,
    /// Realtime with --spoken-input: server VAD's `silence_duration_ms`.
    #[arg(long, default_value_t = 500)]
    pub vad_silence_ms: u32,
    #[arg(long, default_value = "joe")]
    pub voice: String,
    /// The `model` field of each request.
    #[arg(long, default_value = "omnistream")]
    pub model: String,
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Seeds the random prompts, the arrival times and each request's sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Start `omnistream serve` with each of these profiles in turn, run the
    /// same sweep on each and report every metric as a ratio to the first.
    #[arg(long, num_args = 1..)]
    pub compare: Vec<PathBuf>,
    /// --compare: the first started server's port (the next ones count up);
    /// 0 picks free ports.
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Also draw these earlier reports' runs in the plots.
    #[arg(long)]
    pub overlay: Vec<PathBuf>,
    /// Skip the PNG plots.
    #[arg(long)]
    pub no_plots: bool,
    /// Run nothing: draw the plots of the --overlay reports into --out.
    #[arg(long, requires = "overlay")]
    pub plot_only: bool,
    /// Folder for bench.json, bench.md and the plots.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
}

impl BenchArgs {
    fn loads(&self) -> Result<Vec<Load>> {
        if !self.request_rate.is_empty() {
            return self
                .request_rate
                .iter()
                .map(|r| {
                    let rate = match r.trim() {
                        "inf" => None,
                        s => Some(
                            s.parse::<f64>()
                                .ok()
                                .filter(|v| v.is_finite() && *v > 0.0)
                                .with_context(|| {
                                    format!("--request-rate: {s:?} is not a positive number or inf")
                                })?,
                        ),
                    };
                    Ok(Load::Open {
                        rate,
                        max_concurrency: self.max_concurrency,
                    })
                })
                .collect();
        }
        if self.concurrency.is_empty() || self.concurrency.contains(&0) {
            bail!("--concurrency must list numbers of at least 1");
        }
        Ok(self
            .concurrency
            .iter()
            .map(|&c| Load::Closed { concurrency: c })
            .collect())
    }

    fn shape(&self) -> Result<RequestShape> {
        let speech = self.endpoint == Endpoint::Speech;
        let questions = match &self.spoken_input {
            Some(_) if speech => bail!("--spoken-input asks chat or realtime, not speech"),
            Some(p) => Some(Arc::new(dataset::questions(p)?)),
            None => None,
        };
        if !speech && (self.speech_frames.is_some() || self.ref_audio.is_some()) {
            bail!("--speech-frames and --ref-audio ask --endpoint speech");
        }
        let ref_audio = match &self.ref_audio {
            Some(p) => {
                let bytes = std::fs::read(p)
                    .with_context(|| format!("--ref-audio: reading {}", p.display()))?;
                Some(Arc::new(
                    base64::engine::general_purpose::STANDARD.encode(bytes),
                ))
            }
            None => None,
        };
        Ok(RequestShape {
            endpoint: self.endpoint,
            model: self.model.clone(),
            voice: self.voice.clone(),
            audio: speech || !self.text_only,
            max_tokens: match speech {
                true => self.speech_frames,
                false => Some(self.output_len),
            },
            ignore_eos: match speech {
                true => self.speech_frames.is_some(),
                false => !self.no_ignore_eos,
            },
            ref_audio,
            ref_text: self.ref_text.clone(),
            instructions: self.instructions.clone(),
            temperature: self.temperature,
            timeout: Duration::from_secs(self.timeout.max(1)),
            questions,
            spoken_input: self.spoken_input.as_ref().map(|p| p.display().to_string()),
            vad_silence_ms: self.vad_silence_ms,
        })
    }
}

pub fn bench(args: BenchArgs) -> Result<()> {
    let loads = args.loads()?;
    if args.num_prompts == 0 {
        bail!("--num-prompts must be at least 1");
    }
    if args.output_len == 0 {
        bail!("--output-len must be at least 1");
    }
    let overlays = args
        .overlay
        .iter()
        .map(|p| load_report(p))
        .collect::<Result<Vec<_>>>()?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    if args.plot_only {
        let x_label = x_label(overlays.iter().flat_map(|r| &r.runs));
        let runs: Vec<Run> = overlays.into_iter().flat_map(|r| r.runs).collect();
        for f in plot::plot_runs(&runs, x_label, &args.out).context("plots")? {
            eprintln!("wrote {}", f.display());
        }
        return Ok(());
    }
    // Every run asks the same: the spoken questions are read once.
    let shape = args.shape()?;
    let rt = tokio::runtime::Runtime::new().context("starting tokio")?;
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());

    let servers_per_run = if args.compare.is_empty() {
        args.url.len()
    } else {
        1
    };
    let per_run = args.warmup * servers_per_run + args.num_prompts * loads.len();
    let targets: Vec<Option<&PathBuf>> = if args.compare.is_empty() {
        vec![None]
    } else {
        args.compare.iter().map(Some).collect()
    };
    let bar = ProgressBar::new((per_run * targets.len()) as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>28} {bar:40} {pos}/{len} requests [{elapsed}, eta {eta}]",
        )
        .context("progress bar template")?,
    );

    let mut runs = Vec::new();
    let mut failed_total = 0;
    for (i, profile) in targets.iter().enumerate() {
        let (urls, server) = match profile {
            None => (args.url.clone(), None),
            Some(p) => {
                let port = if args.port == 0 {
                    free_port()?
                } else {
                    args.port.checked_add(i as u16).context("--port too high")?
                };
                bar.set_message(format!("starting {}", profile_label(p)));
                let s = SpawnedServer::start(p, port, &args.out)?;
                (vec![s.url.clone()], Some(s))
            }
        };
        let servers = Servers::new(&urls, args.api_key.clone())?;
        let label = profile.map_or_else(|| servers.urls(), |p| profile_label(p));
        let run = rt.block_on(sweep(&args, &shape, &servers, &loads, &label, &bar));
        drop(server);
        let mut run = run?;
        run.profile = profile.map(|p| p.display().to_string());
        failed_total += run.levels.iter().map(|l| l.metrics.failed).sum::<usize>();
        runs.push(run);
    }
    bar.finish_and_clear();

    let mut devices = Vec::new();
    for d in runs.iter().flat_map(|r| &r.devices) {
        push_unique(&mut devices, d);
    }
    let report = Report {
        schema: report::SCHEMA.into(),
        omnistream_version: env!("CARGO_PKG_VERSION").into(),
        started_unix,
        machine: match devices.is_empty() {
            true => machine(),
            false => format!(
                "{}; the server's stages on {}",
                machine(),
                devices.join(", ")
            ),
        },
        command: std::env::args().collect::<Vec<_>>().join(" "),
        request: serde_json::to_value(&shape)?,
        dataset: Dataset {
            source: dataset_source(&args, &shape),
            input_len: (args.prompts.is_none() && args.spoken_input.is_none())
                .then_some(args.input_len),
            num_prompts: args.num_prompts,
            warmup: args.warmup,
            seed: args.seed,
        },
        ratios: report::ratios(&runs),
        runs,
    };
    let json_path = args.out.join("bench.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    let md = report::markdown(&report);
    std::fs::write(args.out.join("bench.md"), &md)?;
    println!("{md}");
    if !args.no_plots {
        let mut plotted = report.runs.clone();
        for (path, r) in args.overlay.iter().zip(overlays) {
            let stem = label_of(path);
            plotted.extend(r.runs.into_iter().map(|mut run| {
                run.label = format!("{} ({stem})", run.label);
                run
            }));
        }
        let x_label = x_label(&plotted);
        // The report stands without them (a GPU host may have no fonts);
        // `--plot-only --overlay bench.json` draws them later elsewhere.
        match plot::plot_runs(&plotted, x_label, &args.out) {
            Ok(files) => {
                for f in files {
                    eprintln!("wrote {}", f.display());
                }
            }
            Err(e) => eprintln!("warning: no plots: {e:#}"),
        }
    }
    eprintln!("wrote {} and bench.md", json_path.display());
    if failed_total > 0 {
        bail!("{failed_total} request(s) failed; see the failures in bench.md");
    }
    Ok(())
}

/// The plots' x axis: what the levels varied.
fn x_label<'a>(runs: impl IntoIterator<Item = &'a Run>) -> &'static str {
    let open = runs
        .into_iter()
        .flat_map(|r| &r.levels)
        .any(|l| matches!(l.load, Load::Open { .. }));
    if open {
        "request rate (requests/s)"
    } else {
        "concurrency (requests in flight)"
    }
}

/// A profile's label: its file's stem, with its folder when that is not
/// `deploy/` (`distributed-tiny-cpu` beside `tiny-cpu`).
fn profile_label(path: &Path) -> String {
    let stem = label_of(path);
    match path.parent().and_then(|p| p.file_name()) {
        Some(dir) if dir != "deploy" => format!("{}-{stem}", dir.to_string_lossy()),
        _ => stem,
    }
}

fn label_of(path: &Path) -> String {
    path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into(),
    )
}

fn load_report(path: &Path) -> Result<Report> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let r: Report = serde_json::from_str(&text)
        .with_context(|| format!("{}: not an omnistream bench report", path.display()))?;
    if r.schema != report::SCHEMA {
        bail!(
            "{}: schema {:?}, this omnistream reads {:?}",
            path.display(),
            r.schema,
            report::SCHEMA
        );
    }
    Ok(r)
}

/// Every load level against one server.
async fn sweep(
    args: &BenchArgs,
    shape: &RequestShape,
    servers: &Servers,
    loads: &[Load],
    label: &str,
    bar: &ProgressBar,
) -> Result<Run> {
    let mut devices = Vec::new();
    for client in servers.clients() {
        let health = client.get_text("/health").await.map_err(|e| {
            anyhow::anyhow!(
                "cannot reach the server at {}/health: {e} (is `omnistream serve` running?)",
                client.base()
            )
        })?;
        for d in server_devices(&health) {
            push_unique(&mut devices, &d);
        }
    }
    // Warm-up: its own prompts, so that no measured prompt is already
    // cached; every server gets them.
    bar.set_message(format!("{label}: warm-up"));
    let warm = dataset::prompts(
        args.prompts.as_deref(),
        args.warmup,
        args.input_len,
        args.seed.wrapping_add(u64::MAX / 2),
    )?;
    for client in servers.clients() {
        for (i, p) in warm.iter().enumerate() {
            client
                .run(shape, p, args.seed.wrapping_add(i as u64))
                .await
                .map_err(|e| anyhow::anyhow!("warm-up request to {} failed: {e}", client.base()))?;
            bar.inc(1);
        }
    }
    let mut levels = Vec::new();
    for (k, load) in loads.iter().enumerate() {
        bar.set_message(format!("{label}: {}", load.name()));
        // Fresh prompts per level (same for every run): the prefix cache
        // cannot serve a prompt measured at an earlier level.
        let prompts = dataset::prompts(
            args.prompts.as_deref(),
            args.num_prompts,
            args.input_len,
            args.seed.wrapping_add(k as u64 + 1),
        )?;
        let level = run_level(args, servers, shape, *load, &prompts, bar).await;
        if bar.is_hidden() {
            // No terminal for the bar: one line per level for the log.
            eprintln!(
                "{label}: {} done: {} ok, {} failed in {:.1} s",
                load.name(),
                level.metrics.completed,
                level.metrics.failed,
                level.metrics.wall_s
            );
        }
        levels.push(level);
    }
    Ok(Run {
        label: label.into(),
        profile: None,
        url: servers.urls(),
        devices,
        levels,
    })
}

/// The devices a server's `/health` names, each once, in order.
fn server_devices(health: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(health).unwrap_or_default();
    let mut out = Vec::new();
    for d in v["devices"].as_array().into_iter().flatten() {
        if let Some(name) = d["device"].as_str() {
            push_unique(&mut out, name);
        }
    }
    out
}

fn push_unique(out: &mut Vec<String>, s: &str) {
    if !out.iter().any(|o| o == s) {
        out.push(s.to_string());
    }
}

/// The report's dataset: random words, a prompts file, or spoken questions
/// with their lengths.
fn dataset_source(args: &BenchArgs, shape: &RequestShape) -> String {
    match (&args.spoken_input, &args.prompts, &shape.questions) {
        (Some(dir), _, Some(q)) => {
            let (lo, hi) = q.iter().fold((f64::MAX, 0.0f64), |(l, h), q| {
                (l.min(q.seconds), h.max(q.seconds))
            });
            format!(
                "spoken questions in {} ({} files, {lo:.1}-{hi:.1} s of speech)",
                dir.display(),
                q.len()
            )
        }
        (_, Some(p), _) => p.display().to_string(),
        _ => "random".into(),
    }
}

/// One level: every prompt sent under `load`, timelines collected, stages
/// scraped before, during and after.
async fn run_level(
    args: &BenchArgs,
    servers: &Servers,
    shape: &RequestShape,
    load: Load,
    prompts: &[String],
    bar: &ProgressBar,
) -> Level {
    let before = servers.scrape().await;
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sampler = {
        let (servers, samples) = (servers.clone(), samples.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tick.tick().await;
                let s = servers.scrape().await;
                if let Ok(mut v) = samples.lock() {
                    v.push(s);
                }
            }
        })
    };

    let results: Arc<Mutex<Vec<Result<Timeline, String>>>> = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let send = |i: usize| {
        let (servers, shape, results, bar) =
            (servers.clone(), shape.clone(), results.clone(), bar.clone());
        let prompt = prompts[i].clone();
        let seed = args.seed.wrapping_add(1000 + i as u64);
        async move {
            let r = servers.run(&shape, &prompt, seed).await;
            bar.inc(1);
            if let Ok(mut v) = results.lock() {
                v.push(r);
            }
        }
    };
    // Closed loop: a new request the moment one ends, `concurrency` in
    // flight. Open loop: Poisson arrivals, capped by `max_concurrency`.
    let (limit, rate) = match load {
        Load::Closed { concurrency } => (concurrency, None),
        Load::Open {
            rate,
            max_concurrency,
        } => (
            max_concurrency.unwrap_or(tokio::sync::Semaphore::MAX_PERMITS),
            rate,
        ),
    };
    let limit = Arc::new(tokio::sync::Semaphore::new(limit));
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let exp = rate.and_then(|r| rand_distr::Exp::new(r).ok());
    let mut at = 0.0;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..prompts.len() {
        if let Some(exp) = &exp {
            at += exp.sample(&mut rng);
            tokio::time::sleep_until((t0 + Duration::from_secs_f64(at)).into()).await;
        }
        let Ok(permit) = limit.clone().acquire_owned().await else {
            break;
        };
        let job = send(i);
        tasks.spawn(async move {
            job.await;
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
    let wall = t0.elapsed().as_secs_f64();
    sampler.abort();
    let after = servers.scrape().await;
    let (rss, peak) = servers.memory().await;

    let results = std::mem::take(&mut *results.lock().unwrap_or_else(|e| e.into_inner()));
    let mut done = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    let mut failed = 0;
    for r in results {
        match r {
            Ok(t) => done.push(t),
            Err(e) => {
                failed += 1;
                if errors.len() < 5 && !errors.contains(&e) {
                    errors.push(e);
                }
            }
        }
    }
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(|e| e.into_inner()));
    Level {
        load,
        x: load.x(),
        metrics: level_metrics(&done, failed, wall),
        stages: stage_loads(&before, &after, &samples, wall),
        errors,
        server_rss_mib: rss,
        server_peak_rss_mib: peak,
    }
}

/// `omnistream serve` started by the bench for `--compare`; killed on drop.
/// For a profile with remote stages, also a `nats-server` on loopback and one
/// `omnistream stage` process per replica of each remote stage.
struct SpawnedServer {
    child: Child,
    url: String,
    /// NATS and the stage processes (killed after the gateway).
    helpers: Vec<Child>,
}

impl SpawnedServer {
    fn start(profile: &Path, port: u16, out: &Path) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the omnistream binary")?;
        let label = profile_label(profile);
        let log_file = |name: String| -> Result<std::fs::File> {
            let p = out.join(name);
            std::fs::File::create(&p).with_context(|| format!("creating {}", p.display()))
        };
        let log_path = out.join(format!("server-{label}.log"));
        let log = log_file(format!("server-{label}.log"))?;
        let parsed = omnistream_stages::profile::Profile::load(profile)?;
        let remote: Vec<_> = parsed
            .stages
            .iter()
            .filter(|s| s.placement == omnistream_stages::profile::Placement::Remote)
            .collect();
        let mut helpers = Vec::new();
        let mut nats_url = None;
        if !remote.is_empty() {
            let nport = free_port()?;
            let conf = out.join(format!("nats-{label}.conf"));
            std::fs::write(
                &conf,
                format!("listen: 127.0.0.1:{nport}\nmax_payload: 64MB\n"),
            )?;
            helpers.push(
                Command::new("nats-server")
                    .arg("-c")
                    .arg(&conf)
                    .stdout(Stdio::null())
                    .stderr(log_file(format!("nats-{label}.log"))?)
                    .spawn()
                    .context("starting nats-server (apt-get install nats-server)")?,
            );
            let url = format!("nats://127.0.0.1:{nport}");
            // Stages that share a `process` start together, one process a replica.
            let mut groups: Vec<(Option<&str>, Vec<&str>, usize)> = Vec::new();
            for s in &remote {
                match groups
                    .iter_mut()
                    .find(|g| g.0.is_some() && g.0 == s.process.as_deref())
                {
                    Some(g) => g.1.push(&s.name),
                    None => groups.push((s.process.as_deref(), vec![&s.name], s.replicas)),
                }
            }
            for (_, names, replicas) in &groups {
                let names = names.join(",");
                for r in 0..*replicas {
                    helpers.push(
                        Command::new(&exe)
                            .args(["stage", "--stage", &names, "--replica", &r.to_string()])
                            .arg("--profile")
                            .arg(profile)
                            .args(["--nats", &url])
                            .stdout(Stdio::null())
                            .stderr(log_file(format!(
                                "stage-{label}-{}-{r}.log",
                                names.replace(',', "+")
                            ))?)
                            .spawn()
                            .context("starting omnistream stage")?,
                    );
                }
            }
            nats_url = Some(url);
        }
        let mut cmd = Command::new(exe);
        cmd.args(["serve", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .arg("--profile")
            .arg(profile);
        if let Some(url) = &nats_url {
            cmd.args(["--nats", url]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting omnistream serve")?;
        let mut server = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            helpers,
        };
        let health = format!("127.0.0.1:{port}");
        let t0 = Instant::now();
        loop {
            if let Some(status) = server.child.try_wait()? {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                bail!(
                    "omnistream serve --profile {} exited ({status}) before it was ready:\n{}",
                    profile.display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            if http_ok(&health) {
                return Ok(server);
            }
            if t0.elapsed() > Duration::from_secs(600) {
                bail!("omnistream serve on port {port} was not ready within 10 minutes");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for SpawnedServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for c in self.helpers.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("finding a free port")?
        .port())
}

/// A blocking `GET /health` (before the async client exists).
fn http_ok(addr: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut buf = [0u8; 16];
    matches!(s.read(&mut buf), Ok(n) if n >= 12 && buf[9..12] == *b"200")
}
