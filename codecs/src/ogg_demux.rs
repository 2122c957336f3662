//! Push-based Ogg page reader (RFC 3533) for one logical stream: bytes go in
//! as they arrive, split anywhere; whole pages come out with the packets that
//! end on them.
//!
//! Not the `ogg` crate's `PacketReader`: that pulls from `Read + Seek`, which
//! a stream arriving over a socket is not, and it resynchronises silently on
//! garbage. This reader is strict (a stream that is not contiguous pages of
//! one serial, in sequence, with good CRCs, is an error), keeps its memory
//! bounded for any input, and is small enough that every length is checked
//! in view; `fuzz/` runs it on arbitrary bytes.

use crate::CodecError;

const CAPTURE: &[u8; 4] = b"OggS";
const HEADER: usize = 27;
const FLAG_CONTINUED: u8 = 0x01;
const FLAG_BOS: u8 = 0x02;
const FLAG_EOS: u8 = 0x04;

/// One packet that ended on a page. `data` holds at most the reader's `keep`
/// bytes of it; `len` is its real length (larger when it was cut).
#[derive(Debug)]
pub(crate) struct Packet {
    pub data: Vec<u8>,
    pub len: usize,
}

/// One page: its header fields and the packets that end on it.
#[derive(Debug)]
pub(crate) struct Page {
    /// Absolute granule position; `u64::MAX` (-1) when no packet ends here.
    pub granule: u64,
    pub eos: bool,
    pub packets: Vec<Packet>,
    /// The page's last packet continues on the next page.
    pub ends_inside_packet: bool,
}

pub(crate) struct OggDemuxer {
    /// Bytes not yet parsed start at `buf[pos]`.
    buf: Vec<u8>,
    pos: usize,
    /// Stream offset of `buf[0]`, for error messages.
    base: u64,
    serial: Option<u32>,
    next_seq: u32,
    /// The packet continuing onto the next page, up to `keep` bytes of it.
    partial: Vec<u8>,
    partial_len: usize,
    in_packet: bool,
    keep: usize,
}

impl OggDemuxer {
    /// `keep`: the most bytes stored of any one packet (longer ones are
    /// counted, not stored, so a huge packet cannot exhaust memory).
    pub fn new(keep: usize) -> Self {
        Self {
            buf: Vec::new(),
            pos: 0,
            base: 0,
            serial: None,
            next_seq: 0,
            partial: Vec::new(),
            partial_len: 0,
            in_packet: false,
            keep,
        }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        if self.pos > 0 {
            // At most one incomplete page (< 65,307 bytes) moves down.
            self.buf.drain(..self.pos);
            self.base += self.pos as u64;
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held that do not yet make a whole page.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Whether any page was read.
    pub fn started(&self) -> bool {
        self.serial.is_some()
    }

    /// Drops held bytes (after the end of the stream).
    pub fn clear(&mut self) {
        self.buf = Vec::new();
        self.pos = 0;
        self.partial = Vec::new();
    }

    /// The next whole page, or `None` until more bytes arrive.
    pub fn next_page(&mut self) -> Result<Option<Page>, CodecError> {
        let at = self.base + self.pos as u64;
        let b = &self.buf[self.pos..];
        let cap = b.len().min(CAPTURE.len());
        if b[..cap] != CAPTURE[..cap] {
            return Err(CodecError::Malformed(format!("no Ogg page at byte {at}")));
        }
        if b.len() < HEADER {
            return Ok(None);
        }
        if b[4] != 0 {
            return Err(CodecError::Malformed(format!(
                "unsupported Ogg stream structure version {} at byte {at}",
                b[4]
            )));
        }
        let flags = b[5];
        let le32 = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let granule = le32(6) as u64 | (le32(10) as u64) << 32;
        let serial = le32(14);
        let seq = le32(18);
        let crc = le32(22);
        let nseg = b[26] as usize;
        let header_len = HEADER + nseg;
        if b.len() < header_len {
            return Ok(None);
        }
        let body_len: usize = b[HEADER..header_len].iter().map(|&l| l as usize).sum();
        let total = header_len + body_len;
        if b.len() < total {
            return Ok(None);
        }
        // Fuzzing builds skip the CRC so that mutated input reaches the
        // parsing behind it (as the `ogg` crate does).
        if !cfg!(fuzzing) && page_crc(&b[..total]) != crc {
            return Err(CodecError::Malformed(format!(
                "Ogg page CRC mismatch at byte {at}"
            )));
        }
        match self.serial {
            None if flags & FLAG_BOS == 0 => {
                return Err(CodecError::Malformed(
                    "first Ogg page lacks the beginning-of-stream flag".into(),
                ))
            }
            None => self.serial = Some(serial),
            Some(s) if s != serial => {
                return Err(CodecError::Malformed("more than one logical stream".into()))
            }
            Some(_) if flags & FLAG_BOS != 0 => {
                return Err(CodecError::Malformed(format!(
                    "beginning-of-stream flag on a later page (byte {at})"
                )))
            }
            Some(_) if seq != self.next_seq => {
                return Err(CodecError::Malformed(format!(
                    "Ogg page sequence number {seq} where {} was due: a page is missing",
                    self.next_seq
                )))
            }
            Some(_) => {}
        }
        self.next_seq = seq.wrapping_add(1);
        let continued = flags & FLAG_CONTINUED != 0;
        if continued != self.in_packet {
            return Err(CodecError::Malformed(if continued {
                format!("page at byte {at} continues a packet that never started")
            } else {
                format!("page at byte {at} starts while a packet is unfinished")
            }));
        }

        // Lacing: a packet is segments of 255 bytes ended by one shorter.
        let mut packets = Vec::new();
        let mut off = header_len;
        for &l in &self.buf[self.pos + HEADER..self.pos + header_len] {
            let seg = &self.buf[self.pos + off..self.pos + off + l as usize];
            off += l as usize;
            let room = self.keep.saturating_sub(self.partial.len());
            self.partial.extend_from_slice(&seg[..seg.len().min(room)]);
            self.partial_len += seg.len();
            if l < 255 {
                packets.push(Packet {
                    data: std::mem::take(&mut self.partial),
                    len: std::mem::take(&mut self.partial_len),
                });
            }
        }
        if nseg > 0 {
            self.in_packet = self.buf[self.pos + header_len - 1] == 255;
        }
        self.pos += total;
        Ok(Some(Page {
            granule,
            eos: flags & FLAG_EOS != 0,
            packets,
            ends_inside_packet: self.in_packet,
        }))
    }
}

/// CRC-32 of a page (polynomial 0x04c11db7, no reflection, zero initial
/// value) with its own checksum field counted as zero.
fn page_crc(page: &[u8]) -> u32 {
    let mut crc = 0u32;
    for (i, &b) in page.iter().enumerate() {
        let b = if (22..26).contains(&i) { 0 } else { b };
        crc = (crc << 8) ^ CRC_TABLE[((crc >> 24) as u8 ^ b) as usize];
    }
    crc
}

const CRC_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = (i as u32) << 24;
        let mut k = 0;
        while k < 8 {
            c = if c & 0x8000_0000 != 0 {
                (c << 1) ^ 0x04c1_1db7
            } else {
                c << 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A page with a correct CRC.
    pub(crate) fn page(flags: u8, serial: u32, seq: u32, granule: u64, lacing: &[u8]) -> Vec<u8> {
        let mut p = b"OggS".to_vec();
        p.push(0);
        p.push(flags);
        p.extend(granule.to_le_bytes());
        p.extend(serial.to_le_bytes());
        p.extend(seq.to_le_bytes());
        p.extend([0; 4]);
        p.push(lacing.len() as u8);
        p.extend(lacing);
        let body: usize = lacing.iter().map(|&l| l as usize).sum();
        p.extend((0..body).map(|i| i as u8));
        let c = page_crc(&p);
        p[22..26].copy_from_slice(&c.to_le_bytes());
        p
    }

    fn pages_of(bytes: &[u8]) -> Result<Vec<Page>, CodecError> {
        let mut d = OggDemuxer::new(1 << 20);
        d.push(bytes);
        let mut out = Vec::new();
        while let Some(p) = d.next_page()? {
            out.push(p);
        }
        Ok(out)
    }

    #[test]
    fn crc_matches_the_ogg_crate() {
        // The ogg crate's writer computes the same CRC: a page it writes
        // passes our check.
        let mut w = ogg::PacketWriter::new(Vec::new());
        w.write_packet(vec![1u8, 2, 3], 9, ogg::PacketWriteEndInfo::EndStream, 5)
            .unwrap();
        let bytes = w.into_inner();
        let ps = pages_of(&bytes).unwrap();
        assert_eq!(ps.len(), 1);
        assert_eq!(ps[0].packets[0].data, [1, 2, 3]);
        assert_eq!(ps[0].granule, 5);
        assert!(ps[0].eos);
        let mut bad = bytes.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(pages_of(&bad).unwrap_err().to_string().contains("CRC"));
    }

    #[test]
    fn packets_span_pages_and_bytes_split_anywhere() {
        // Packet A: 255 + 255 + 10 bytes over pages 0 and 1; packet B: 0
        // bytes; packet C: exactly 255 bytes (ended by a 0 lacing value).
        let mut s = page(FLAG_BOS, 1, 0, u64::MAX, &[255, 255]);
        s.extend(page(FLAG_CONTINUED, 1, 1, 7, &[10, 0, 255, 0]));
        s.extend(page(FLAG_EOS, 1, 2, 8, &[3]));
        let ps = pages_of(&s).unwrap();
        assert_eq!(ps.len(), 3);
        assert!(ps[0].packets.is_empty() && ps[0].ends_inside_packet);
        let lens: Vec<usize> = ps[1].packets.iter().map(|p| p.len).collect();
        assert_eq!(lens, [520, 0, 255]);
        assert_eq!(ps[1].packets[0].data.len(), 520);
        assert_eq!(ps[2].packets[0].len, 3);
        // One byte at a time gives the same pages.
        let mut d = OggDemuxer::new(1 << 20);
        let mut n = 0;
        for b in &s {
            d.push(std::slice::from_ref(b));
            while let Some(p) = d.next_page().unwrap() {
                assert_eq!(p.packets.len(), ps[n].packets.len());
                n += 1;
            }
        }
        assert_eq!(n, 3);
        // `keep` caps what is stored, not what is counted.
        let mut d = OggDemuxer::new(100);
        d.push(&s);
        d.next_page().unwrap().unwrap();
        let p = d.next_page().unwrap().unwrap();
        assert_eq!((p.packets[0].data.len(), p.packets[0].len), (100, 520));
    }

    #[test]
    fn structure_errors() {
        let err = |b: &[u8]| pages_of(b).err().map(|e| e.to_string());
        assert!(err(b"RIFF").unwrap().contains("no Ogg page at byte 0"));
        // A prefix of a page is just incomplete.
        assert!(err(b"Og").is_none());
        let mut d = OggDemuxer::new(10);
        d.push(&page(FLAG_BOS, 1, 0, 0, &[200])[..100]);
        assert!(d.next_page().unwrap().is_none());
        assert_eq!(d.pending(), 100);
        let p0 = page(FLAG_BOS, 1, 0, 0, &[1]);
        assert!(err(&page(0, 1, 0, 0, &[1]))
            .unwrap()
            .contains("beginning-of-stream"));
        let two = [p0.clone(), page(0, 2, 1, 0, &[1])].concat();
        assert!(err(&two).unwrap().contains("more than one logical stream"));
        let gap = [p0.clone(), page(0, 1, 2, 0, &[1])].concat();
        assert!(err(&gap).unwrap().contains("a page is missing"));
        let bos2 = [p0.clone(), page(FLAG_BOS, 1, 1, 0, &[1])].concat();
        assert!(err(&bos2).unwrap().contains("later page"));
        let cont = [p0.clone(), page(FLAG_CONTINUED, 1, 1, 0, &[1])].concat();
        assert!(err(&cont).unwrap().contains("never started"));
        let open = [page(FLAG_BOS, 1, 0, 0, &[255]), page(0, 1, 1, 0, &[1])].concat();
        assert!(err(&open).unwrap().contains("unfinished"));
        let mut v1 = p0.clone();
        v1[4] = 1;
        assert!(err(&v1).unwrap().contains("version"));
        // Garbage after a good page is reported at its offset.
        let tail = [p0.clone(), b"junk".to_vec()].concat();
        assert!(err(&tail).unwrap().contains(&format!("byte {}", p0.len())));
    }
}
