//! A SIP call's RTP, sans IO: incoming packets put back in order by a small
//! jitter buffer (late, duplicate and lost packets handled; a caller that
//! stops sending during silence still gives the turn detector its silence),
//! RFC 4733 keypad events read once each, and our own packets numbered.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use webrtc::rtp::header::Header;
use webrtc::rtp::packet::Packet;
use webrtc::util::{Marshal, Unmarshal};

/// G.711 at 8 kHz: samples in a 20 ms packet.
pub const FRAME_SAMPLES: u32 = 160;
/// The longest payload taken: 200 ms of G.711 (ptime is 10-60 ms in practice).
const MAX_PAYLOAD: usize = 1600;
/// Packets held waiting for one that is missing before it is given up.
const REORDER_PACKETS: usize = 3;
/// How long a packet may wait for a missing one before it is given up.
const REORDER_WAIT: Duration = Duration::from_millis(60);
/// With no packets for this long, the buffer feeds silence in real time (a
/// caller's own VAD stops sending: the turn must still end).
const SILENT_AFTER: Duration = Duration::from_millis(100);
/// The most a gap in timestamps is filled with (a longer one was a pause the
/// silence feed already covered).
const MAX_FILL_SAMPLES: u32 = 8000 / 2;

/// A packet as read, or why it was dropped.
#[derive(Debug, PartialEq)]
pub enum Incoming {
    Audio {
        seq: u16,
        ts: u32,
        payload: Bytes,
    },
    Dtmf {
        ts: u32,
        payload: Bytes,
    },
    /// Dropped; the reason is a metric label.
    Dropped(&'static str),
}

/// Reads one datagram: audio of payload type `pt`, keypad events of
/// `dtmf_pt`; anything else is dropped with a reason.
pub fn read(datagram: &[u8], pt: u8, dtmf_pt: Option<u8>) -> Incoming {
    let mut buf = datagram;
    let Ok(p) = Packet::unmarshal(&mut buf) else {
        return Incoming::Dropped("rtp_malformed");
    };
    if p.header.version != 2 {
        return Incoming::Dropped("rtp_malformed");
    }
    if Some(p.header.payload_type) == dtmf_pt {
        return Incoming::Dtmf {
            ts: p.header.timestamp,
            payload: p.payload,
        };
    }
    if p.header.payload_type != pt {
        return Incoming::Dropped("rtp_wrong_payload_type");
    }
    if p.payload.is_empty() || p.payload.len() > MAX_PAYLOAD {
        return Incoming::Dropped("rtp_bad_payload_size");
    }
    Incoming::Audio {
        seq: p.header.sequence_number,
        ts: p.header.timestamp,
        payload: p.payload,
    }
}

/// What the buffer hands on, in order.
#[derive(Debug, PartialEq)]
pub enum Played {
    /// A packet's G.711 payload.
    Payload(Bytes),
    /// Samples (8 kHz) of silence: lost packets, or a caller not sending.
    Silence(u32),
}

/// The jitter buffer.
#[derive(Default)]
pub struct Jitter {
    /// Held packets by extended sequence number: (timestamp, payload, arrival).
    held: BTreeMap<u64, (u32, Bytes, Instant)>,
    /// The extended sequence number expected next, once one was played.
    next: Option<u64>,
    /// The last played packet's timestamp and length in samples.
    last_ts: Option<(u32, u32)>,
    /// The last sequence number seen (for extending).
    highest: Option<u64>,
    /// When audio was last handed on (a packet or silence).
    last_out: Option<Instant>,
    /// Silence is being fed: the caller stopped sending.
    feeding: bool,
    /// Packets dropped for arriving after their turn, or twice.
    pub late: u64,
    /// Packets given up as lost.
    pub lost: u64,
}

impl Jitter {
    /// The 16-bit sequence number `seq` extended past wraps, nearest the
    /// highest seen.
    fn extend(&self, seq: u16) -> u64 {
        let Some(h) = self.highest else {
            return u64::from(seq) + (1 << 16); // room below for reordering
        };
        let base = h & !0xffff;
        let candidates = [base.wrapping_sub(1 << 16), base, base + (1 << 16)];
        candidates
            .into_iter()
            .map(|b| b.wrapping_add(u64::from(seq)))
            .min_by_key(|c| c.abs_diff(h))
            .unwrap_or(u64::from(seq))
    }

    /// A packet arrived: what is ready now.
    pub fn push(&mut self, seq: u16, ts: u32, payload: Bytes, now: Instant) -> Vec<Played> {
        let ext = self.extend(seq);
        if self.next.is_some_and(|n| ext < n) || self.held.contains_key(&ext) {
            self.late += 1;
            return self.ready(now);
        }
        self.highest = Some(self.highest.map_or(ext, |h| h.max(ext)));
        self.held.insert(ext, (ts, payload, now));
        self.ready(now)
    }

    /// Time passed: what is ready now (packets that waited long enough for a
    /// lost one, or silence while the caller sends nothing).
    pub fn tick(&mut self, now: Instant) -> Vec<Played> {
        let mut out = self.ready(now);
        if out.is_empty() && self.held.is_empty() {
            if let Some(last) = self.last_out {
                // Silence in 20 ms steps, as real time passes.
                let since = now.saturating_duration_since(last);
                let frames = (since.as_millis() / 20) as u32;
                if (self.feeding || since >= SILENT_AFTER) && frames > 0 {
                    self.feeding = true;
                    out.push(Played::Silence(frames * FRAME_SAMPLES));
                    self.last_out = Some(last + Duration::from_millis(u64::from(frames) * 20));
                }
            }
        }
        out
    }

    fn ready(&mut self, now: Instant) -> Vec<Played> {
        let mut out = Vec::new();
        while let Some((&first, (_, _, arrived))) = self.held.iter().next() {
            let in_turn = self.next.is_none_or(|n| n == first);
            let give_up = self.held.len() > REORDER_PACKETS
                || now.saturating_duration_since(*arrived) >= REORDER_WAIT;
            if !in_turn && !give_up {
                break;
            }
            if let Some(n) = self.next.filter(|n| *n < first) {
                self.lost += first - n;
            }
            let Some((ts, payload, _)) = self.held.remove(&first) else {
                break;
            };
            // A gap (lost packets, or the caller paused) is filled from the
            // timestamps, up to half a second.
            if let Some((last_ts, last_len)) = self.last_ts {
                let gap = ts.wrapping_sub(last_ts.wrapping_add(last_len));
                if gap > 0 && gap <= MAX_FILL_SAMPLES && !self.feeding {
                    out.push(Played::Silence(gap));
                }
            }
            self.last_ts = Some((ts, payload.len() as u32));
            self.next = Some(first + 1);
            self.feeding = false;
            out.push(Played::Payload(payload));
        }
        if !out.is_empty() {
            self.last_out = Some(now);
            self.feeding = false;
        }
        out
    }
}

/// RFC 4733 keypad events: each key reported once, at its first packet (an
/// event is sent several times, with the same timestamp).
#[derive(Default)]
pub struct Keypad {
    last: Option<u32>,
}

impl Keypad {
    /// The key a telephone-event payload starts, if it is a new one.
    pub fn event(&mut self, ts: u32, payload: &[u8]) -> Result<Option<char>, &'static str> {
        if payload.len() < 4 {
            return Err("rtp_bad_dtmf");
        }
        if self.last == Some(ts) {
            return Ok(None);
        }
        let key = match payload[0] {
            e @ 0..=9 => char::from(b'0' + e),
            10 => '*',
            11 => '#',
            e @ 12..=15 => char::from(b'A' + e - 12),
            // Tones that are not keys (flash, fax) are not ours to report.
            _ => return Ok(None),
        };
        self.last = Some(ts);
        Ok(Some(key))
    }
}

/// Our outgoing stream: one SSRC, sequence numbers and timestamps that run
/// on whatever is sent (speech or silence).
pub struct Outgoing {
    pt: u8,
    ssrc: u32,
    seq: u16,
    ts: u32,
    /// The next packet starts a talk spurt (RTP's marker bit).
    spurt: bool,
}

impl Outgoing {
    pub fn new(pt: u8) -> Self {
        Self {
            pt,
            ssrc: rand::random(),
            seq: rand::random(),
            ts: rand::random(),
            spurt: true,
        }
    }

    /// One 20 ms packet; `speech` false for the silence between answers.
    pub fn packet(&mut self, payload: Vec<u8>, speech: bool) -> Vec<u8> {
        let marker = speech && self.spurt;
        self.spurt = !speech;
        let p = Packet {
            header: Header {
                version: 2,
                marker,
                payload_type: self.pt,
                sequence_number: self.seq,
                timestamp: self.ts,
                ssrc: self.ssrc,
                ..Default::default()
            },
            payload: payload.into(),
        };
        self.seq = self.seq.wrapping_add(1);
        self.ts = self.ts.wrapping_add(FRAME_SAMPLES);
        // Marshalling a header we built cannot fail; an empty datagram is
        // never sent.
        p.marshal().map(|b| b.to_vec()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pkt(seq: u16, ts: u32, pt: u8, payload: &[u8]) -> Vec<u8> {
        Packet {
            header: Header {
                version: 2,
                payload_type: pt,
                sequence_number: seq,
                timestamp: ts,
                ssrc: 1,
                ..Default::default()
            },
            payload: Bytes::copy_from_slice(payload),
        }
        .marshal()
        .unwrap()
        .to_vec()
    }

    fn payloads(v: &[Played]) -> Vec<u8> {
        v.iter()
            .filter_map(|p| match p {
                Played::Payload(b) => Some(b[0]),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn reads_audio_keypad_and_refuses_the_rest() {
        let a = pkt(5, 800, 0, &[1; 160]);
        assert!(matches!(
            read(&a, 0, Some(101)),
            Incoming::Audio {
                seq: 5,
                ts: 800,
                ..
            }
        ));
        let d = pkt(6, 960, 101, &[5, 0x0a, 0, 160]);
        assert!(matches!(
            read(&d, 0, Some(101)),
            Incoming::Dtmf { ts: 960, .. }
        ));
        assert_eq!(
            read(&pkt(7, 0, 8, &[1; 160]), 0, None),
            Incoming::Dropped("rtp_wrong_payload_type")
        );
        assert_eq!(
            read(&pkt(7, 0, 0, &[]), 0, None),
            Incoming::Dropped("rtp_bad_payload_size")
        );
        assert_eq!(
            read(&pkt(7, 0, 0, &[0; 2000]), 0, None),
            Incoming::Dropped("rtp_bad_payload_size")
        );
        assert_eq!(
            read(b"INVITE sip:x", 0, None),
            Incoming::Dropped("rtp_malformed")
        );
        assert_eq!(
            read(&[0x40; 20], 0, None),
            Incoming::Dropped("rtp_malformed")
        );
    }

    #[test]
    fn puts_packets_back_in_order() {
        let t0 = Instant::now();
        let mut j = Jitter::default();
        let b = |v: u8| Bytes::from(vec![v; 160]);
        assert_eq!(payloads(&j.push(10, 1600, b(10), t0)), vec![10]);
        // 12 before 11: held until 11 comes.
        assert!(j.push(12, 1920, b(12), t0).is_empty());
        assert_eq!(payloads(&j.push(11, 1760, b(11), t0)), vec![11, 12]);
        // A duplicate and a late one are dropped.
        assert!(j.push(11, 1760, b(11), t0).is_empty());
        assert_eq!(j.late, 1);
        // 13 is lost: 14 waits its time, then plays after 20 ms of silence.
        assert!(j.push(14, 2240, b(14), t0).is_empty());
        let out = j.tick(t0 + REORDER_WAIT);
        assert_eq!(out, vec![Played::Silence(160), Played::Payload(b(14))]);
        assert_eq!(j.lost, 1);
        // The late 13 is dropped.
        assert!(j.push(13, 2080, b(13), t0 + REORDER_WAIT).is_empty());
    }

    #[test]
    fn wraps_and_gives_up_on_a_full_window() {
        let t0 = Instant::now();
        let mut j = Jitter::default();
        let b = |v: u8| Bytes::from(vec![v; 160]);
        assert_eq!(payloads(&j.push(65535, 0, b(1), t0)), vec![1]);
        assert_eq!(payloads(&j.push(0, 160, b(2), t0)), vec![2]);
        // 1 lost, 2..=5 arrive: the window (3) overflows and playing goes on.
        for (s, v) in [(2u16, 4u8), (3, 5), (4, 6)] {
            assert!(j.push(s, u32::from(s) * 160 + 160, b(v), t0).is_empty());
        }
        let out = payloads(&j.push(5, 960, b(7), t0));
        assert_eq!(out, vec![4, 5, 6, 7]);
    }

    #[test]
    fn a_silent_caller_still_gives_silence() {
        let t0 = Instant::now();
        let mut j = Jitter::default();
        j.push(1, 0, Bytes::from(vec![0u8; 160]), t0);
        assert!(j.tick(t0 + Duration::from_millis(60)).is_empty());
        assert_eq!(
            j.tick(t0 + Duration::from_millis(100)),
            vec![Played::Silence(5 * FRAME_SAMPLES)]
        );
        // Once feeding, every 20 ms that passes.
        assert_eq!(
            j.tick(t0 + Duration::from_millis(145)),
            vec![Played::Silence(2 * FRAME_SAMPLES)]
        );
        assert!(j.tick(t0 + Duration::from_millis(150)).is_empty());
        // Sending again after the pause: the timestamp jump is not filled
        // twice.
        let out = j.push(
            2,
            8000,
            Bytes::from(vec![9u8; 160]),
            t0 + Duration::from_millis(1000),
        );
        assert_eq!(payloads(&out), vec![9]);
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn each_key_once() {
        let mut k = Keypad::default();
        assert_eq!(k.event(100, &[1, 0, 0, 160]), Ok(Some('1')));
        assert_eq!(k.event(100, &[1, 0, 1, 64]), Ok(None));
        assert_eq!(k.event(100, &[1, 0x80, 3, 32]), Ok(None));
        assert_eq!(k.event(900, &[11, 0, 0, 160]), Ok(Some('#')));
        assert_eq!(k.event(1900, &[10, 0, 0, 160]), Ok(Some('*')));
        assert_eq!(k.event(2900, &[12, 0, 0, 160]), Ok(Some('A')));
        assert_eq!(k.event(3900, &[16, 0, 0, 160]), Ok(None));
        assert_eq!(k.event(4900, &[1, 0]), Err("rtp_bad_dtmf"));
    }

    #[test]
    fn our_packets_count_on() {
        let mut o = Outgoing::new(8);
        let a = o.packet(vec![0xd5; 160], false);
        let b = o.packet(vec![1; 160], true);
        let c = o.packet(vec![2; 160], true);
        let read = |d: &[u8]| Packet::unmarshal(&mut &d[..]).unwrap().header;
        let (ha, hb, hc) = (read(&a), read(&b), read(&c));
        assert_eq!(hb.sequence_number, ha.sequence_number.wrapping_add(1));
        assert_eq!(hc.timestamp, ha.timestamp.wrapping_add(320));
        assert!(!ha.marker && hb.marker && !hc.marker);
        assert_eq!(hc.payload_type, 8);
    }
}
