//! CUDA graphs for fixed-shape decode steps.
//!
//! An eager decode step is thousands of small kernel launches, each costing more
//! host time than its GPU work at small batches. A captured graph replays them
//! all with one launch. Capture needs every shape fixed and every input already on
//! the device, so a graphed step runs at a bucketed batch size and key/value
//! length, reads its inputs from persistent tensors written before each replay,
//! and leaves its outputs in persistent tensors. Memory that the step allocates
//! becomes part of the graph (stream-ordered allocation nodes), freed inside it.
//!
//! candle supports this from 0.11: with its host-to-device cache on, the small
//! layout and parameter uploads its kernels make are cached by content during a
//! warm-up run, and a capture reuses them instead of copying.

use candle_core::{Device, Result};

/// Batch sizes a graphed step is captured at; a batch runs at the next one up
/// (padded rows compute into free slots and are dropped).
pub const BATCH_BUCKETS: [usize; 10] = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64];

/// Key/value lengths are rounded up to a multiple of this (at most the slot length).
pub const KV_BUCKET: usize = 256;

/// The bucket `(batch, kv_len)` a step of `batch` rows reading `kv_len` positions
/// runs at, or `None` (eager then) past the largest bucket (whose MoE layers would
/// take the grouped kernel's prefill path, which is not capturable), past the
/// slots' length, or with no rows.
pub fn bucket(batch: usize, kv_len: usize, slots: usize, max_len: usize) -> Option<(usize, usize)> {
    let b = BATCH_BUCKETS
        .iter()
        .copied()
        .find(|&b| b >= batch)?
        .min(slots);
    if b < batch || kv_len > max_len || batch == 0 {
        return None;
    }
    let l = kv_len.div_ceil(KV_BUCKET).max(1) * KV_BUCKET;
    Some((b, l.min(max_len)))
}

/// One captured graph, replayed on the stream of the thread that captured it (a
/// stage's worker thread: candle's CUDA device uses per-thread streams).
pub struct StepGraph {
    #[cfg(feature = "cuda")]
    graph: candle_core::cuda::cudarc::driver::CudaGraph,
}

// SAFETY: CUDA requires calls on one graph to be serialized, not made from one
// thread; a `StepGraph` is owned by one stage, which steps on one thread at a time.
unsafe impl Send for StepGraph {}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}

#[cfg(feature = "cuda")]
fn driver_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("CUDA graph {what}: {e:?}"))
}

impl StepGraph {
    /// Runs `step` once eagerly (kernels load, candle's caches fill, cuBLAS sets up),
    /// then captures a second run of it. `step` must read and write only tensors
    /// that outlive the graph, and drop everything else it makes before returning.
    pub fn capture(device: &Device, mut step: impl FnMut() -> Result<()>) -> Result<Self> {
        #[cfg(feature = "cuda")]
        {
            use candle_core::cuda::cudarc::driver::sys;
            let dev = device.as_cuda_device()?;
            let _cache = dev.enable_cuda_graph_htod_cache();
            step()?;
            let stream = dev.cuda_stream();
            stream.synchronize().map_err(|e| driver_err("warm-up", e))?;
            // Thread-local: another stage's thread may allocate meanwhile.
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| driver_err("begin", e))?;
            let ran = step();
            // Always end the capture, so the stream is usable whatever happened.
            let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            ran?;
            let graph = ended
                .map_err(|e| driver_err("capture", e))?
                .ok_or_else(|| driver_err("capture", "empty graph"))?;
            graph.upload().map_err(|e| driver_err("upload", e))?;
            // The stage may replay it from another thread's stream: finish here.
            stream.synchronize().map_err(|e| driver_err("upload", e))?;
            Ok(Self { graph })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, &mut step);
            candle_core::bail!("CUDA graphs need the cuda build")
        }
    }

    /// Replays the captured step on a stream of the highest priority, ordered after
    /// the work already queued on the calling thread's stream (which waits for the
    /// replay in turn). The GPU's block scheduler then serves this graph's kernels
    /// before other streams' pending ones: the Talker's steps are not starved by the
    /// Thinker's back-to-back replays, which share the GPU.
    pub fn launch_urgent(&self, device: &Device) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            use candle_core::cuda::cudarc::driver::{result, sys, CudaStream};
            use std::cell::RefCell;
            use std::sync::Arc;
            /// A stream made with the raw driver call: cudarc's own constructors would
            /// put the context in multi-stream mode, whose per-tensor event tracking
            /// breaks later captures and taxes every launch. The engine orders its
            /// streams itself (the joins below).
            struct Urgent(Arc<CudaStream>, sys::CUstream);
            impl Drop for Urgent {
                fn drop(&mut self) {
                    // SAFETY: made below and owned here; nothing uses it after its thread.
                    let _ = unsafe { result::stream::destroy(self.1) };
                }
            }
            thread_local! {
                static URGENT: RefCell<Option<Urgent>> = const { RefCell::new(None) };
            }
            let main = device.as_cuda_device()?.cuda_stream();
            let urgent = URGENT.with(|u| -> Result<Arc<CudaStream>> {
                let mut u = u.borrow_mut();
                if let Some(s) = u.as_ref() {
                    return Ok(s.0.clone());
                }
                main.context()
                    .bind_to_thread()
                    .map_err(|e| driver_err("context", e))?;
                let (_, greatest) =
                    result::stream::get_priority_range().map_err(|e| driver_err("priority", e))?;
                let raw = result::stream::create_with_priority(
                    result::stream::StreamKind::NonBlocking,
                    greatest,
                )
                .map_err(|e| driver_err("stream", e))?;
                // SAFETY: a valid stream of this context, destroyed only by `Urgent`,
                // which outlives every use (the wrapper is only used on this thread).
                let s = unsafe { main.context().wrap_borrowed_stream(raw) };
                *u = Some(Urgent(s.clone(), raw));
                Ok(s)
            })?;
            urgent.join(&main).map_err(|e| driver_err("order", e))?;
            // SAFETY: the executable graph lives as long as `self`; any stream of its
            // context may launch it, and the joins order it with candle's stream.
            unsafe { result::graph::launch(self.graph.cu_graph_exec(), urgent.cu_stream()) }
                .map_err(|e| driver_err("launch", e))?;
            main.join(&urgent).map_err(|e| driver_err("order", e))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            candle_core::bail!("CUDA graphs need the cuda build")
        }
    }

    /// Replays the captured step (asynchronously, on the calling thread's stream).
    pub fn launch(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            self.graph.launch().map_err(|e| driver_err("launch", e))
        }
        #[cfg(not(feature = "cuda"))]
        {
            candle_core::bail!("CUDA graphs need the cuda build")
        }
    }
}

/// Host-side priority between the stages of one GPU. CUDA graphs replay back to
/// back, and the Thinker's keep the GPU full; the Talker's prefill and Code2Wav's
/// eager steps run kernel by kernel on a stream of the same priority, so each of
/// their kernels waits behind the Thinker's and first audio comes when the answer
/// is nearly written. A stage in such a section holds an [`UrgentSection`]; the
/// Thinker waits for it ([`yield_to_urgent`]) before it queues its next step.
/// The audio path's graphed steps hold one too: they replay on the urgent stream
/// ([`StepGraph::launch_urgent`]), whose kernels the block scheduler serves
/// first, but beside a Thinker step their chains of small kernels ran three
/// times slower, and c=32 gave less audio than one stage after the other
/// (docs/bench/gpu.md, run 20).
///
/// `OMNISTREAM_STAGE_PRIORITY` (for measurement): `off` turns the wait off, `N`
/// caps it at N ms instead of the caller's cap, `eager` leaves graphed steps out
/// of the sections (they then overlap the Thinker's steps), `code2wav` leaves
/// out Code2Wav's graphed steps only (its convolutions are compute-bound where
/// the Thinker's decode reads weights; the Talker's steps still go first).
static URGENT_SECTIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `OMNISTREAM_STAGE_PRIORITY`, read once.
#[derive(Debug, Clone, Copy)]
struct StagePriority {
    wait: bool,
    cap: Option<std::time::Duration>,
    every_step: bool,
    /// Code2Wav's graphed steps hold no section.
    decoder_overlaps: bool,
}

fn stage_priority() -> StagePriority {
    static P: std::sync::OnceLock<StagePriority> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        let v = std::env::var("OMNISTREAM_STAGE_PRIORITY").unwrap_or_default();
        StagePriority {
            wait: v != "off",
            cap: v.parse().ok().map(std::time::Duration::from_millis),
            every_step: v != "eager",
            decoder_overlaps: v == "eager" || v == "code2wav",
        }
    })
}

/// While alive, the Thinker holds back its next step (see [`yield_to_urgent`]).
#[derive(Debug)]
pub struct UrgentSection(());

impl UrgentSection {
    pub fn enter() -> Self {
        URGENT_SECTIONS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(())
    }

    /// A section for eager work of a stage on `device`, where it shares a GPU
    /// (none on the CPU).
    pub fn on(device: &Device) -> Option<Self> {
        device.is_cuda().then(Self::enter)
    }

    /// A section for a step of a stage on `device`, `graphed` if it replays its
    /// graphs on the urgent stream: as [`Self::on`], except a graphed step with
    /// `OMNISTREAM_STAGE_PRIORITY=eager` (its eager fallbacks then take their own).
    pub fn step(device: &Device, graphed: bool) -> Option<Self> {
        match graphed && !stage_priority().every_step {
            true => None,
            false => Self::on(device),
        }
    }

    /// As [`Self::step`], for Code2Wav's steps: also none for a graphed step
    /// with `OMNISTREAM_STAGE_PRIORITY=code2wav`.
    pub fn decoder_step(device: &Device, graphed: bool) -> Option<Self> {
        match graphed && stage_priority().decoder_overlaps {
            true => None,
            false => Self::on(device),
        }
    }
}

impl Drop for UrgentSection {
    fn drop(&mut self) {
        URGENT_SECTIONS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Waits, at most `max`, while another stage is in an [`UrgentSection`]. At most one
/// step of the caller is then in flight on the GPU (its steps end in a copy to the
/// host), so urgent work waits for that one only.
pub fn yield_to_urgent(max: std::time::Duration) {
    let p = stage_priority();
    if !p.wait {
        return;
    }
    let max = p.cap.unwrap_or(max);
    let start = std::time::Instant::now();
    while URGENT_SECTIONS.load(std::sync::atomic::Ordering::SeqCst) > 0 && start.elapsed() < max {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

/// Clip encodes started and finished (Qwen3-TTS Base: a request's reference
/// clip, encoded before its prefill). Beside the Talker's back-to-back graph
/// replays on the urgent stream, a batch of clips that takes about 12 ms alone
/// took about 380 ms at c=64 on an H100 (docs/bench/qwen3-tts-gpu.md), and every
/// cloned request waits for it: the Talker lets the encodes in flight finish
/// before its next step ([`yield_to_encodes`]).
static ENCODES_STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static ENCODES_FINISHED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// While alive, a clip encode is in flight (see [`yield_to_encodes`]).
#[derive(Debug)]
pub struct EncodeSection(());

impl EncodeSection {
    /// A section for an encode on `device`, where it shares a GPU (none on the CPU).
    pub fn on(device: &Device) -> Option<Self> {
        device.is_cuda().then(|| {
            ENCODES_STARTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Self(())
        })
    }
}

impl Drop for EncodeSection {
    fn drop(&mut self) {
        ENCODES_FINISHED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The longest a step waits for the clip encodes in flight.
pub const ENCODE_WAIT_CAP: std::time::Duration = std::time::Duration::from_millis(50);

/// Which stages wait for the clip encodes in flight, and how long at most:
/// `OMNISTREAM_ENCODE_PRIORITY` (for measurement) `off` (none), `talker` (the
/// Talker only, the default) or `all` (the Talker and Code2Wav: first audio
/// 10% later at c=64 on an H100, docs/bench/qwen3-tts-gpu.md), and
/// `OMNISTREAM_ENCODE_WAIT_MS` in place of the caller's cap.
#[derive(Debug, Clone, Copy)]
struct EncodePriority {
    talker: bool,
    decoder: bool,
    cap: Option<std::time::Duration>,
}

fn encode_priority() -> EncodePriority {
    static P: std::sync::OnceLock<EncodePriority> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        let v = std::env::var("OMNISTREAM_ENCODE_PRIORITY").unwrap_or_default();
        let cap = std::env::var("OMNISTREAM_ENCODE_WAIT_MS").ok();
        EncodePriority {
            talker: v != "off",
            decoder: v == "all",
            cap: cap
                .and_then(|v| v.parse().ok())
                .map(std::time::Duration::from_millis),
        }
    })
}

/// Waits, at most `max`, until the clip encodes in flight now have finished (not
/// those that start meanwhile, so a stream of encodes cannot hold the caller
/// back for long); `decoder`: the caller is Code2Wav (see [`EncodePriority`]).
pub fn yield_to_encodes(max: std::time::Duration, decoder: bool) {
    use std::sync::atomic::Ordering::SeqCst;
    let p = encode_priority();
    if !(if decoder { p.decoder } else { p.talker }) {
        return;
    }
    let max = p.cap.unwrap_or(max);
    let target = ENCODES_STARTED.load(SeqCst);
    let start = std::time::Instant::now();
    while ENCODES_FINISHED.load(SeqCst) < target && start.elapsed() < max {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

/// Whether decode steps on `device` can run as graphs (a CUDA device in the cuda build).
pub fn available(device: &Device) -> bool {
    cfg!(feature = "cuda") && device.is_cuda()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wait ends when the encodes in flight at its start finish, whatever
    /// starts meanwhile; and at its cap if they do not.
    #[test]
    fn yield_to_encodes_waits_for_the_encodes_in_flight_only() {
        use std::sync::atomic::Ordering::SeqCst;
        use std::time::{Duration, Instant};
        // The counters as a GPU's sections move them (a CPU takes none).
        ENCODES_STARTED.fetch_add(1, SeqCst);
        let done = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            // Another starts before the first ends.
            ENCODES_STARTED.fetch_add(1, SeqCst);
            ENCODES_FINISHED.fetch_add(1, SeqCst);
        });
        let t = Instant::now();
        yield_to_encodes(Duration::from_secs(5), false);
        let waited = t.elapsed();
        done.join().unwrap();
        assert!(waited >= Duration::from_millis(30), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        // The second is still in flight: the next wait ends at its cap.
        let t = Instant::now();
        yield_to_encodes(Duration::from_millis(20), false);
        assert!(t.elapsed() >= Duration::from_millis(20));
        ENCODES_FINISHED.fetch_add(1, SeqCst);
        let t = Instant::now();
        yield_to_encodes(Duration::from_secs(5), false);
        assert!(t.elapsed() < Duration::from_secs(1));
        assert!(EncodeSection::on(&Device::Cpu).is_none());
    }

    #[test]
    fn buckets_round_up_within_the_slots() {
        assert_eq!(bucket(1, 10, 32, 4096), Some((1, 256)));
        assert_eq!(bucket(3, 256, 32, 4096), Some((4, 256)));
        assert_eq!(bucket(3, 257, 32, 4096), Some((4, 512)));
        assert_eq!(bucket(20, 4000, 32, 4096), Some((24, 4096)));
        // Fewer slots than the next bucket: the batch itself, capped by the slots.
        assert_eq!(bucket(20, 100, 20, 4096), Some((20, 256)));
        assert_eq!(bucket(5, 100, 6, 300), Some((6, 256)));
        assert_eq!(bucket(5, 290, 6, 300), Some((6, 300)));
        // Past the slots' length, or no rows: eager.
        assert_eq!(bucket(5, 301, 6, 300), None);
        assert_eq!(bucket(0, 1, 6, 300), None);
        assert_eq!(bucket(48, 10, 64, 4096), Some((48, 256)));
        assert_eq!(bucket(49, 10, 64, 4096), Some((64, 256)));
        assert_eq!(bucket(65, 10, 128, 4096), None);
    }
}
