//! The SDP of a SIP call: what the caller's offer asks for (RFC 3264), and
//! our answer. Plain RTP/AVP audio only: G.711 (PCMU or PCMA) and
//! telephone-event (RFC 4733) for the keypad.

use std::net::{IpAddr, SocketAddr};

use crate::serve::transport::media::Codec;

/// What we take from an offer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// Where the caller receives RTP.
    pub rtp: SocketAddr,
    pub codec: Codec,
    /// The codec's payload type (0 or 8 unless the offer mapped another).
    pub pt: u8,
    /// telephone-event/8000's payload type, if offered.
    pub dtmf_pt: Option<u8>,
}

/// Why an offer cannot be answered, and the status code that says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OfferError {
    /// Not SDP we can read: 400.
    Malformed(String),
    /// Readable, but nothing in it we can do: 488 Not Acceptable Here.
    NotAcceptable(String),
}

impl std::fmt::Display for OfferError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OfferError::Malformed(m) | OfferError::NotAcceptable(m) => f.write_str(m),
        }
    }
}

fn connection(line: &str) -> Result<IpAddr, OfferError> {
    // c=IN IP4 192.0.2.1  (a multicast /ttl suffix is not for us)
    let mut it = line.split_whitespace();
    let (net, _kind, addr) = (it.next(), it.next(), it.next());
    let addr = addr.map(|a| a.split('/').next().unwrap_or(a));
    match (net, addr) {
        (Some("IN"), Some(a)) => a
            .parse()
            .map_err(|_| OfferError::Malformed(format!("c={line}: not an IP address"))),
        _ => Err(OfferError::Malformed(format!(
            "c={line}: expected IN IP4|IP6 <address>"
        ))),
    }
}

/// Reads an offer: its first audio stream, the codec we use on it (the
/// first G.711 the caller lists: its preference), and the keypad's events.
pub fn parse_offer(sdp: &str) -> Result<Offer, OfferError> {
    if !sdp.trim_start().starts_with("v=0") {
        return Err(OfferError::Malformed(
            "the body is not SDP (it must start with v=0)".into(),
        ));
    }
    let mut session_c: Option<IpAddr> = None;
    let mut media_c: Option<IpAddr> = None;
    // The first audio m= line: port, proto, formats.
    let mut audio: Option<(u16, String, Vec<u8>)> = None;
    let mut in_audio = false;
    let mut rtpmaps: Vec<(u8, String)> = Vec::new();
    for line in sdp.lines().map(str::trim) {
        if let Some(m) = line.strip_prefix("m=") {
            if audio.is_some() && in_audio {
                break;
            }
            let f: Vec<&str> = m.split_whitespace().collect();
            in_audio = f.first() == Some(&"audio");
            if in_audio {
                if f.len() < 4 {
                    return Err(OfferError::Malformed(format!("m={m}: too few fields")));
                }
                let port = f[1]
                    .split('/')
                    .next()
                    .and_then(|p| p.parse::<u16>().ok())
                    .ok_or_else(|| OfferError::Malformed(format!("m={m}: bad port")))?;
                let fmts = f[3..].iter().filter_map(|p| p.parse::<u8>().ok()).collect();
                audio = Some((port, f[2].to_string(), fmts));
            }
        } else if let Some(c) = line.strip_prefix("c=") {
            let ip = connection(c)?;
            if audio.is_none() {
                session_c = Some(ip);
            } else if in_audio {
                media_c = Some(ip);
            }
        } else if in_audio {
            if let Some(map) = line.strip_prefix("a=rtpmap:") {
                let mut it = map.split_whitespace();
                if let (Some(pt), Some(enc)) = (it.next().and_then(|p| p.parse().ok()), it.next()) {
                    rtpmaps.push((pt, enc.to_ascii_lowercase()));
                }
            }
        }
    }
    let Some((port, proto, fmts)) = audio else {
        return Err(OfferError::NotAcceptable(
            "the offer has no audio stream (m=audio)".into(),
        ));
    };
    if port == 0 {
        return Err(OfferError::NotAcceptable(
            "the offer's audio stream is disabled (port 0)".into(),
        ));
    }
    if !proto.eq_ignore_ascii_case("RTP/AVP") {
        return Err(OfferError::NotAcceptable(format!(
            "the audio stream is {proto}: only plain RTP/AVP is served (no SRTP)"
        )));
    }
    let ip = media_c
        .or(session_c)
        .ok_or_else(|| OfferError::Malformed("the offer has no connection address (c=)".into()))?;
    let name = |pt: u8| -> Option<String> {
        rtpmaps
            .iter()
            .find(|(p, _)| *p == pt)
            .map(|(_, e)| e.clone())
            .or(match pt {
                0 => Some("pcmu/8000".into()),
                8 => Some("pcma/8000".into()),
                _ => None,
            })
    };
    let mut chosen = None;
    let mut dtmf_pt = None;
    for &pt in &fmts {
        match name(pt).as_deref() {
            Some("pcmu/8000") if chosen.is_none() => chosen = Some((Codec::Pcmu, pt)),
            Some("pcma/8000") if chosen.is_none() => chosen = Some((Codec::Pcma, pt)),
            Some("telephone-event/8000") if dtmf_pt.is_none() => dtmf_pt = Some(pt),
            _ => {}
        }
    }
    let Some((codec, pt)) = chosen else {
        let offered: Vec<String> = fmts
            .iter()
            .map(|&pt| name(pt).unwrap_or_else(|| pt.to_string()))
            .collect();
        return Err(OfferError::NotAcceptable(format!(
            "no common codec: this server speaks PCMU/8000 and PCMA/8000, the offer has {}",
            offered.join(", ")
        )));
    };
    Ok(Offer {
        rtp: SocketAddr::new(ip, port),
        codec,
        pt,
        dtmf_pt,
    })
}

/// Our answer: the chosen codec (and the keypad's events if offered) at
/// `local`, 20 ms packets, both ways.
pub fn answer(offer: &Offer, local: SocketAddr, session_id: u64) -> String {
    let family = if local.is_ipv4() { "IP4" } else { "IP6" };
    let ip = local.ip();
    let mut fmts = offer.pt.to_string();
    if let Some(d) = offer.dtmf_pt {
        fmts.push_str(&format!(" {d}"));
    }
    let mut s = format!(
        "v=0\r\n\
         o=omnistream {session_id} {session_id} IN {family} {ip}\r\n\
         s=omnistream\r\n\
         c=IN {family} {ip}\r\n\
         t=0 0\r\n\
         m=audio {port} RTP/AVP {fmts}\r\n\
         a=rtpmap:{pt} {name}/8000\r\n",
        port = local.port(),
        pt = offer.pt,
        name = offer.codec.name(),
    );
    if let Some(d) = offer.dtmf_pt {
        s.push_str(&format!(
            "a=rtpmap:{d} telephone-event/8000\r\na=fmtp:{d} 0-15\r\n"
        ));
    }
    s.push_str("a=ptime:20\r\na=sendrecv\r\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const BARESIP: &str = "v=0\r\n\
        o=- 1 2 IN IP4 127.0.0.1\r\n\
        s=-\r\n\
        c=IN IP4 127.0.0.1\r\n\
        t=0 0\r\n\
        m=audio 10000 RTP/AVP 96 0 8 101\r\n\
        a=rtpmap:96 opus/48000/2\r\n\
        a=rtpmap:101 telephone-event/8000\r\n\
        a=fmtp:101 0-15\r\n\
        a=sendrecv\r\n";

    #[test]
    fn takes_the_first_g711_and_the_keypad() {
        let o = parse_offer(BARESIP).unwrap();
        assert_eq!(o.rtp, "127.0.0.1:10000".parse::<SocketAddr>().unwrap());
        assert_eq!((o.codec, o.pt, o.dtmf_pt), (Codec::Pcmu, 0, Some(101)));
        let pcma = BARESIP.replace("96 0 8 101", "8 0");
        let o = parse_offer(&pcma).unwrap();
        assert_eq!((o.codec, o.pt, o.dtmf_pt), (Codec::Pcma, 8, None));
        // A media-level address wins over the session's.
        let media_c = BARESIP.replace("a=sendrecv", "c=IN IP4 192.0.2.7\r\na=sendrecv");
        assert_eq!(
            parse_offer(&media_c).unwrap().rtp,
            "192.0.2.7:10000".parse::<SocketAddr>().unwrap()
        );
    }

    #[test]
    fn refusals_say_why() {
        let no_common = BARESIP.replace("96 0 8 101", "96 101");
        match parse_offer(&no_common) {
            Err(OfferError::NotAcceptable(m)) => assert!(m.contains("opus/48000/2"), "{m}"),
            other => panic!("{other:?}"),
        }
        let srtp = BARESIP.replace("RTP/AVP", "RTP/SAVP");
        assert!(matches!(
            parse_offer(&srtp),
            Err(OfferError::NotAcceptable(_))
        ));
        let off = BARESIP.replace("audio 10000", "audio 0");
        assert!(matches!(
            parse_offer(&off),
            Err(OfferError::NotAcceptable(_))
        ));
        let video = "v=0\r\nc=IN IP4 1.2.3.4\r\nm=video 5 RTP/AVP 96\r\n";
        assert!(matches!(
            parse_offer(video),
            Err(OfferError::NotAcceptable(_))
        ));
        for garbage in [
            "",
            "hello",
            "v=0\r\nm=audio x RTP/AVP 0\r\n",
            "v=0\r\nc=IN IP4 nope\r\n",
        ] {
            assert!(
                matches!(parse_offer(garbage), Err(OfferError::Malformed(_))),
                "{garbage:?}"
            );
        }
        let no_c = "v=0\r\nm=audio 4000 RTP/AVP 0\r\n";
        assert!(matches!(parse_offer(no_c), Err(OfferError::Malformed(_))));
    }

    #[test]
    fn the_answer_names_what_was_chosen() {
        let o = parse_offer(BARESIP).unwrap();
        let a = answer(&o, "10.0.0.2:30000".parse().unwrap(), 7);
        assert!(a.contains("c=IN IP4 10.0.0.2\r\n"), "{a}");
        assert!(a.contains("m=audio 30000 RTP/AVP 0 101\r\n"), "{a}");
        assert!(a.contains("a=rtpmap:0 PCMU/8000\r\n"), "{a}");
        assert!(a.contains("a=rtpmap:101 telephone-event/8000\r\n"), "{a}");
        // Our answer reads back as an offer would.
        let back = parse_offer(&a).unwrap();
        assert_eq!(
            (back.codec, back.pt, back.dtmf_pt),
            (Codec::Pcmu, 0, Some(101))
        );
    }
}
