//! RTP payloads from a peer: Opus packets through `OpusFrameDecoder` (one
//! decoder across packets, with losses in between) and the bytes as G.711.
//!
//! Input: one byte picks the Opus rate, then packets, each as a length byte
//! and that many bytes (a zero length is a lost packet); finally the whole
//! rest once more as one packet, and as μ-law and A-law.

#![no_main]

use libfuzzer_sys::fuzz_target;
use omnistream_codecs::g711;
use omnistream_codecs::opus_frames::{OpusFrameDecoder, OPUS_RATES};

fuzz_target!(|data: &[u8]| {
    let Some((&k, payload)) = data.split_first() else {
        return;
    };
    let rate = OPUS_RATES[k as usize % OPUS_RATES.len()];
    let mut dec = OpusFrameDecoder::new(rate).expect("a libopus rate");
    let (frame, max) = (rate as usize / 50, rate as usize * 120 / 1000);
    let check = |pcm: &[i16]| {
        // 2.5 ms steps, 120 ms at most.
        assert!(
            pcm.len() <= max && pcm.len().is_multiple_of(rate as usize / 400),
            "{}",
            pcm.len()
        );
    };
    let mut rest = payload;
    while let Some((&n, tail)) = rest.split_first() {
        let (packet, tail) = tail.split_at((n as usize).min(tail.len()));
        rest = tail;
        if packet.is_empty() {
            assert_eq!(dec.decode_lost().len(), frame);
        } else if let Ok(pcm) = dec.decode(packet) {
            check(&pcm);
        }
    }
    if let Ok(pcm) = dec.decode(payload) {
        check(&pcm);
    }

    // Every byte is a G.711 code, and codes come back through encode, but
    // μ-law's -0 (0x7F), which decodes to 0 and encodes as +0 (0xFF).
    let u = g711::ulaw_decode(payload);
    let back = g711::ulaw_encode(&u);
    for (&b, &c) in back.iter().zip(payload) {
        assert_eq!(b, if c == 0x7F { 0xFF } else { c });
    }
    assert_eq!(g711::alaw_encode(&g711::alaw_decode(payload)), payload);
    let f = g711::alaw_decode_f32(payload);
    assert!(f.iter().all(|v| v.abs() <= 1.0));
    assert_eq!(g711::alaw_encode_f32(&f), payload);
    assert_eq!(g711::ulaw_decode_f32(payload).len(), payload.len());
});
