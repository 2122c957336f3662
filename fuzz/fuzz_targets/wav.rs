//! WAV input: `parse_wav` on arbitrary bytes never panics, and what it
//! returns came from the input (at least one byte per sample).

#![no_main]

use libfuzzer_sys::fuzz_target;
use omnistream_codecs::wav::parse_wav;

fuzz_target!(|data: &[u8]| {
    if let Ok((pcm, _rate)) = parse_wav(data) {
        assert!(
            pcm.len() <= data.len(),
            "{} samples from {} bytes",
            pcm.len(),
            data.len()
        );
    }
});
