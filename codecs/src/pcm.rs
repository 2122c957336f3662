//! PCM sample conversions.

/// f32 in [-1, 1] to signed 16-bit, clamping (never wrapping) out-of-range input.
pub fn f32_to_i16(x: f32) -> i16 {
    if x.is_nan() {
        return 0;
    }
    (x.clamp(-1.0, 1.0) * i16::MAX as f32).round() as i16
}

pub fn i16_to_f32(x: i16) -> f32 {
    x as f32 / i16::MAX as f32
}

/// f32 samples to little-endian PCM16 bytes.
pub fn f32_to_pcm16_le(samples: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(samples.len() * 2);
    for &s in samples {
        out.extend_from_slice(&f32_to_i16(s).to_le_bytes());
    }
    out
}

/// Little-endian PCM16 bytes to f32 samples; a trailing odd byte is an error.
pub fn pcm16_le_to_f32(bytes: &[u8]) -> Result<Vec<f32>, crate::CodecError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(crate::CodecError::Invalid(format!(
            "PCM16 needs an even number of bytes, got {}",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(2)
        .map(|b| i16_to_f32(i16::from_le_bytes([b[0], b[1]])))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_clamp_and_round_trip() {
        assert_eq!(f32_to_i16(1.0), i16::MAX);
        assert_eq!(f32_to_i16(-1.0), -i16::MAX);
        assert_eq!(f32_to_i16(3.0), i16::MAX);
        assert_eq!(f32_to_i16(-3.0), -i16::MAX);
        assert_eq!(f32_to_i16(f32::NAN), 0);
        assert_eq!(f32_to_i16(0.0), 0);
        let xs = [0.0, 0.5, -0.25, 0.999, -1.0];
        let back = pcm16_le_to_f32(&f32_to_pcm16_le(&xs)).unwrap();
        for (a, b) in xs.iter().zip(back) {
            assert!((a - b).abs() < 1.0 / 32767.0, "{a} vs {b}");
        }
        assert!(pcm16_le_to_f32(&[1, 2, 3]).is_err());
    }
}
