//! What an SDP offer asks for: the audio codec we will send and receive.
//! (The `webrtc` crate negotiates the rest; this picks before it does, so an
//! offer we cannot serve gets a clear 400.)

use crate::serve::transport::media::Codec;

pub fn codec_of_mime(mime: &str) -> Option<Codec> {
    match mime.to_ascii_lowercase().as_str() {
        "audio/opus" => Some(Codec::Opus),
        "audio/pcmu" => Some(Codec::Pcmu),
        "audio/pcma" => Some(Codec::Pcma),
        _ => None,
    }
}

/// The codec for the offer's first audio section: Opus if offered (the
/// browsers' codec), else PCMU, else PCMA.
pub fn audio_codec(offer: &str) -> Result<Codec, String> {
    if !offer.trim_start().starts_with("v=0") {
        return Err("not an SDP offer (it must start with v=0)".into());
    }
    let mut in_audio = false;
    let mut seen_audio = false;
    let mut offered: Vec<String> = Vec::new();
    for line in offer.lines().map(str::trim) {
        if let Some(m) = line.strip_prefix("m=") {
            if seen_audio && in_audio {
                break; // only the first audio section counts
            }
            in_audio = m.starts_with("audio ");
            seen_audio |= in_audio;
            if in_audio {
                // Static payload types need no rtpmap: 0 is PCMU, 8 is PCMA.
                for pt in m.split_whitespace().skip(3) {
                    match pt {
                        "0" => offered.push("PCMU".into()),
                        "8" => offered.push("PCMA".into()),
                        _ => {}
                    }
                }
            }
        } else if in_audio {
            if let Some(map) = line.strip_prefix("a=rtpmap:") {
                if let Some(name) = map.split_whitespace().nth(1) {
                    offered.push(name.split('/').next().unwrap_or("").to_string());
                }
            }
        }
    }
    if !seen_audio {
        return Err("the offer has no audio section (m=audio)".into());
    }
    let has = |name: &str| offered.iter().any(|o| o.eq_ignore_ascii_case(name));
    [("opus", Codec::Opus), ("PCMU", Codec::Pcmu), ("PCMA", Codec::Pcma)]
        .into_iter()
        .find(|(n, _)| has(n))
        .map(|(_, c)| c)
        .ok_or_else(|| {
            offered.sort();
            offered.dedup();
            format!(
                "no supported audio codec in the offer ({}); this server speaks opus/48000, PCMU/8000 and PCMA/8000",
                if offered.is_empty() { "none".to_string() } else { offered.join(", ") }
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD: &str = "v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n";

    #[test]
    fn picks_opus_then_g711() {
        let browser = format!(
            "{HEAD}m=audio 9 UDP/TLS/RTP/SAVPF 111 0 8\r\na=rtpmap:111 opus/48000/2\r\na=rtpmap:0 PCMU/8000\r\n"
        );
        assert_eq!(audio_codec(&browser), Ok(Codec::Opus));
        let phone = format!("{HEAD}m=audio 9 UDP/TLS/RTP/SAVPF 0 8\r\n");
        assert_eq!(audio_codec(&phone), Ok(Codec::Pcmu));
        let alaw = format!("{HEAD}m=audio 9 UDP/TLS/RTP/SAVPF 8\r\na=rtpmap:8 PCMA/8000\r\n");
        assert_eq!(audio_codec(&alaw), Ok(Codec::Pcma));
    }

    #[test]
    fn refuses_what_it_cannot_serve() {
        assert!(audio_codec("hello")
            .unwrap_err()
            .contains("not an SDP offer"));
        let video = format!("{HEAD}m=video 9 UDP/TLS/RTP/SAVPF 96\r\na=rtpmap:96 VP8/90000\r\n");
        assert!(audio_codec(&video)
            .unwrap_err()
            .contains("no audio section"));
        let g722 = format!("{HEAD}m=audio 9 UDP/TLS/RTP/SAVPF 9\r\na=rtpmap:9 G722/8000\r\n");
        let e = audio_codec(&g722).unwrap_err();
        assert!(e.contains("G722") && e.contains("opus/48000"), "{e}");
    }

    #[test]
    fn mime_types() {
        assert_eq!(codec_of_mime("audio/OPUS"), Some(Codec::Opus));
        assert_eq!(codec_of_mime("audio/PCMA"), Some(Codec::Pcma));
        assert_eq!(codec_of_mime("video/VP8"), None);
    }
}
