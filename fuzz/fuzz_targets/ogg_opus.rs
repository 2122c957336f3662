//! Ogg Opus input: `decode_ogg_opus` on the whole input, and the streaming
//! `OggOpusDecoder` on the same bytes in pieces. Neither may panic, and they
//! must agree: the same samples, or both an error.
//!
//! Input: one byte for the piece size (1..=256), then the stream. Fuzzing
//! builds skip the Ogg CRC check (`cfg(fuzzing)`), so mutations get past it.

#![no_main]

use libfuzzer_sys::fuzz_target;
use omnistream_codecs::{decode_ogg_opus, OggOpusDecoder};

fuzz_target!(|data: &[u8]| {
    let Some((&k, bytes)) = data.split_first() else {
        return;
    };
    let whole = decode_ogg_opus(bytes);

    let mut dec = OggOpusDecoder::new();
    let mut pieces = Vec::new();
    let mut streamed = Ok(());
    for chunk in bytes.chunks(k as usize + 1) {
        match dec.push(chunk) {
            Ok(pcm) => pieces.extend(pcm),
            Err(e) => {
                streamed = Err(e);
                break;
            }
        }
    }
    if streamed.is_ok() {
        streamed = dec.finish();
    }

    match (whole, streamed) {
        (Ok((pcm, rate)), Ok(())) => {
            assert_eq!(rate, 48_000);
            assert_eq!(pcm.len(), pieces.len(), "whole vs pieces: sample count");
            // Bitwise, so that NaN would compare too.
            assert!(
                pcm.iter()
                    .map(|v| v.to_bits())
                    .eq(pieces.iter().map(|v| v.to_bits())),
                "whole vs pieces: samples differ"
            );
        }
        (Err(_), Err(_)) => {}
        (w, s) => panic!(
            "whole and pieces disagree: whole {:?}, pieces {:?}",
            w.map(|(pcm, _)| pcm.len()),
            s
        ),
    }
});
