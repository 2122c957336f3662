//! The short-time Fourier transform the log-mel front ends share (Qwen3-Omni's
//! audio encoder, Qwen3-TTS's speaker encoder), as torch.stft computes it: a
//! periodic Hann window, reflect padding, one-sided spectrum; in float64 on the
//! host, a matmul against a precomputed basis.

use candle_core::{DType, Device, Result, Tensor};

/// `[n_fft, 2 * (n_fft / 2 + 1)]`: the Hann-windowed DFT basis, cos then -sin.
pub fn dft_basis(n_fft: usize) -> Result<Tensor> {
    let n_bins = n_fft / 2 + 1;
    let mut basis = vec![0f64; n_fft * 2 * n_bins];
    for j in 0..n_fft {
        // torch.hann_window(n_fft) (periodic), f32 as the references hold it.
        let w = (0.5 - 0.5 * (2.0 * std::f64::consts::PI * j as f64 / n_fft as f64).cos()) as f32
            as f64;
        for k in 0..n_bins {
            // Reduce j * k mod n_fft first so the angle is exact.
            let a = 2.0 * std::f64::consts::PI * ((j * k) % n_fft) as f64 / n_fft as f64;
            basis[j * 2 * n_bins + k] = w * a.cos();
            basis[j * 2 * n_bins + n_bins + k] = -w * a.sin();
        }
    }
    Tensor::from_vec(basis, (n_fft, 2 * n_bins), &Device::Cpu)
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

/// The spectrum `(n_frames, n_bins)` (real, imaginary) of `pcm` framed every
/// `hop` samples from `-pad` (reflect padding, not repeating the edge sample):
/// needs `pcm.len() > pad`.
pub fn spectrum(
    pcm: &[f32],
    basis: &Tensor,
    hop: usize,
    pad: usize,
    n_frames: usize,
) -> Result<(Tensor, Tensor)> {
    let n_fft = basis.dim(0)?;
    let len = pcm.len() as isize;
    let mut frames = vec![0f64; n_frames * n_fft];
    for (f, row) in frames.chunks_mut(n_fft).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            let mut i = (f * hop + j) as isize - pad as isize;
            if i < 0 {
                i = -i;
            } else if i >= len {
                i = 2 * (len - 1) - i;
            }
            *v = pcm[i as usize] as f64;
        }
    }
    let n_bins = n_fft / 2 + 1;
    let spec = Tensor::from_vec(frames, (n_frames, n_fft), &Device::Cpu)?.matmul(basis)?;
    Ok((spec.narrow(1, 0, n_bins)?, spec.narrow(1, n_bins, n_bins)?))
}
