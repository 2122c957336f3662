//! The 12 Hz speech tokenizer's decoder (`Qwen3TTSTokenizerV2Decoder`): codes
//! (16 quantizers at 12.5 Hz) to 24 kHz audio, streamed exactly.
//!
//! It is the engine's [`Code2Wav`] as [`Code2WavVariant::Tts12Hz`]: the split RVQ
//! (quantizer 0 and the rest, each a sum of codebook rows projected by
//! `output_proj`) and `pre_conv` (causal, k=3) in front of the same sliding-window
//! transformer (between `input_proj` and `output_proj`) and convolutional
//! upsampler.
//!
//! # Alignment with the reference
//!
//! The reference's transposed convs (k = 2s) trim only the right side: output
//! block j of s samples is `x[j] W[..s] + x[j-1] W[s..]` (with `x[-1] = 0`), and
//! the last block, the only one that needs a future input, is dropped. So the
//! reference is causal and its output for F frames is exactly `F*1920` samples,
//! a prefix of its output for F+1 frames. Ours carries every layer's state
//! (the K/V window, each causal conv's left context, each transposed conv's
//! pending half block) and returns, for F frames in chunks of any sizes,
//!
//! ```text
//! ours[i] = reference(all F frames)[i]      for i in 0..F*1920
//! ```
//!
//! with no lag and no flush (each chunk of n frames gives exactly n*1920
//! samples). The reference's own `decode` goes through `chunked_decode` (300-frame
//! chunks re-decoded with 25 frames of left context), which differs from the
//! one-shot decode only past 300 frames; the tests compare both.

use std::path::Path;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use super::config::{ConfigError, SpeechTokenizerConfig};
use crate::models::qwen3_omni::code2wav::Code2Wav;

/// Loading the decoder failed.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: {source}")]
    Weights {
        path: String,
        source: candle_core::Error,
    },
}

/// The decoder of `speech_tokenizer/` under a checkpoint folder, with its config.
pub fn load_decoder(
    dir: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(Code2Wav, SpeechTokenizerConfig), CodecError> {
    let cfg = SpeechTokenizerConfig::load(dir)?;
    let path = dir.join("speech_tokenizer").join("model.safetensors");
    let err = |source| CodecError::Weights {
        path: path.display().to_string(),
        source,
    };
    // SAFETY: checkpoint files are not modified while the server runs.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&[&path], dtype, device) }.map_err(err)?;
    let dec = Code2Wav::new(&cfg.decoder_config, vb.pp("decoder")).map_err(err)?;
    Ok((dec, cfg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures::max_abs_diff;
    use crate::models::qwen3_tts::fixtures;
    use candle_core::Tensor;

    fn decoder() -> Code2Wav {
        load_decoder(&fixtures::model_dir(), DType::F32, &Device::Cpu)
            .unwrap()
            .0
    }

    /// Our decode of `codes` in chunks of `sizes` (cycled), unclamped.
    fn streamed(dec: &Code2Wav, codes: &Tensor, sizes: &[usize]) -> Tensor {
        let n = codes.dim(2).unwrap();
        let mut state = dec.new_state();
        let (mut at, mut out, mut i) = (0, Vec::new(), 0);
        while at < n {
            let k = sizes[i % sizes.len()].min(n - at);
            let wav = dec
                .step(&mut state, &codes.narrow(2, at, k).unwrap())
                .unwrap();
            assert_eq!(wav.dim(2).unwrap(), k * 1920, "a chunk of {k} frames");
            out.push(wav);
            at += k;
            i += 1;
        }
        Tensor::cat(&out, 2).unwrap()
    }

    #[test]
    fn one_shot_and_streamed_match_reference() {
        let dec = decoder();
        assert_eq!((dec.samples_per_frame(), dec.delay_samples()), (1920, 0));
        let io = fixtures::io("codec");
        for f in [1usize, 5, 20] {
            let codes = &io[&format!("codes_{f}")];
            let want = io[&format!("wav_{f}")].clamp(-1f32, 1f32).unwrap();
            let one = dec.decode(codes).unwrap();
            assert_eq!(one.dims(), want.dims());
            let e = max_abs_diff(&one, &want);
            assert!(e < 1e-4, "{f} frames one-shot: {e}");
            for sizes in [&[1usize][..], &[2, 3], &[1, 2, 4, 8], &[7]] {
                let s = streamed(&dec, codes, sizes);
                let e = max_abs_diff(&s, &want);
                assert!(e < 1e-4, "{f} frames in chunks {sizes:?}: {e}");
            }
        }
    }

    /// The reference's `chunked_decode` (chunks re-decoded with a few frames of
    /// left context) agrees with its one-shot decode only within a chunk of
    /// left context: shown here so the exactness claim above is about the right
    /// baseline.
    #[test]
    fn reference_chunked_decode_differs_after_its_first_chunk() {
        let io = fixtures::io("codec");
        let meta = fixtures::meta("codec");
        let chunk = meta["chunk"].as_u64().unwrap() as usize;
        let one = io["wav_20"].clamp(-1f32, 1f32).unwrap();
        let chunked = &io["chunked_20"];
        assert_eq!(chunked.dims(), one.dims());
        let head = chunk * 1920;
        let e = max_abs_diff(
            &chunked.narrow(2, 0, head).unwrap(),
            &one.narrow(2, 0, head).unwrap(),
        );
        assert!(e < 1e-5, "first chunk: {e}");
        let tail = max_abs_diff(
            &chunked.narrow(2, head, 15 * 1920).unwrap(),
            &one.narrow(2, head, 15 * 1920).unwrap(),
        );
        assert!(tail > 1e-3, "later chunks lose the long context: {tail}");
    }

    /// A cloned voice's clip seeds a stream (the transformer over the clip, the
    /// convolutions over its last frames only), and what follows is the
    /// one-shot decode of the clip and the new codes together, past the clip;
    /// two clips seeded at once, for clips longer and shorter than the
    /// convolutions' context and than the K/V window.
    #[test]
    fn seeded_streams_continue_the_one_shot_decode() {
        let dec = decoder();
        let tail = dec.conv_context_frames();
        assert_eq!(tail, 10, "the released rates' context");
        let sizes = [(1, true), (2, false), (4, false), (8, false)];
        let mut x = 7u64;
        let mut codes = |frames: usize| {
            let v: Vec<u32> = (0..2 * 4 * frames)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) % 64) as u32
                })
                .collect();
            Tensor::from_vec(v, (2, 4, frames), &Device::Cpu).unwrap()
        };
        for clip in [3usize, tail, tail + 1, 19, 40] {
            let (seed, next) = (codes(clip), codes(6));
            let whole = dec
                .decode(&Tensor::cat(&[&seed, &next], 2).unwrap())
                .unwrap();
            let want = whole.narrow(2, clip * 1920, 6 * 1920).unwrap();
            let mut slots = dec.new_slots(4);
            // A stream already in slot 0, so the slots have their shapes.
            dec.step_slots(&mut slots, &[0], &codes(2).narrow(0, 0, 1).unwrap())
                .unwrap();
            dec.seed_slots(&mut slots, None, &[3, 1], &seed, &sizes)
                .unwrap();
            assert_eq!((slots.frames(3), slots.frames(1)), (clip, clip));
            let got = dec.step_slots(&mut slots, &[3, 1], &next).unwrap();
            let e = max_abs_diff(&got, &want);
            assert!(e < 1e-4, "a clip of {clip} frames: {e}");
        }
        // Only fresh streams take a seed.
        let mut slots = dec.new_slots(2);
        dec.step_slots(&mut slots, &[0], &codes(2).narrow(0, 0, 1).unwrap())
            .unwrap();
        let seed = codes(12).narrow(0, 0, 1).unwrap();
        assert!(dec
            .seed_slots(&mut slots, None, &[0], &seed, &sizes)
            .is_err());
    }

    #[test]
    fn bad_codes_are_refused() {
        let dec = decoder();
        let over = Tensor::full(64u32, (1, 4, 2), &Device::Cpu).unwrap();
        assert!(dec.decode(&over).is_err());
        let wrong_groups = Tensor::zeros((1, 3, 2), DType::U32, &Device::Cpu).unwrap();
        assert!(dec.decode(&wrong_groups).is_err());
    }
}
