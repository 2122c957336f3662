//! The short-time Fourier transform the log-mel front ends share (Qwen3-Omni's
//! audio encoder, Qwen3-TTS's speaker encoder), as torch.stft computes it: a
//! periodic Hann window, reflect padding, one-sided spectrum; in float64 on the
//! host, one real FFT a frame (realfft, rubato's own FFT: O(n log n) a frame
//! where the DFT as a matmul was O(n²), about 1 GFLOP for a 5 s clip at
//! n_fft 1024, on the thread that asked).

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use realfft::{RealFftPlanner, RealToComplex};

/// One frame length's planned FFT and its Hann window.
#[derive(Clone)]
pub struct Stft {
    /// torch.hann_window(n_fft) (periodic), rounded to f32 as the references
    /// hold it.
    window: Vec<f64>,
    fft: Arc<dyn RealToComplex<f64>>,
}

impl std::fmt::Debug for Stft {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stft")
            .field("n_fft", &self.window.len())
            .finish()
    }
}

impl Stft {
    pub fn new(n_fft: usize) -> Self {
        let window = (0..n_fft)
            .map(|j| {
                (0.5 - 0.5 * (2.0 * std::f64::consts::PI * j as f64 / n_fft as f64).cos()) as f32
                    as f64
            })
            .collect();
        Self {
            window,
            fft: RealFftPlanner::<f64>::new().plan_fft_forward(n_fft),
        }
    }

    /// The spectrum `(n_frames, n_fft / 2 + 1)` (real, imaginary) of `pcm`
    /// framed every `hop` samples from `-pad` (reflect padding, not repeating
    /// the edge sample): needs `pcm.len() > pad`.
    pub fn spectrum(
        &self,
        pcm: &[f32],
        hop: usize,
        pad: usize,
        n_frames: usize,
    ) -> Result<(Tensor, Tensor)> {
        let n_fft = self.window.len();
        let n_bins = n_fft / 2 + 1;
        let len = pcm.len() as isize;
        if len <= pad as isize {
            candle_core::bail!("{len} samples are too few for a reflect padding of {pad}");
        }
        let mut frame = self.fft.make_input_vec();
        let mut bins = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        let (mut re, mut im) = (
            Vec::with_capacity(n_frames * n_bins),
            Vec::with_capacity(n_frames * n_bins),
        );
        for f in 0..n_frames {
            for (j, v) in frame.iter_mut().enumerate() {
                let mut i = (f * hop + j) as isize - pad as isize;
                if i < 0 {
                    i = -i;
                } else if i >= len {
                    i = 2 * (len - 1) - i;
                }
                // Only a frame reaching past the reflection of the whole clip
                // (a clip shorter than a frame) could leave it; clamp rather
                // than index out of range.
                *v = pcm[i.clamp(0, len - 1) as usize] as f64 * self.window[j];
            }
            self.fft
                .process_with_scratch(&mut frame, &mut bins, &mut scratch)
                .map_err(|e| candle_core::Error::Msg(format!("stft: {e}")))?;
            re.extend(bins.iter().map(|c| c.re));
            im.extend(bins.iter().map(|c| c.im));
        }
        Ok((
            Tensor::from_vec(re, (n_frames, n_bins), &Device::Cpu)?,
            Tensor::from_vec(im, (n_frames, n_bins), &Device::Cpu)?,
        ))
    }
}

/// A slaney mel filterbank (librosa's default, as [`super::whisper::mel_filters`])
/// as `[n_bins, n_mels]` f64, ready to multiply a spectrum.
pub fn mel_basis(sample_rate: usize, n_fft: usize, n_mels: usize) -> Result<Tensor> {
    let filters = super::whisper::mel_filters(sample_rate, n_fft, n_mels);
    Tensor::from_vec(filters, (n_mels, n_fft / 2 + 1), &Device::Cpu)?
        .to_dtype(DType::F64)?
        .t()?
        .contiguous()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DFT as the sum it is (what the front ends computed before, as a
    /// matmul against this basis): `(n_frames, n_bins)` re and im.
    fn direct(
        pcm: &[f32],
        n_fft: usize,
        hop: usize,
        pad: usize,
        n_frames: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let s = Stft::new(n_fft);
        let (n_bins, len) = (n_fft / 2 + 1, pcm.len() as isize);
        let (mut re, mut im) = (vec![0.0; n_frames * n_bins], vec![0.0; n_frames * n_bins]);
        for f in 0..n_frames {
            for j in 0..n_fft {
                let mut i = (f * hop + j) as isize - pad as isize;
                if i < 0 {
                    i = -i;
                } else if i >= len {
                    i = 2 * (len - 1) - i;
                }
                let x = pcm[i as usize] as f64 * s.window[j];
                for k in 0..n_bins {
                    let a = 2.0 * std::f64::consts::PI * ((j * k) % n_fft) as f64 / n_fft as f64;
                    re[f * n_bins + k] += x * a.cos();
                    im[f * n_bins + k] -= x * a.sin();
                }
            }
        }
        (re, im)
    }

    #[test]
    fn the_fft_is_the_dft() {
        // Both front ends' shapes: Whisper's 400/160 (a mixed radix) and the
        // speaker encoder's 1024/256.
        let pcm: Vec<f32> = (0..4000)
            .map(|i| ((i as f32 * 0.037).sin() + 0.3 * (i as f32 * 0.51).cos()) * 0.5)
            .collect();
        for (n_fft, hop, pad) in [(400, 160, 200), (1024, 256, 384)] {
            let n_frames = (pcm.len() + 2 * pad - n_fft) / hop + 1;
            let (re, im) = Stft::new(n_fft).spectrum(&pcm, hop, pad, n_frames).unwrap();
            let (dre, dim) = direct(&pcm, n_fft, hop, pad, n_frames);
            for (got, want) in [(re, dre), (im, dim)] {
                let got = got.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                assert!(worst < 1e-9, "n_fft {n_fft}: {worst}");
            }
        }
        // Too short for its padding: an error, not a panic.
        assert!(Stft::new(400).spectrum(&pcm[..100], 160, 200, 1).is_err());
    }
}
