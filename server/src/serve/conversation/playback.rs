//! How an answer plays at the client: what was sent when, what was heard
//! when the user cut in, and what of the answer's words that was. Time is
//! an input (`now`): decided without clocks.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One answer's audio as the client plays it (from its first packet, at
/// real time).
#[derive(Debug, Clone, Default)]
pub struct Playback {
    /// When its first audio went out.
    started: Option<Instant>,
    /// Audio handed to the client or the track.
    sent: Duration,
    interrupted: bool,
    /// What the user had heard when they interrupted (ms of audio).
    heard_ms: u64,
}

impl Playback {
    /// When its first audio went out (the echo guard counts from here).
    pub fn started(&self) -> Option<Instant> {
        self.started
    }

    /// `seconds` in all went out by `now`.
    pub fn sent_until(&mut self, seconds: f64, now: Instant) {
        self.started.get_or_insert(now);
        self.sent = self.sent.max(Duration::from_secs_f64(seconds.max(0.0)));
    }

    /// Marks it interrupted at `now`. Heard: what left (sent minus what a
    /// media track still had queued, `queued_s`), and never more than real
    /// time since its first audio (a WebSocket client plays as it receives).
    pub fn interrupt(&mut self, queued_s: f64, now: Instant) {
        let left = self
            .sent
            .saturating_sub(Duration::from_secs_f64(queued_s.max(0.0)));
        let since = self
            .started
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        self.heard_ms = left.min(since).as_millis() as u64;
        self.interrupted = true;
    }

    /// The client says it played `audio_end_ms` of it, and no more.
    pub fn truncate(&mut self, audio_end_ms: u64) {
        self.heard_ms = audio_end_ms;
        self.interrupted = true;
    }

    /// Whether a client that plays as it receives is still playing it at
    /// `now` (more audio went out than real time since the first).
    pub fn playing(&self, now: Instant) -> bool {
        self.started
            .is_some_and(|t| self.sent > now.saturating_duration_since(t))
    }

    pub fn interrupted(&self) -> bool {
        self.interrupted
    }

    pub fn heard_ms(&self) -> u64 {
        self.heard_ms
    }

    /// What of `text` (the answer) the user heard before interrupting.
    pub fn heard_text<'a>(&self, text: &'a str, chars_per_second: f64) -> &'a str {
        spoken_prefix(text, self.heard_ms as f64 / 1000.0, chars_per_second)
    }
}

/// How many characters of text the voice speaks per second, learnt from the
/// answers it finished (an interrupted answer keeps only what was heard).
pub struct SpeechRate(Mutex<(f64, f64)>);

/// Before any answer finished: Piper's "joe" at length_scale 1.0 speaks about
/// 14 characters a second (measured on the sweep's answers).
const DEFAULT_CHARS_PER_SECOND: f64 = 14.0;

impl Default for SpeechRate {
    fn default() -> Self {
        Self(Mutex::new((0.0, 0.0)))
    }
}

impl SpeechRate {
    pub fn observe(&self, chars: usize, seconds: f64) {
        if chars == 0 || seconds <= 0.0 {
            return;
        }
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += chars as f64;
        g.1 += seconds;
    }

    pub fn chars_per_second(&self) -> f64 {
        let g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.1 > 1.0 {
            g.0 / g.1
        } else {
            DEFAULT_CHARS_PER_SECOND
        }
    }
}

/// The part of `text` spoken in `seconds` of audio at `chars_per_second`,
/// cut back to a word boundary (a word cut mid-way was not heard whole).
pub fn spoken_prefix(text: &str, seconds: f64, chars_per_second: f64) -> &str {
    let n = (seconds.max(0.0) * chars_per_second).floor() as usize;
    let Some((cut, _)) = text.char_indices().nth(n) else {
        return text;
    };
    let head = &text[..cut];
    match head.rfind(char::is_whitespace) {
        Some(i) => head[..i].trim_end(),
        None => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spoken_prefix_cuts_at_a_word() {
        let t = "Bees make honey from nectar.";
        assert_eq!(spoken_prefix(t, 0.0, 14.0), "");
        // 10 chars: "Bees make " -> whole words only.
        assert_eq!(spoken_prefix(t, 10.0 / 14.0, 14.0), "Bees make");
        assert_eq!(spoken_prefix(t, 8.0 / 14.0, 14.0), "Bees");
        assert_eq!(spoken_prefix(t, 100.0, 14.0), t);
        assert_eq!(spoken_prefix("héllo wörld", 7.0 / 14.0, 14.0), "héllo");
    }

    #[test]
    fn speech_rate_learns() {
        let r = SpeechRate::default();
        assert_eq!(r.chars_per_second(), DEFAULT_CHARS_PER_SECOND);
        r.observe(300, 20.0);
        assert!((r.chars_per_second() - 15.0).abs() < 1e-9);
        r.observe(0, 5.0);
        assert!((r.chars_per_second() - 15.0).abs() < 1e-9);
    }

    #[test]
    fn heard_is_what_left_and_no_more_than_real_time() {
        let t0 = Instant::now();
        let mut p = Playback::default();
        assert!(!p.playing(t0));
        p.sent_until(3.0, t0);
        assert!(p.playing(t0 + Duration::from_secs(2)));
        assert!(!p.playing(t0 + Duration::from_secs(4)));
        // A WebSocket client plays as it receives: 1 s in, 1 s was heard.
        p.interrupt(0.0, t0 + Duration::from_secs(1));
        assert_eq!(p.heard_ms(), 1000);
        // A track with 2.5 s still queued: 0.5 s left it.
        let mut p = Playback::default();
        p.sent_until(3.0, t0);
        p.interrupt(2.5, t0 + Duration::from_secs(2));
        assert_eq!(p.heard_ms(), 500);
        assert!(p.interrupted());
        assert_eq!(p.heard_text("Bees make honey.", 14.0), "Bees");
    }
}
