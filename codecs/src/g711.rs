//! G.711 (ITU-T) μ-law and A-law companding: 16-bit linear PCM to 8-bit
//! codes and back, as RTP's PCMU and PCMA payloads carry them (8 kHz, one
//! byte per sample).
//!
//! The algorithm is the classic Sun/CCITT `g711.c` (public domain), which
//! takes the full 16-bit range: μ-law adds a bias of 0x84 (33 in 14-bit
//! units) and clips the magnitude at 32635, A-law works on the magnitude and
//! flips the even bits of the code with 0x55. Decoding gives the midpoint of
//! each quantization interval, exactly the values of G.711's tables (scaled
//! from 14 bits (μ) or 13 bits (A) to 16).

use crate::pcm::{f32_to_i16, i16_to_f32};

/// μ-law bias, added to the magnitude so that segments start at powers of two.
const ULAW_BIAS: i32 = 0x84;
/// Largest μ-law magnitude that still fits after the bias (0x7FFF - 0x84).
const ULAW_CLIP: i32 = 32635;
/// Upper ends of the 8 segments, in biased (μ-law) or plain (A-law) magnitude.
const SEG_END: [i32; 8] = [0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF, 0x3FFF, 0x7FFF];

/// The segment (0..=7) of a magnitude in `0..=0x7FFF`; 8 above.
const fn segment(v: i32) -> i32 {
    let mut s = 0;
    while s < 8 {
        if v <= SEG_END[s] {
            return s as i32;
        }
        s += 1;
    }
    8
}

/// One 16-bit linear sample to its μ-law code.
pub const fn linear_to_ulaw(pcm: i16) -> u8 {
    let pcm = pcm as i32;
    // The code is stored complemented: 0xFF is +0, 0x7F is -0.
    let (mag, mask) = if pcm < 0 { (-pcm, 0x7F) } else { (pcm, 0xFF) };
    let mag = if mag > ULAW_CLIP { ULAW_CLIP } else { mag };
    let v = mag + ULAW_BIAS;
    let seg = segment(v);
    let code = (seg << 4) | ((v >> (seg + 3)) & 0x0F);
    (code ^ mask) as u8
}

/// One μ-law code to 16-bit linear (±32124 at most).
pub const fn ulaw_to_linear(code: u8) -> i16 {
    let u = !code as i32;
    let t = (((u & 0x0F) << 3) + ULAW_BIAS) << ((u & 0x70) >> 4);
    (if u & 0x80 != 0 {
        ULAW_BIAS - t
    } else {
        t - ULAW_BIAS
    }) as i16
}

/// One 16-bit linear sample to its A-law code.
pub const fn linear_to_alaw(pcm: i16) -> u8 {
    let pcm = pcm as i32;
    let (mag, mask) = if pcm >= 0 {
        (pcm, 0xD5)
    } else {
        // A-law's negative side is one's complement in 13 bits: -1 is the
        // smallest negative step, so the magnitude is |pcm| - 1 LSB of 13
        // bits (8 here). g711.c leaves -1..=-7 at a negative magnitude, which
        // its mask turns into code 0x5A (-248); clamping gives -8 as the
        // standard's one's-complement reading does.
        let m = -pcm - 8;
        (if m < 0 { 0 } else { m }, 0x55)
    };
    // Never above 0x7FFF for 16-bit input, so the segment is 0..=7.
    let seg = segment(mag);
    let quant = if seg < 2 {
        (mag >> 4) & 0x0F
    } else {
        (mag >> (seg + 3)) & 0x0F
    };
    (((seg << 4) | quant) ^ mask) as u8
}

/// One A-law code to 16-bit linear (±32256 at most, never 0).
pub const fn alaw_to_linear(code: u8) -> i16 {
    let a = (code ^ 0x55) as i32;
    let mut t = (a & 0x0F) << 4;
    let seg = (a & 0x70) >> 4;
    t += if seg == 0 { 8 } else { 0x108 };
    if seg > 1 {
        t <<= seg - 1;
    }
    (if a & 0x80 != 0 { t } else { -t }) as i16
}

/// Decoding tables: a lookup is cheaper than the shifts, and both are exact.
const ULAW_TABLE: [i16; 256] = {
    let mut t = [0i16; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = ulaw_to_linear(i as u8);
        i += 1;
    }
    t
};

const ALAW_TABLE: [i16; 256] = {
    let mut t = [0i16; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = alaw_to_linear(i as u8);
        i += 1;
    }
    t
};

/// A G.711 companding law: μ-law (PCMU, North America and Japan) or A-law
/// (PCMA, elsewhere). Each code is one 8 kHz sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Law {
    Ulaw,
    Alaw,
}

impl Law {
    pub fn encode(self, pcm: &[i16]) -> Vec<u8> {
        match self {
            Self::Ulaw => ulaw_encode(pcm),
            Self::Alaw => alaw_encode(pcm),
        }
    }

    pub fn decode(self, codes: &[u8]) -> Vec<i16> {
        match self {
            Self::Ulaw => ulaw_decode(codes),
            Self::Alaw => alaw_decode(codes),
        }
    }

    /// pcm16 LE bytes (a trailing odd byte is ignored) to codes.
    pub fn encode_le(self, pcm16: &[u8]) -> Vec<u8> {
        let samples: Vec<i16> = pcm16
            .chunks_exact(2)
            .map(|b| i16::from_le_bytes([b[0], b[1]]))
            .collect();
        self.encode(&samples)
    }

    /// Codes to pcm16 LE bytes.
    pub fn decode_le(self, codes: &[u8]) -> Vec<u8> {
        self.decode(codes)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }
}

/// 16-bit linear samples to μ-law (PCMU) bytes.
pub fn ulaw_encode(pcm: &[i16]) -> Vec<u8> {
    pcm.iter().map(|&s| linear_to_ulaw(s)).collect()
}

/// μ-law (PCMU) bytes to 16-bit linear samples; every byte is a valid code.
pub fn ulaw_decode(codes: &[u8]) -> Vec<i16> {
    codes.iter().map(|&c| ULAW_TABLE[c as usize]).collect()
}

/// 16-bit linear samples to A-law (PCMA) bytes.
pub fn alaw_encode(pcm: &[i16]) -> Vec<u8> {
    pcm.iter().map(|&s| linear_to_alaw(s)).collect()
}

/// A-law (PCMA) bytes to 16-bit linear samples; every byte is a valid code.
pub fn alaw_decode(codes: &[u8]) -> Vec<i16> {
    codes.iter().map(|&c| ALAW_TABLE[c as usize]).collect()
}

/// f32 samples in [-1, 1] (clamped) to μ-law bytes.
pub fn ulaw_encode_f32(pcm: &[f32]) -> Vec<u8> {
    pcm.iter().map(|&s| linear_to_ulaw(f32_to_i16(s))).collect()
}

/// μ-law bytes to f32 samples in [-1, 1].
pub fn ulaw_decode_f32(codes: &[u8]) -> Vec<f32> {
    codes
        .iter()
        .map(|&c| i16_to_f32(ULAW_TABLE[c as usize]))
        .collect()
}

/// f32 samples in [-1, 1] (clamped) to A-law bytes.
pub fn alaw_encode_f32(pcm: &[f32]) -> Vec<u8> {
    pcm.iter().map(|&s| linear_to_alaw(f32_to_i16(s))).collect()
}

/// A-law bytes to f32 samples in [-1, 1].
pub fn alaw_decode_f32(codes: &[u8]) -> Vec<f32> {
    codes
        .iter()
        .map(|&c| i16_to_f32(ALAW_TABLE[c as usize]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// μ-law codes from the most negative value to the most positive: the
    /// complemented sign-magnitude order (0x00..=0x7F negative, large to
    /// small magnitude; 0xFF..=0x80 positive, small to large).
    fn ulaw_order() -> Vec<u8> {
        (0x00..=0x7Fu8).chain((0x80..=0xFFu8).rev()).collect()
    }

    /// A-law codes in value order: with the 0x55 toggle undone, bit 7 is the
    /// sign (1 = positive) and bits 0..=6 the magnitude index.
    fn alaw_order() -> Vec<u8> {
        (0..=0x7Fu8)
            .rev()
            .chain(0x80..=0xFFu8)
            .map(|i| i ^ 0x55)
            .collect()
    }

    /// μ-law quantization step (16-bit units) of a code's segment.
    fn ulaw_step(code: u8) -> i32 {
        8 << ((!code & 0x70) >> 4)
    }

    /// A-law quantization step (16-bit units) of a code's segment: segments
    /// 0 and 1 share the finest step.
    fn alaw_step(code: u8) -> i32 {
        let seg = ((code ^ 0x55) & 0x70) >> 4;
        16 << seg.saturating_sub(1)
    }

    #[test]
    fn ulaw_reference_values() {
        // Worked through the algorithm: code 0x00 complemented is 0xFF (sign
        // set, segment 7, step 15): ((15 << 3) + 132) << 7 = 32256, minus the
        // bias: 32124 = 4 * 8031, G.711's largest 14-bit output.
        assert_eq!(ulaw_to_linear(0x00), -32124);
        assert_eq!(ulaw_to_linear(0x80), 32124);
        // The two zeros: 0xFF is +0, 0x7F is -0; both decode to 0.
        assert_eq!(ulaw_to_linear(0xFF), 0);
        assert_eq!(ulaw_to_linear(0x7F), 0);
        // Smallest nonzero steps: 8 = 4 * 2 (14-bit value 2).
        assert_eq!(ulaw_to_linear(0xFE), 8);
        assert_eq!(ulaw_to_linear(0x7E), -8);
        // Segment 1 starts at 14-bit 33: (132 << 1) - 132 = 132 = 4 * 33.
        assert_eq!(ulaw_to_linear(0xEF), 132);
        // First interval of the top segment: (132 << 7) - 132 = 16764 = 4 * 4191,
        // G.711's output for the interval that starts at 14-bit 4063.
        assert_eq!(ulaw_to_linear(0x8F), 16764);
        assert_eq!(linear_to_ulaw(0), 0xFF);
        // -1 has magnitude 1: 1 + 132 = 133 is segment 0, step 133 >> 3 & 15
        // = 0, so the code is 0 ^ 0x7F.
        assert_eq!(linear_to_ulaw(-1), 0x7F);
        // Both extremes clip to the outermost codes.
        assert_eq!(linear_to_ulaw(32767), 0x80);
        assert_eq!(linear_to_ulaw(-32768), 0x00);
        assert_eq!(linear_to_ulaw(32124), 0x80);
        assert_eq!(linear_to_ulaw(-32124), 0x00);
        // Rounding to the nearest level in segment 0 (levels 0, 8, 16, ...):
        // 3 stays at 0, 4 goes up to 8.
        assert_eq!(linear_to_ulaw(3), 0xFF);
        assert_eq!(linear_to_ulaw(4), 0xFE);
        assert_eq!(linear_to_ulaw(-4), 0x7E);
    }

    #[test]
    fn alaw_reference_values() {
        // 0xD5 ^ 0x55 = 0x80: positive, segment 0, step 0: 0 * 16 + 8.
        assert_eq!(alaw_to_linear(0xD5), 8);
        assert_eq!(alaw_to_linear(0x55), -8);
        // 0xAA ^ 0x55 = 0xFF: positive, segment 7, step 15:
        // (15 * 16 + 0x108) << 6 = 504 << 6 = 32256 = 8 * 4032, G.711's largest
        // 13-bit output.
        assert_eq!(alaw_to_linear(0xAA), 32256);
        assert_eq!(alaw_to_linear(0x2A), -32256);
        // Segment 1 starts at 13-bit 33: 0x108 = 264 = 8 * 33.
        assert_eq!(alaw_to_linear(0x90 ^ 0x55), 264);
        assert_eq!(linear_to_alaw(0), 0xD5);
        assert_eq!(linear_to_alaw(32767), 0xAA);
        // -32768 - 8 ... magnitude 32760: segment 7, 32760 >> 10 & 15 = 15.
        assert_eq!(linear_to_alaw(-32768), 0x2A);
        // Small negatives are the smallest negative level, not -248 (the
        // unclamped g711.c answer for -1..=-7).
        for x in -8..=-1 {
            assert_eq!(linear_to_alaw(x), 0x55, "{x}");
        }
        // Segment 0 boundaries: 0..=15 -> level 8, 16 -> level 24.
        assert_eq!(linear_to_alaw(15), 0xD5);
        assert_eq!(alaw_to_linear(linear_to_alaw(16)), 24);
        assert_eq!(alaw_to_linear(linear_to_alaw(-9)), -8);
        assert_eq!(alaw_to_linear(linear_to_alaw(-24)), -24);
    }

    #[test]
    fn every_code_round_trips() {
        for c in 0..=255u8 {
            let back = linear_to_ulaw(ulaw_to_linear(c));
            // -0 (0x7F) decodes to 0, and 0 encodes as +0 (0xFF): the one
            // code that does not come back, by G.711's two zeros.
            let want = if c == 0x7F { 0xFF } else { c };
            assert_eq!(back, want, "ulaw {c:#04x}");
            // A-law has no zero level (the smallest are ±8): all 256 return.
            assert_eq!(linear_to_alaw(alaw_to_linear(c)), c, "alaw {c:#04x}");
        }
    }

    #[test]
    fn decode_is_monotonic_in_code_order() {
        let u: Vec<i16> = ulaw_order().into_iter().map(ulaw_to_linear).collect();
        for (k, w) in u.windows(2).enumerate() {
            // Strictly increasing except across -0 (0x7F) to +0 (0xFF).
            if k == 127 {
                assert_eq!(w, [0, 0]);
            } else {
                assert!(w[0] < w[1], "ulaw order {k}: {w:?}");
            }
        }
        assert_eq!((u[0], u[255]), (-32124, 32124));
        let a: Vec<i16> = alaw_order().into_iter().map(alaw_to_linear).collect();
        for (k, w) in a.windows(2).enumerate() {
            assert!(w[0] < w[1], "alaw order {k}: {w:?}");
        }
        assert_eq!((a[0], a[127], a[128], a[255]), (-32256, -8, 8, 32256));
        // Decoding is symmetric: the code with the sign bit flipped is the
        // negative value.
        for c in 0..=255u8 {
            assert_eq!(ulaw_to_linear(c), -ulaw_to_linear(c ^ 0x80));
            assert_eq!(alaw_to_linear(c), -alaw_to_linear(c ^ 0x80));
        }
    }

    #[test]
    fn encode_is_monotonic_and_within_one_step() {
        let (mut prev_u, mut prev_a) = (i32::MIN, i32::MIN);
        for x in i16::MIN..=i16::MAX {
            let xi = x as i32;
            let cu = linear_to_ulaw(x);
            let yu = ulaw_to_linear(cu) as i32;
            let eu = (yu - xi).abs();
            if xi.abs() <= ULAW_CLIP {
                // Mid-tread rounding: at most half a step off.
                assert!(eu <= ulaw_step(cu) / 2, "ulaw {x} -> {yu}");
            } else {
                // Beyond the clip level everything lands on ±32124.
                assert_eq!(yu, 32124 * xi.signum(), "ulaw clip {x}");
                assert!(eu <= 644);
            }
            assert!(yu >= prev_u, "ulaw decode(encode) not monotonic at {x}");
            prev_u = yu;

            let ca = linear_to_alaw(x);
            let ya = alaw_to_linear(ca) as i32;
            let ea = ya - xi;
            if xi >= 0 {
                // Positive side: midpoints, at most half a step off.
                assert!(ea.abs() <= alaw_step(ca) / 2, "alaw {x} -> {ya}");
            } else {
                // Negative side is one's complement (the magnitude is cut by 8
                // before truncation): the error is (m mod step) + 8 - step/2
                // for m = -x - 8, so within [8 - step/2, step/2 + 7]; -1..=-7
                // land on -8, at most 7 below.
                let half = alaw_step(ca) / 2;
                assert!(
                    (8 - half).min(-7) <= ea && ea <= half + 7,
                    "alaw {x} -> {ya}"
                );
            }
            assert!(ya >= prev_a, "alaw decode(encode) not monotonic at {x}");
            prev_a = ya;
        }
    }

    #[test]
    fn tables_match_the_functions_and_slices_work() {
        for c in 0..=255u8 {
            assert_eq!(ULAW_TABLE[c as usize], ulaw_to_linear(c));
            assert_eq!(ALAW_TABLE[c as usize], alaw_to_linear(c));
        }
        let pcm = [0i16, 1000, -1000, 32767, -32768, 8, -8];
        let u = ulaw_encode(&pcm);
        assert_eq!(u.len(), pcm.len());
        // 1000 + 132 = 1132 is segment 3 (step 64): 1132 >> 6 = 17, so step 1,
        // decoded as ((1 << 3) + 132) << 3 - 132 = 988.
        assert_eq!(ulaw_decode(&u), [0, 988, -988, 32124, -32124, 8, -8]);
        let a = alaw_encode(&pcm);
        // 1000 is segment 2 (step 32): 1000 >> 5 & 15 = 15, decoded as
        // (15 * 16 + 0x108) << 1 = 1008; -1000 is magnitude 992, the same code.
        assert_eq!(alaw_decode(&a), [8, 1008, -1008, 32256, -32256, 8, -8]);
        assert!(ulaw_encode(&[]).is_empty() && alaw_decode(&[]).is_empty());
        // f32 variants go through the crate's i16 conversion.
        let xs = [0.0f32, 0.5, -0.5, 2.0, f32::NAN];
        let u = ulaw_encode_f32(&xs);
        assert_eq!(u[3], 0x80, "clamped");
        assert_eq!(u[4], 0xFF, "NaN is silence");
        let back = ulaw_decode_f32(&u);
        assert!((back[1] - 0.5).abs() < 0.02 && (back[2] + 0.5).abs() < 0.02);
        let back = alaw_decode_f32(&alaw_encode_f32(&xs));
        assert!((back[1] - 0.5).abs() < 0.02 && (back[2] + 0.5).abs() < 0.02);
        assert!(back.iter().all(|v| v.abs() <= 1.0));
    }
}
