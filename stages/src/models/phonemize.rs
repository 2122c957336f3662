//! Text -> IPA phonemes for the Piper voice, the way piper-phonemize makes them.
//!
//! espeak-ng is GPL, so it is never linked: we run the `espeak-ng` program and
//! talk to it over pipes, once per request.
//!
//! piper-phonemize calls `espeak_TextToPhonemes(espeakCHARS_AUTO, IPA, no
//! separator)` clause by clause, appends the clause terminator (`,` `:` `;`
//! followed by a space; `.` `?` `!` ending the sentence), drops `(xx)`
//! language-switch flags and NFD-decomposes the result. The espeak-ng CLI
//! (`-q --ipa --stdin`) prints one line of the same phonemes per clause, but
//! not the terminators, so:
//! * we split the text into clauses ourselves with espeak's own rules
//!   (`ReadClause`: `, . ? ! : ;` and dashes followed by space/bracket/end, not
//!   before any letter or digit, `.` not before a lower-case word, `?!` runs
//!   count as their first char, `...` does not end a clause we know) and give
//!   espeak one clause per line, with its punctuation (abbreviations like `Mr.`
//!   read the same);
//! * each clause goes to espeak as is (`A`) and, if short (<= 4 words: only
//!   those can lack a stressed word), again in the same run after a marker
//!   word in phoneme input, `[[x'ixx]]` (`B`). The CLI, unlike
//!   `TextToPhonemes`, runs the intonation pass, which promotes a syllable to
//!   primary stress in a clause that has none (`or,` -> `ˈɔːɹ`, piper `ɔːɹ`).
//!   In `B` the stressed marker prevents that, but the clause is no longer at
//!   the start (which changes e.g. `When` -> `wɛn`, `!` -> "exclamation"). So
//!   `A` is used, unless `B` shows the clause has no primary stress and
//!   reads the same otherwise. A sentinel clause `[[xxx]]` (`xxx`: no text
//!   gives that) before each `A` and the marker before each `B` say which
//!   output lines belong where, whatever espeak does inside a clause. User
//!   text cannot contain `[[`, so it cannot reach phoneme input.
//!
//! Deliberate differences from piper-phonemize (all in edge cases):
//! * any newline ends the sentence (piper: only blank lines); no punctuation is
//!   added for it, as piper does for paragraph ends;
//! * where espeak ends a clause without a terminator piper knows (an ellipsis
//!   `…`/`...`, an over-long clause) we put a space; piper glues the words
//!   together (`wˈeɪtwˌʌt`);
//! * `. ? !` before a blank line keep their punctuation.
//!
//! The phonemes themselves depend on the espeak-ng data version: piper's
//! bundled data says `həlˈoʊ`, Debian's espeak-ng 1.51 `hɛlˈoʊ`. Set
//! `OMNISTREAM_ESPEAK_DATA` to a folder holding piper's `espeak-ng-data` to get
//! byte-identical output.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::{ModelError, Result};

/// Environment variable naming the espeak-ng program (default: `espeak-ng` on PATH).
pub const ESPEAK_ENV: &str = "OMNISTREAM_ESPEAK";
/// Environment variable naming the folder that holds `espeak-ng-data` (espeak's `--path`).
pub const ESPEAK_DATA_ENV: &str = "OMNISTREAM_ESPEAK_DATA";
/// How long one espeak-ng run may take before it is killed.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Marker word (phoneme input) before the second copy (`B`) of a short clause;
/// its IPA, stress marks aside, cannot come out of text, and `[[` is
/// neutralised in user text. Its primary stress keeps espeak from promoting one
/// in the clause.
const MARKER_IN: &str = "[[x'ixx]]";
const MARKER_OUT: &str = "xixx";
/// Sentinel clause (phoneme input, no vowel so no stress) before each clause.
const SENTINEL_IN: &str = "[[xxx]]";
const SENTINEL_OUT: &str = "xxx";

fn err(msg: impl Into<String>) -> ModelError {
    ModelError::Phonemizer(msg.into())
}

/// Runs espeak-ng (out of process) to turn text into piper's IPA phonemes.
#[derive(Debug, Clone)]
pub struct Phonemizer {
    voice: String,
    program: PathBuf,
    data_dir: Option<PathBuf>,
    timeout: Duration,
}

impl Phonemizer {
    /// Finds `espeak-ng` (env `OMNISTREAM_ESPEAK`, else PATH) and checks that it
    /// runs with `voice` (e.g. `en-us`, the `espeak.voice` of a Piper config).
    pub fn new(voice: &str) -> Result<Self> {
        let program = find_program()?;
        let data_dir = std::env::var_os(ESPEAK_DATA_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        Self::with_program(voice, program, data_dir)
    }

    /// Like [`Phonemizer::new`] with an explicit program and data folder.
    pub fn with_program(voice: &str, program: PathBuf, data_dir: Option<PathBuf>) -> Result<Self> {
        let valid = !voice.is_empty()
            && !voice.starts_with('-')
            && voice
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_+/".contains(c));
        if !valid {
            return Err(err(format!("invalid espeak-ng voice name {voice:?}")));
        }
        if let Some(d) = &data_dir {
            if !d.join("espeak-ng-data").is_dir() {
                return Err(err(format!(
                    "{ESPEAK_DATA_ENV}={}: no espeak-ng-data folder in it",
                    d.display()
                )));
            }
        }
        let p = Phonemizer {
            voice: voice.to_owned(),
            program,
            data_dir,
            timeout: DEFAULT_TIMEOUT,
        };
        // Self-test: the program runs, knows the voice and speaks our protocol.
        p.check_voice()?;
        let out = p.phonemize("a").map_err(|e| {
            err(format!(
                "{} does not work with voice {voice:?} ({e}); install espeak-ng (e.g. `apt-get install espeak-ng`)",
                p.program.display()
            ))
        })?;
        if out.is_empty() {
            return Err(err(format!(
                "{} gave no phonemes for voice {voice:?}",
                p.program.display()
            )));
        }
        Ok(p)
    }

    /// Sets how long one espeak-ng run may take (default 10 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The espeak-ng voice.
    pub fn voice(&self) -> &str {
        &self.voice
    }

    /// The espeak-ng program run.
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// Text -> one IPA phoneme string per sentence (sentence = ends with . ! ? or
    /// end of text / line), punctuation kept as piper keeps it. Text without
    /// anything speakable gives an empty vec.
    pub fn phonemize(&self, text: &str) -> Result<Vec<String>> {
        let clauses = split_clauses(&normalize(&unmark(text)));
        if clauses.is_empty() {
            return Ok(Vec::new());
        }
        let mut input = String::with_capacity(2 * text.len() + clauses.len() * 32);
        for c in &clauses {
            // After a terminator one newline ends the clause (and keeps espeak's
            // "dot after last word" flag); without one a blank line is needed.
            let end = if c.term.has_punct() { "\n" } else { "\n\n" };
            input.push_str(SENTINEL_IN);
            input.push_str("\n\n");
            input.push_str(&c.text);
            input.push_str(end);
            if needs_stress_check(c) {
                input.push_str(MARKER_IN);
                input.push(' ');
                input.push_str(&c.text);
                input.push_str(end);
            }
        }
        let out = self.run(&input)?;
        let groups = group_lines(&out)?;
        let lined_up = groups.len() == clauses.len()
            && clauses
                .iter()
                .zip(&groups)
                .all(|(c, g)| g.seen_marker == needs_stress_check(c));
        if !lined_up {
            return Err(err(format!(
                "espeak-ng output does not line up with the input ({} clauses, {} answers)",
                clauses.len(),
                groups.len()
            )));
        }
        Ok(assemble(&clauses, &groups))
    }

    /// Checks that espeak-ng knows the voice: an unknown `-v` is silently
    /// replaced by the default voice, so `--voices` is the only way to tell.
    fn check_voice(&self) -> Result<()> {
        let out = self.exec(&["--voices"], "")?;
        let want = self
            .voice
            .split('+')
            .next()
            .unwrap_or("")
            .to_ascii_lowercase();
        let known = out.lines().skip(1).any(|line| {
            let cols: Vec<String> = line
                .split_whitespace()
                .map(|c| c.to_ascii_lowercase())
                .collect();
            let (Some(lang), Some(name), Some(file)) = (cols.get(1), cols.get(3), cols.get(4))
            else {
                return false;
            };
            let others = cols.get(5..).unwrap_or_default().join(" ");
            lang == &want
                || name == &want
                || file == &want
                || file.rsplit('/').next() == Some(want.as_str())
                || others.contains(&format!("({want} "))
        });
        if known {
            Ok(())
        } else {
            Err(err(format!(
                "espeak-ng has no voice {:?} (see `espeak-ng --voices`)",
                self.voice
            )))
        }
    }

    fn run(&self, input: &str) -> Result<String> {
        self.exec(&["-q", "--ipa", "-v", &self.voice, "--stdin"], input)
    }

    /// Runs espeak-ng with `args` (plus `--path`), `input` on stdin, under the timeout.
    fn exec(&self, args: &[&str], input: &str) -> Result<String> {
        let mut cmd = Command::new(&self.program);
        if let Some(d) = &self.data_dir {
            let mut a = std::ffi::OsString::from("--path=");
            a.push(d);
            cmd.arg(a);
        }
        cmd.args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| {
            err(format!(
                "cannot run {}: {e} (install espeak-ng)",
                self.program.display()
            ))
        })?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = child.stdout.take().expect("piped stdout");
        let mut stderr = child.stderr.take().expect("piped stderr");
        let child = Arc::new(Mutex::new(child));
        let deadline = Instant::now() + self.timeout;

        // Watchdog: kills the child if it is still running at the deadline
        // (a blocked read below then sees EOF).
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let watchdog = {
            let child = Arc::clone(&child);
            let timeout = self.timeout;
            thread::spawn(move || {
                if let Err(mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(timeout) {
                    let _ = lock(&child).kill();
                    true
                } else {
                    false
                }
            })
        };
        let input_len = input.len();
        let input = input.as_bytes().to_vec();
        let writer = thread::spawn(move || {
            let r = stdin.write_all(&input);
            drop(stdin);
            r
        });
        let err_reader = thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = stderr.read_to_end(&mut buf);
            buf
        });
        let mut out = Vec::new();
        let read = stdout.read_to_end(&mut out);
        let status = loop {
            // (The guard must not live through the match: the arms lock again.)
            let polled = lock(&child).try_wait();
            match polled {
                Ok(Some(s)) => break Ok(s),
                Ok(None) if Instant::now() >= deadline => {
                    let mut c = lock(&child);
                    let _ = c.kill();
                    break c.wait();
                }
                Ok(None) => {}
                Err(e) => break Err(e),
            }
            thread::sleep(Duration::from_millis(1));
        };
        let _ = done_tx.send(());
        let killed = watchdog.join().unwrap_or(false) || Instant::now() >= deadline;
        let written = writer.join();
        let stderr = err_reader.join().unwrap_or_default();
        let stderr = String::from_utf8_lossy(&stderr);
        let stderr = stderr.trim();

        if killed {
            return Err(err(format!(
                "espeak-ng timed out after {:?} ({input_len} bytes of input)",
                self.timeout
            )));
        }
        let status = status.map_err(|e| err(format!("waiting for espeak-ng: {e}")))?;
        if !status.success() {
            return Err(err(format!("espeak-ng failed ({status}): {stderr}")));
        }
        read.map_err(|e| err(format!("reading espeak-ng output: {e}")))?;
        if let Ok(Err(e)) = written {
            return Err(err(format!("writing to espeak-ng: {e}")));
        }
        String::from_utf8(out).map_err(|_| err("espeak-ng output is not UTF-8"))
    }
}

fn lock(c: &Mutex<Child>) -> std::sync::MutexGuard<'_, Child> {
    c.lock().unwrap_or_else(|p| p.into_inner())
}

fn find_program() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(ESPEAK_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if p.components().count() > 1 {
            if is_executable(&p) {
                return Ok(p);
            }
            return Err(err(format!(
                "{ESPEAK_ENV}={}: not an executable file (install espeak-ng)",
                p.display()
            )));
        }
        return search_path(p.as_os_str()).ok_or_else(|| {
            err(format!(
                "{ESPEAK_ENV}={}: not found on PATH (install espeak-ng)",
                p.display()
            ))
        });
    }
    search_path("espeak-ng".as_ref()).ok_or_else(|| {
        err("espeak-ng not found on PATH: install espeak-ng (e.g. `apt-get install espeak-ng`) or set OMNISTREAM_ESPEAK to its path")
    })
}

fn search_path(name: &std::ffi::OsStr) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    match std::fs::metadata(p) {
        Ok(m) if m.is_file() => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                m.permissions().mode() & 0o111 != 0
            }
            #[cfg(not(unix))]
            {
                true
            }
        }
        _ => false,
    }
}

/// How a clause ends, i.e. what piper appends after its phonemes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Term {
    Comma,
    Colon,
    Semicolon,
    Period,
    Question,
    Exclamation,
    /// End of line / text without punctuation: the sentence ends, nothing added.
    Paragraph,
}

impl Term {
    fn has_punct(self) -> bool {
        !matches!(self, Term::Paragraph)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Clause {
    /// The clause text including its terminating punctuation.
    text: String,
    term: Term,
}

/// Markdown and other markup as a listener hears it read out: emphasis, code
/// marks, headings, list and quote markers, table pipes go; a link is its text;
/// a bare URL its host (`https://www.example.com/a?b` -> `example.com`). Chat
/// models write Markdown, and espeak would read "asterisk asterisk". Works on
/// any span of a streamed answer (marks cut across spans are still dropped).
pub fn unmark(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, line) in text.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        // Block markers at the line's start: headings, quotes, bullets, fences.
        let mut body = body.trim_start_matches('#').trim_start_matches('>');
        for bullet in ["- ", "* ", "+ "] {
            if let Some(rest) = body.strip_prefix(bullet) {
                body = rest;
                break;
            }
        }
        out.push_str(indent);
        unmark_inline(body.trim_start_matches(['#', '>']), &mut out);
    }
    out
}

fn unmark_inline(line: &str, out: &mut String) {
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let prev = i.checked_sub(1).map(|j| chars[j]);
        let next = chars.get(i + 1).copied();
        match c {
            '*' | '`' | '~' => {}
            // snake_case reads as two words; _emphasis_ as the word.
            '_' if prev.is_some_and(char::is_alphanumeric)
                && next.is_some_and(char::is_alphanumeric) =>
            {
                out.push(' ')
            }
            '_' => {}
            '|' => out.push(','),
            // [text](url): the text.
            '[' => {
                if let Some(close) = chars[i..].iter().position(|&x| x == ']') {
                    let end = i + close;
                    if chars.get(end + 1) == Some(&'(') {
                        if let Some(p) = chars[end..].iter().position(|&x| x == ')') {
                            unmark_inline(&chars[i + 1..end].iter().collect::<String>(), out);
                            i = end + p + 1;
                            continue;
                        }
                    }
                }
                out.push(c);
            }
            'h' if prev.is_none_or(|p| !p.is_alphanumeric()) => {
                let rest: String = chars[i..].iter().take(8).collect();
                let scheme = ["https://", "http://"]
                    .into_iter()
                    .find(|s| rest.starts_with(s));
                match scheme {
                    Some(scheme) => {
                        let start = i + scheme.len();
                        let end = chars[start..]
                            .iter()
                            .position(|x| x.is_whitespace())
                            .map_or(chars.len(), |n| start + n);
                        let url: String = chars[start..end].iter().collect();
                        let host = url.split(['/', '?', '#']).next().unwrap_or("");
                        out.push_str(host.strip_prefix("www.").unwrap_or(host));
                        // A sentence may end right after the URL.
                        if url.ends_with(['.', ',', '!', '?']) && url.contains('/') {
                            out.push(url.chars().last().unwrap_or('.'));
                        }
                        i = end;
                        continue;
                    }
                    None => out.push(c),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
}

/// Cleans text for espeak: no control chars or zero-width (non-)joiners,
/// single spaces, `\n` only between non-empty lines, no `[[`/`]]` phoneme input.
fn normalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut pending_space = false;
    let mut pending_newline = false;
    let mut prev = '\n';
    for c in text.chars() {
        let c = match c {
            '\u{200B}' | '\u{200C}' | '\u{200D}' | '\u{2060}' | '\u{FEFF}' | '\u{AD}' => continue,
            '\n' | '\r' | '\u{2028}' | '\u{2029}' | '\u{85}' => {
                pending_newline = true;
                continue;
            }
            c if c.is_whitespace() || c.is_control() => {
                pending_space = true;
                continue;
            }
            c => c,
        };
        if !out.is_empty() {
            if pending_newline {
                out.push('\n');
                prev = '\n';
            } else if pending_space {
                out.push(' ');
                prev = ' ';
            }
        }
        pending_space = false;
        pending_newline = false;
        // Break up `[[` and `]]` so the text cannot switch espeak to phoneme input.
        if (c == '[' || c == ']') && prev == c {
            out.push(' ');
        }
        out.push(c);
        prev = c;
    }
    out
}

fn punct_term(c: char) -> Option<Term> {
    Some(match c {
        ',' => Term::Comma,
        '.' => Term::Period,
        '?' => Term::Question,
        '!' => Term::Exclamation,
        ':' => Term::Colon,
        ';' => Term::Semicolon,
        '\u{2013}' | '\u{2014}' => Term::Semicolon, // en/em dash, as espeak
        _ => return None,
    })
}

/// espeak's `IsBracket`: brackets and quotes.
fn is_bracket(c: char) -> bool {
    matches!(
        c,
        '(' | ')' | '[' | ']' | '{' | '}' | '<' | '>' | '"' | '\'' | '`' | '«' | '»' | '《' | '》'
    ) || ('\u{2018}'..='\u{201F}').contains(&c)
}

/// Splits normalised text into clauses following espeak-ng's `ReadClause`.
fn split_clauses(text: &str) -> Vec<Clause> {
    let mut clauses = Vec::new();
    for line in text.split('\n') {
        let chars: Vec<char> = line.chars().collect();
        let n = chars.len();
        let mut start = 0;
        let mut any_alnum = false;
        let mut i = 0;
        while i < n {
            let c1 = chars[i];
            if c1.is_alphanumeric() {
                any_alnum = true;
                i += 1;
                continue;
            }
            // `i..end` is the punctuation run that may end the clause.
            let (term, end) = if c1 == '.' && chars.get(i + 1) == Some(&'.') {
                let mut j = i;
                while j < n && chars[j] == '.' {
                    j += 1;
                }
                // `...` is an ellipsis: espeak ends a clause there without a
                // terminator piper knows; leave that to espeak (joined by a space).
                // `..`: the second dot decides.
                (None, if j - i >= 3 { j } else { i + 1 })
            } else {
                match punct_term(c1) {
                    Some(t @ (Term::Question | Term::Exclamation)) => {
                        let mut j = i + 1;
                        while j < n && matches!(chars[j], '?' | '!') {
                            j += 1;
                        }
                        (Some(t), j)
                    }
                    t => (t, i + 1),
                }
            };
            let Some(term) = term else {
                i = end;
                continue;
            };
            let c2 = chars.get(end).copied();
            let mut is_end = match c2 {
                None => true,
                Some(c2) => c2.is_whitespace() || is_bracket(c2) || c2 == '?',
            };
            if is_end {
                // Next non-space char on this line; none = newline follows.
                let mut k = end;
                while k < n && chars[k].is_whitespace() {
                    k += 1;
                }
                if k == n {
                    // End of the text: espeak sees no newline, so a clause
                    // without letters or digits does not end here either.
                    if !any_alnum {
                        is_end = false;
                    }
                } else {
                    let c_next = chars[k];
                    if term == Term::Period
                        && ((c_next == '\'' && chars.get(k + 1) == Some(&'s'))
                            || c_next.is_lowercase())
                    {
                        is_end = false;
                    }
                    if !any_alnum {
                        is_end = false;
                    }
                }
            }
            if is_end {
                let text: String = chars[start..end].iter().collect();
                let text = text.trim().to_owned();
                clauses.push(Clause { text, term });
                start = end;
                any_alnum = false;
            }
            i = end;
        }
        let rest: String = chars[start..].iter().collect();
        let rest = rest.trim();
        if !rest.is_empty() {
            clauses.push(Clause {
                text: rest.to_owned(),
                term: Term::Paragraph,
            });
        }
    }
    clauses
}

/// Output lines of one clause: as is (`a`) and after the marker (`b`).
#[derive(Debug, Default)]
struct Group<'a> {
    a: Vec<&'a str>,
    b: Vec<&'a str>,
    seen_marker: bool,
}

/// Splits espeak's output into one [`Group`] per clause: a sentinel line
/// starts a group, a marker line switches it to `b`, other lines continue.
fn group_lines(out: &str) -> Result<Vec<Group<'_>>> {
    let mut groups: Vec<Group> = Vec::new();
    for line in out.lines() {
        let line = line.trim();
        if line
            .chars()
            .filter(|c| !matches!(c, 'ˈ' | 'ˌ'))
            .eq(SENTINEL_OUT.chars())
        {
            groups.push(Group::default());
            continue;
        }
        let marked = strip_marker(line);
        if line.is_empty() && marked.is_none() {
            continue;
        }
        let Some(g) = groups.last_mut() else {
            return Err(err(format!("unexpected espeak-ng output {line:?}")));
        };
        match marked {
            Some(rest) if !g.seen_marker => {
                g.seen_marker = true;
                g.b.push(rest);
            }
            Some(_) => return Err(err("espeak-ng output does not line up with the input")),
            None if g.seen_marker => g.b.push(line),
            None => g.a.push(line),
        }
    }
    Ok(groups)
}

/// Whether a clause is also sent after the marker (`B`), to see if espeak
/// promoted a stress. Only short clauses can lack a stressed word.
fn needs_stress_check(c: &Clause) -> bool {
    c.text.split_whitespace().count() <= 4
}

/// Phonemes of one clause: `a`, unless espeak promoted a syllable there to
/// primary stress (`b` has none and is otherwise the same): then `b`.
fn choose(g: &Group) -> String {
    let a = clean_phonemes(&g.a);
    if !g.seen_marker {
        return a;
    }
    let b = clean_phonemes(&g.b);
    let unstressed = |s: &str| {
        s.chars()
            .filter(|c| !matches!(c, 'ˈ' | 'ˌ'))
            .collect::<String>()
    };
    if a.contains('ˈ') && !b.contains('ˈ') && unstressed(&a) == unstressed(&b) {
        b
    } else {
        a
    }
}

/// The line without the leading marker (`xˈixx`, stress marks anywhere in
/// it), or None if the line does not start with it.
fn strip_marker(line: &str) -> Option<&str> {
    let mut want = MARKER_OUT.chars().peekable();
    let mut end = 0;
    for (i, c) in line.char_indices() {
        if want.peek().is_none() {
            break;
        }
        if matches!(c, 'ˈ' | 'ˌ') {
            end = i + c.len_utf8();
            continue;
        }
        if want.next() != Some(c) {
            return None;
        }
        end = i + c.len_utf8();
    }
    if want.peek().is_some() {
        return None;
    }
    Some(line[end..].trim_start())
}

/// Cleans one clause's phoneme lines: drops `(en)`-style language flags and
/// zero-width joiners, NFD-decomposes, joins lines with a space.
fn clean_phonemes(lines: &[&str]) -> String {
    let mut out = String::new();
    for line in lines {
        let mut cleaned = String::with_capacity(line.len());
        let mut in_flag = false;
        for c in line.chars() {
            if in_flag {
                in_flag = c != ')';
                continue;
            }
            match c {
                '(' => in_flag = true,
                '\u{200C}' | '\u{200D}' => {}
                c => match decompose(c) {
                    Some((base, mark)) => {
                        cleaned.push(base);
                        cleaned.push(mark);
                    }
                    None => cleaned.push(c),
                },
            }
        }
        // Inner spacing as espeak gives it (piper keeps its double spaces).
        let cleaned = cleaned.trim();
        if cleaned.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(cleaned);
    }
    out
}

/// NFD for the precomposed letters espeak's IPA can contain (piper decomposes
/// its phonemes, e.g. `ç` -> `c` + U+0327, which has its own phoneme id).
fn decompose(c: char) -> Option<(char, char)> {
    const GRAVE: char = '\u{300}';
    const ACUTE: char = '\u{301}';
    const CIRC: char = '\u{302}';
    const TILDE: char = '\u{303}';
    const DIAER: char = '\u{308}';
    const RING: char = '\u{30A}';
    const CARON: char = '\u{30C}';
    const CEDIL: char = '\u{327}';
    Some(match c {
        'à' => ('a', GRAVE),
        'á' => ('a', ACUTE),
        'â' => ('a', CIRC),
        'ã' => ('a', TILDE),
        'ä' => ('a', DIAER),
        'å' => ('a', RING),
        'ç' => ('c', CEDIL),
        'è' => ('e', GRAVE),
        'é' => ('e', ACUTE),
        'ê' => ('e', CIRC),
        'ë' => ('e', DIAER),
        'ẽ' => ('e', TILDE),
        'ě' => ('e', CARON),
        'ì' => ('i', GRAVE),
        'í' => ('i', ACUTE),
        'î' => ('i', CIRC),
        'ï' => ('i', DIAER),
        'ĩ' => ('i', TILDE),
        'ñ' => ('n', TILDE),
        'ò' => ('o', GRAVE),
        'ó' => ('o', ACUTE),
        'ô' => ('o', CIRC),
        'õ' => ('o', TILDE),
        'ö' => ('o', DIAER),
        'ù' => ('u', GRAVE),
        'ú' => ('u', ACUTE),
        'û' => ('u', CIRC),
        'ü' => ('u', DIAER),
        'ũ' => ('u', TILDE),
        'ý' => ('y', ACUTE),
        'ÿ' => ('y', DIAER),
        'ỹ' => ('y', TILDE),
        _ => return None,
    })
}

/// Joins clause phonemes into sentences with piper's punctuation.
fn assemble(clauses: &[Clause], groups: &[Group]) -> Vec<String> {
    let mut sentences = Vec::new();
    let mut cur = String::new();
    for (clause, group) in clauses.iter().zip(groups) {
        let ph = choose(group);
        if !ph.is_empty() && cur.chars().last().is_some_and(|c| !c.is_whitespace()) {
            // Defensive: every terminator already ends in a space or a new sentence.
            cur.push(' ');
        }
        cur.push_str(&ph);
        let end_sentence = match clause.term {
            Term::Comma => {
                cur.push_str(", ");
                false
            }
            Term::Colon => {
                cur.push_str(": ");
                false
            }
            Term::Semicolon => {
                cur.push_str("; ");
                false
            }
            Term::Period => {
                cur.push('.');
                true
            }
            Term::Question => {
                cur.push('?');
                true
            }
            Term::Exclamation => {
                cur.push('!');
                true
            }
            Term::Paragraph => true,
        };
        if end_sentence {
            push_sentence(&mut sentences, std::mem::take(&mut cur));
        }
    }
    push_sentence(&mut sentences, cur);
    sentences
}

fn push_sentence(sentences: &mut Vec<String>, s: String) {
    let speakable = s
        .chars()
        .any(|c| !c.is_whitespace() && !matches!(c, ',' | '.' | ';' | ':' | '!' | '?'));
    if speakable {
        sentences.push(s);
    }
}

/// Splits streaming text into speakable spans: returns the byte index after the
/// first clause boundary (`. ! ? ; : ,` — or a run of them, e.g. `?!` or `...` —
/// followed by whitespace or the end of the text, or a newline) whose prefix has
/// at least `min_chars` characters (spaces trimmed) and something speakable.
/// A `.` followed by a lower-case word is not a boundary (`e.g. this`), as in
/// espeak. Note the end of `text` counts as "followed by": a caller streaming
/// tokens may want to wait for the next one before cutting at the very end.
pub fn speakable_boundary(text: &str, min_chars: usize) -> Option<usize> {
    let mut any_alnum = false;
    let mut iter = text.char_indices().peekable();
    while let Some((i, c)) = iter.next() {
        if c.is_alphanumeric() {
            any_alnum = true;
            continue;
        }
        let end = if c == '\n' {
            i + 1
        } else if matches!(c, '.' | '!' | '?' | ';' | ':' | ',' | '\u{2026}') {
            // Swallow a run of punctuation: "?!", "...", "!!!".
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = iter.peek() {
                if matches!(d, '.' | '!' | '?' | '\u{2026}') {
                    end = j + d.len_utf8();
                    iter.next();
                } else {
                    break;
                }
            }
            let rest = &text[end..];
            match rest.chars().next() {
                None => {}
                Some(n) if n.is_whitespace() => {
                    // A single `.` before a lower-case word: an abbreviation.
                    let next_lower = rest
                        .trim_start()
                        .chars()
                        .next()
                        .is_some_and(char::is_lowercase);
                    if c == '.' && end - i == 1 && next_lower {
                        continue;
                    }
                }
                Some(_) => continue,
            }
            end
        } else {
            continue;
        };
        if any_alnum && text[..end].trim().chars().count() >= min_chars {
            return Some(end);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ph() -> Phonemizer {
        Phonemizer::new("en-us").expect("espeak-ng is required (install espeak-ng)")
    }

    #[test]
    fn clause_splitting_follows_espeak() {
        let c = split_clauses(&normalize(
            "Hello, world. Mr. Smith paid 3.5 dollars, e.g. cheap! Really?! Yes — no... ok",
        ));
        let got: Vec<(&str, Term)> = c.iter().map(|c| (c.text.as_str(), c.term)).collect();
        assert_eq!(
            got,
            vec![
                ("Hello,", Term::Comma),
                ("world.", Term::Period),
                ("Mr.", Term::Period),
                ("Smith paid 3.5 dollars,", Term::Comma),
                ("e.g. cheap!", Term::Exclamation),
                ("Really?!", Term::Question),
                ("Yes —", Term::Semicolon),
                ("no... ok", Term::Paragraph),
            ]
        );
        // Punctuation before any letter does not end a clause.
        let c = split_clauses(&normalize(". , Hi"));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].text, ". , Hi");
    }

    #[test]
    fn markup_is_not_read_aloud() {
        for (md, heard) in [
            ("**2** items cost *100* G", "2 items cost 100 G"),
            (
                "## Steps\n- first\n* second\n1. third",
                " Steps\nfirst\nsecond\n1. third",
            ),
            ("Run `cargo test` now.", "Run cargo test now."),
            ("```rust\nfn main() {}\n```", "rust\nfn main() {}\n"),
            (
                "> quoted _word_ and snake_case",
                " quoted word and snake case",
            ),
            ("See [the docs](https://x.org/a).", "See the docs."),
            (
                "Go to https://www.example.com/a?b=1 today",
                "Go to example.com today",
            ),
            ("Read http://docs.rs/serde.", "Read docs.rs."),
            ("| a | b |", ", a , b ,"),
            ("~~old~~ new", "old new"),
            // A mark cut across two spans of a stream.
            ("**bo", "bo"),
            ("ld** end", "ld end"),
            (
                "hyphen-ated words and the http header",
                "hyphen-ated words and the http header",
            ),
        ] {
            assert_eq!(unmark(md), heard, "{md:?}");
        }
    }

    #[test]
    fn normalize_cleans_text() {
        assert_eq!(normalize("  a\t\tb \r\n\n c\u{200D}d  "), "a b\ncd");
        assert_eq!(normalize("[[h@l]]"), "[ [h@l] ]");
        assert_eq!(normalize("a\u{1}b"), "a b");
    }

    #[test]
    fn speakable_boundary_finds_clause_ends() {
        assert_eq!(speakable_boundary("Hello, world", 0), Some(6));
        assert_eq!(speakable_boundary("Hello, world. More", 10), Some(13));
        assert_eq!(speakable_boundary("Hello, world", 10), None);
        assert_eq!(speakable_boundary("Pi is 3.14 today", 0), None);
        assert_eq!(speakable_boundary("Wait... what", 0), Some(7));
        assert_eq!(speakable_boundary("Really?! Yes", 0), Some(8));
        assert_eq!(speakable_boundary("e.g. this is it", 0), None);
        assert_eq!(speakable_boundary("line one\nline two", 0), Some(9));
        assert_eq!(speakable_boundary("Done.", 0), Some(5));
        assert_eq!(speakable_boundary("... hi", 0), None);
        assert_eq!(speakable_boundary("Café, ok", 0), Some(6));
    }

    #[test]
    fn phonemizes_like_piper() {
        let p = ph();
        let s = p
            .phonemize("Hello, world. How are you? I am fine; thanks: really! End")
            .unwrap();
        assert_eq!(s.len(), 4, "{s:?}");
        assert!(s[0].ends_with("wˈɜːld."), "{s:?}");
        assert!(s[0].contains("ˈoʊ, w"), "{s:?}");
        assert_eq!(s[1], "hˈaʊ ɑːɹ juː?");
        assert!(s[2].contains("; θˈæŋks: ɹˈiəli!"), "{s:?}");
        assert_eq!(s[3], "ˈɛnd");
        // A clause without a stressed word stays unstressed, as in piper (the
        // CLI alone would say `ˈɔːɹ`).
        let s = p.phonemize("command, or, in the case").unwrap();
        assert!(s[0].contains(", ɔːɹ, "), "{s:?}");
    }

    #[test]
    fn edge_cases_do_not_fail() {
        let p = ph();
        assert!(p.phonemize("").unwrap().is_empty());
        assert!(p.phonemize("  \n\t ").unwrap().is_empty());
        assert!(p.phonemize("...!?,;:").unwrap().is_empty());
        let emoji = p.phonemize("🙂🎉").unwrap();
        assert!(emoji.len() <= 1, "{emoji:?}");
        let dash = p.phonemize("-rf --help").unwrap();
        assert_eq!(dash.len(), 1, "{dash:?}");
        // Phoneme input must not be reachable from text.
        let s = p.phonemize("[[h@l'oU]]").unwrap();
        assert!(!s.concat().contains("həl"), "{s:?}");
        let s = p.phonemize("Café naïve façade, Zürich.").unwrap();
        assert_eq!(s.len(), 1);
        assert!(s[0].ends_with('.'));
        let s = p.phonemize("Line one\nline two\n\nThree").unwrap();
        assert_eq!(s.len(), 3, "{s:?}");
    }

    #[test]
    fn long_text() {
        let p = ph();
        let sentence = "The quick brown fox jumps over the lazy dog again and again. ";
        let text = sentence.repeat(10_000 / sentence.len() + 1);
        assert!(text.len() >= 10_000);
        let s = p.phonemize(&text).unwrap();
        assert_eq!(s.len(), text.matches('.').count());
        // One long clause without punctuation, which espeak splits itself.
        let words = "alpha ".repeat(1700);
        let s = p.phonemize(&words).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].split(' ').count(), 1700);
    }

    #[test]
    fn timeout_kills_espeak() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("slow-espeak");
        std::fs::write(&script, "#!/bin/sh\nexec sleep 30\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let p = Phonemizer {
            voice: "en-us".into(),
            program: script,
            data_dir: None,
            timeout: Duration::from_millis(300),
        };
        let t = Instant::now();
        let e = p.phonemize("Hello.").unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(e.to_string().contains("timed out"), "{e}");
    }

    #[test]
    fn missing_program_is_a_clear_error() {
        let e =
            Phonemizer::with_program("en-us", "/nonexistent/espeak-ng".into(), None).unwrap_err();
        assert!(e.to_string().contains("install espeak-ng"), "{e}");
        let e = Phonemizer::new("-x").unwrap_err();
        assert!(e.to_string().contains("voice"), "{e}");
        let e = Phonemizer::new("no-such-voice").unwrap_err();
        assert!(e.to_string().contains("no-such-voice"), "{e}");
    }

    #[test]
    fn wall_time() {
        let p = ph();
        let one = "The quick brown fox jumps over the lazy dog.";
        let ten = [
            "The quick brown fox jumps over the lazy dog.",
            "How are you doing today?",
            "I am fine, thanks for asking!",
            "The weather is nice; the sun is shining.",
            "Let me tell you a story: it is short.",
            "Streaming speech needs low latency.",
            "Each sentence becomes one phoneme string.",
            "Piper turns phonemes into audio.",
            "Whisper turns audio back into text.",
            "That closes the loop.",
        ]
        .join(" ");
        for (name, text) in [("1 sentence", one.to_owned()), ("10 sentences", ten)] {
            p.phonemize(&text).unwrap();
            let n = 20;
            let t = Instant::now();
            for _ in 0..n {
                p.phonemize(&text).unwrap();
            }
            eprintln!("phonemize {name}: {:?} per call", t.elapsed() / n);
        }
    }
}
