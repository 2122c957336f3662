//! Reference clips encoded in batches: every clip that arrives while a batch
//! is encoding goes into the next one, so 64 requests cloning at once cost a
//! few batched passes of the speaker and codec encoders instead of 64
//! interleaved ones (each encode alone is bound by kernel launches on a GPU).
//! Each clip comes out as it would alone (the encoders mask each clip's own
//! length: see the Qwen3-TTS speaker and codec encoders).
//!
//! One thread runs the encoders; [`next_batch`] decides what it takes (first
//! come first, up to a clip count and a total length), without I/O.

use std::collections::VecDeque;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use omnistream_stages::engine::{EncodeTimes, EncodedVoice, VoiceClip, VoiceEncoder};
use prometheus::{Histogram, HistogramVec};
use tokio::sync::oneshot;

/// The most clips a batch takes.
pub const MAX_BATCH_CLIPS: usize = 64;
/// The most audio a batch takes, in seconds: bounds the encoders' activations.
/// The codec encoder's first layers run at the full sample rate: at the
/// released shapes (f32) a batch peaks at about 42 MB a second of audio
/// (measured on the CPU: 4 and 8 clips of 5 s, +850 and +1,711 MB), so about
/// 6.7 GB here; the speaker encoder takes a sixth of that.
pub const MAX_BATCH_SECONDS: usize = 160;

/// One clip waiting to be encoded.
struct Job {
    pcm: Vec<f32>,
    in_context: bool,
    asked: Instant,
    reply: oneshot::Sender<Result<EncodedVoice, String>>,
}

/// The encoders' batching front: cheap to share, [`Self::encode`] from any task.
pub struct ClipEncoder {
    encoder: Arc<dyn VoiceEncoder>,
    jobs: mpsc::Sender<Job>,
}

/// The metrics a batch reports.
#[derive(Clone)]
pub struct EncodeMetrics {
    /// `voice_encode_seconds{part}`: each clip's wait, speaker and codes time.
    pub parts: HistogramVec,
    /// `voice_encode_batch_clips`: clips per batch.
    pub batch: Histogram,
}

impl ClipEncoder {
    /// Starts the encoding thread; it ends when the last handle is dropped.
    pub fn start(encoder: Arc<dyn VoiceEncoder>, metrics: EncodeMetrics) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::channel();
        let max_samples = MAX_BATCH_SECONDS * encoder.sample_rate() as usize;
        let enc = encoder.clone();
        std::thread::Builder::new()
            .name("voice-encode".into())
            .spawn(move || run(enc.as_ref(), rx, &metrics, max_samples))?;
        Ok(Self { encoder, jobs })
    }

    /// The encoders behind it (their rate, shortest clip, in-context support).
    pub fn encoder(&self) -> &Arc<dyn VoiceEncoder> {
        &self.encoder
    }

    /// `pcm` (at the encoder's rate) to its embedding and, `in_context`, its
    /// codes, in the next batch.
    pub async fn encode(&self, pcm: Vec<f32>, in_context: bool) -> Result<EncodedVoice, String> {
        let (reply, rx) = oneshot::channel();
        let job = Job {
            pcm,
            in_context,
            asked: Instant::now(),
            reply,
        };
        self.jobs
            .send(job)
            .map_err(|_| "the voice encoders stopped".to_string())?;
        rx.await
            .map_err(|_| "the voice encoders stopped".to_string())?
    }
}

/// Takes the next batch off the front of `queue`: at least one clip, then
/// more in order while there are at most `max_clips` and `max_samples` in all.
fn next_batch<T>(
    queue: &mut VecDeque<T>,
    len: impl Fn(&T) -> usize,
    max_clips: usize,
    max_samples: usize,
) -> Vec<T> {
    let mut batch = Vec::new();
    let mut total = 0;
    while let Some(next) = queue.front() {
        let n = len(next);
        if !batch.is_empty() && (batch.len() >= max_clips || total + n > max_samples) {
            break;
        }
        total += n;
        batch.extend(queue.pop_front());
    }
    batch
}

/// `clips` encoded in one batch, one result a clip in order. A batch that
/// fails is encoded again clip by clip, so one clip's failure is not the
/// others' (and is logged: a failing batch would otherwise go unseen).
fn encode_each(
    encoder: &dyn VoiceEncoder,
    clips: &[VoiceClip],
) -> Vec<Result<(EncodedVoice, EncodeTimes), String>> {
    match encoder.encode(clips) {
        Ok((done, times)) if done.len() == clips.len() => {
            done.into_iter().map(|d| Ok((d, times))).collect()
        }
        Ok((done, _)) => vec![
            Err(format!(
                "the voice encoders returned {} results for {} clips",
                done.len(),
                clips.len()
            ));
            clips.len()
        ],
        Err(e) if clips.len() > 1 => {
            tracing::warn!(
                "a batch of {} clips failed ({e}); encoding each alone",
                clips.len()
            );
            clips
                .iter()
                .map(|c| {
                    let (mut done, times) = encoder
                        .encode(std::slice::from_ref(c))
                        .map_err(|e| e.to_string())?;
                    match done.pop() {
                        Some(d) => Ok((d, times)),
                        None => Err("the voice encoders returned nothing".into()),
                    }
                })
                .collect()
        }
        Err(e) => vec![Err(e.to_string())],
    }
}

fn run(
    encoder: &dyn VoiceEncoder,
    rx: mpsc::Receiver<Job>,
    metrics: &EncodeMetrics,
    max_samples: usize,
) {
    let mut queue = VecDeque::new();
    loop {
        if queue.is_empty() {
            match rx.recv() {
                Ok(job) => queue.push_back(job),
                Err(_) => return,
            }
        }
        queue.extend(rx.try_iter());
        let batch = next_batch(&mut queue, |j| j.pcm.len(), MAX_BATCH_CLIPS, max_samples);
        // A client gone before its clip's turn costs nothing.
        let batch: Vec<Job> = batch.into_iter().filter(|j| !j.reply.is_closed()).collect();
        if batch.is_empty() {
            continue;
        }
        let started = Instant::now();
        metrics.batch.observe(batch.len() as f64);
        for job in &batch {
            metrics
                .parts
                .with_label_values(&["wait"])
                .observe((started - job.asked).as_secs_f64());
        }
        let clips: Vec<VoiceClip> = batch
            .iter()
            .map(|j| VoiceClip {
                pcm: &j.pcm,
                in_context: j.in_context,
            })
            .collect();
        let results = encode_each(encoder, &clips);
        for (job, result) in batch.into_iter().zip(results) {
            let result = result.map(|(done, times)| {
                let observe = |part, d: std::time::Duration| {
                    metrics
                        .parts
                        .with_label_values(&[part])
                        .observe(d.as_secs_f64())
                };
                observe("speaker", times.speaker);
                if done.codes.is_some() {
                    observe("codes", times.codes);
                }
                done
            });
            // The client may have gone meanwhile.
            let _ = job.reply.send(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnistream_stages::models::ModelError;

    /// Embeds a clip as its first sample; fails any call with a NaN clip.
    struct Fake;

    impl VoiceEncoder for Fake {
        fn sample_rate(&self) -> u32 {
            24_000
        }
        fn min_samples(&self) -> usize {
            1
        }
        fn in_context(&self) -> bool {
            true
        }
        fn encode(
            &self,
            clips: &[VoiceClip<'_>],
        ) -> Result<(Vec<EncodedVoice>, EncodeTimes), ModelError> {
            if clips.iter().any(|c| c.pcm.iter().any(|x| x.is_nan())) {
                return Err(ModelError::Invalid("a NaN clip".into()));
            }
            let done = clips
                .iter()
                .map(|c| EncodedVoice {
                    embedding: vec![c.pcm[0]],
                    codes: c.in_context.then(|| vec![vec![c.pcm.len() as u32]]),
                })
                .collect();
            Ok((done, EncodeTimes::default()))
        }
    }

    #[test]
    fn a_bad_clip_fails_only_itself() {
        let (good, bad, other) = ([0.5f32; 4], [f32::NAN; 4], [0.25f32; 3]);
        let clip = |pcm, in_context| VoiceClip { pcm, in_context };
        let got = encode_each(
            &Fake,
            &[clip(&good, true), clip(&bad, false), clip(&other, false)],
        );
        assert_eq!(got.len(), 3);
        let (first, _) = got[0].as_ref().unwrap();
        assert_eq!(
            (first.embedding.as_slice(), first.codes.clone()),
            (&[0.5][..], Some(vec![vec![4]]))
        );
        assert!(got[1].as_ref().unwrap_err().contains("NaN"));
        let (third, _) = got[2].as_ref().unwrap();
        assert_eq!(
            (third.embedding.as_slice(), third.codes.clone()),
            (&[0.25][..], None)
        );
        // Alone, a bad clip is its own error.
        assert!(encode_each(&Fake, &[clip(&bad, true)])[0].is_err());
    }

    fn take(queue: &[usize], clips: usize, samples: usize) -> (Vec<usize>, Vec<usize>) {
        let mut q: VecDeque<usize> = queue.iter().copied().collect();
        let batch = next_batch(&mut q, |&n| n, clips, samples);
        (batch, q.into_iter().collect())
    }

    #[test]
    fn a_batch_takes_clips_in_order_within_its_limits() {
        // Everything waiting, when it fits.
        assert_eq!(take(&[3, 4, 5], 8, 100), (vec![3, 4, 5], vec![]));
        // No more than the clip count.
        assert_eq!(take(&[3, 4, 5], 2, 100), (vec![3, 4], vec![5]));
        // No more than the total length, and never out of order (the 1 that
        // would fit waits behind the 9).
        assert_eq!(take(&[3, 4, 9, 1], 8, 10), (vec![3, 4], vec![9, 1]));
        // A clip longer than the limit still goes, alone.
        assert_eq!(take(&[50, 1], 8, 10), (vec![50], vec![1]));
        assert_eq!(take(&[], 8, 10), (vec![], vec![]));
    }
}
