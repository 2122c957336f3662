//! Stages beyond this process: `omnistream stage` (one replica of one stage as
//! its own process) and the gateway's side of `omnistream serve --nats`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use omnistream_stages::engine::remote::{HostedStage, Mesh, RemoteStage};
use omnistream_stages::engine::StageInput;
use omnistream_stages::profile::{Placement, Profile};
use omnistream_stages::roles::{build_stage, input_capacity, stage_device, ModelCache};

use crate::run::RemoteStages;

/// How long a process retries its first connection to NATS.
const CONNECT_WAIT: Duration = Duration::from_secs(30);

/// Options of `omnistream stage`.
pub struct StageOptions {
    pub profile: std::path::PathBuf,
    /// One or more stages' names: several share the process and its models
    /// (e.g. Qwen3-Omni's Talker and Code2Wav, one checkpoint loaded once).
    pub stages: Vec<String>,
    pub replica: usize,
    pub nats: String,
}

/// The gateway's view of a profile's remote stages: connected to NATS, each
/// remote stage with at least one live replica (waited for up to `wait`).
pub async fn remote_stages(
    profile: &Profile,
    nats: Option<&str>,
    wait: Duration,
) -> Result<(Option<Arc<Mesh>>, RemoteStages)> {
    let remote: Vec<usize> = (0..profile.stages.len())
        .filter(|&i| profile.stages[i].placement == Placement::Remote)
        .collect();
    let Some(url) = nats else {
        if let Some(&i) = remote.first() {
            bail!(
                "{}: stage {:?} is placed remote: start the gateway with --nats URL",
                profile.file.display(),
                profile.stages[i].name
            );
        }
        return Ok((None, RemoteStages::new()));
    };
    let mesh = Mesh::connect(url, &profile.name, true, CONNECT_WAIT).await?;
    let mut stages = RemoteStages::new();
    for i in remote {
        let name = &profile.stages[i].name;
        eprintln!("waiting for a replica of stage {name} on {url}");
        let meta = mesh.wait_for_stage(i, name, wait).await?;
        let input: Arc<dyn StageInput> = Arc::new(RemoteStage::new(
            mesh.clone(),
            i,
            name.clone(),
            input_capacity(profile, i),
        ));
        stages.insert(i, (input, meta));
    }
    Ok((Some(mesh), stages))
}

/// The index of the stage named `name`, or an error listing the names.
fn stage_index(profile: &Profile, name: &str) -> Result<usize> {
    profile
        .stages
        .iter()
        .position(|s| s.name == name)
        .with_context(|| {
            format!(
                "{}: no stage named {name:?} (stages: {})",
                profile.file.display(),
                profile
                    .stages
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// Runs one replica of each of `opts.stages` (each its own worker, joined to
/// NATS on its own connection) until SIGINT or SIGTERM.
pub async fn run_stage(opts: StageOptions) -> Result<()> {
    let (profile, _) = crate::profile::load(&opts.profile)?;
    let mut indices = Vec::new();
    for name in &opts.stages {
        let index = stage_index(&profile, name)?;
        let spec = &profile.stages[index];
        if opts.replica >= spec.replicas {
            bail!(
                "{}: stage {:?} has {} replica(s) (replicas:), so --replica is 0..{}",
                opts.profile.display(),
                spec.name,
                spec.replicas,
                spec.replicas - 1
            );
        }
        if indices.contains(&index) {
            bail!("stage {name:?} is named twice in --stage");
        }
        indices.push(index);
    }
    if indices.is_empty() {
        bail!("--stage names no stage");
    }
    let built = {
        let profile = profile.clone();
        let (replica, indices) = (opts.replica, indices.clone());
        tokio::task::spawn_blocking(move || {
            // One cache: stages of one checkpoint load it once, with their parts only.
            let mut cache = ModelCache::for_stages(&profile, indices.iter().map(|&i| (i, replica)));
            indices
                .iter()
                .map(|&i| build_stage(&profile, i, replica, &mut cache, None))
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .context("loading the stages")??
    };
    let shutdown = Arc::new(AtomicBool::new(false));
    let mut hosted = Vec::new();
    for (index, built) in indices.into_iter().zip(built) {
        let spec = &profile.stages[index];
        let device = stage_device(spec, opts.replica)?;
        let mesh = Mesh::connect(&opts.nats, &profile.name, false, CONNECT_WAIT).await?;
        // The next stage, if this one feeds one (always over NATS from here,
        // even when it runs in this process).
        let next: Option<Arc<dyn StageInput>> = profile
            .connector(index)
            .and_then(|_| profile.stages.get(index + 1))
            .map(|n| {
                Arc::new(RemoteStage::new(
                    mesh.clone(),
                    index + 1,
                    n.name.clone(),
                    input_capacity(&profile, index + 1),
                )) as Arc<dyn StageInput>
            });
        // Upstream processes each hold up to the connector's capacity in flight.
        let queue_capacity = input_capacity(&profile, index).saturating_mul(64).max(1024);
        let worker = mesh
            .host(HostedStage {
                name: spec.name.clone(),
                index,
                replica: opts.replica as u32,
                model: built.model,
                meta: built.meta,
                device,
                queue_capacity,
                next,
                shutdown: shutdown.clone(),
            })
            .await?;
        // Tests and scripts wait for this line.
        println!(
            "omnistream stage {} replica {} ready ({:016x}) on {} (profile {})",
            spec.name,
            opts.replica,
            mesh.process(),
            opts.nats,
            opts.profile.display()
        );
        hosted.push((spec.name.clone(), mesh, worker));
    }
    wait_for_signal().await;
    for (name, mesh, _) in &hosted {
        mesh.stop_hosted(&format!(
            "stage_unavailable: stage {name} replica {} is shutting down",
            opts.replica
        ))
        .await;
    }
    shutdown.store(true, Ordering::Release);
    for (_, _, worker) in hosted {
        tokio::task::spawn_blocking(move || worker.join())
            .await
            .ok();
    }
    Ok(())
}

/// SIGINT or SIGTERM (what systemd, Kubernetes and compose send).
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
