//! The OpenAI HTTP requests, validated: `POST /v1/chat/completions` and
//! `POST /v1/audio/speech` bodies into the engine's request specs, and the
//! transcripts of earlier spoken answers that later turns may refer to.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use axum::extract::Request;
use axum::http::header;
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use omnistream_stages::engine::{
    ChatMessage, Modalities, RequestInput, RequestSpec, Role, SamplingOverrides, SpeechStyle,
    MAX_SPEECH_CHARS,
};

use crate::serve::audio::OutputFormat;
use crate::serve::connections::read_body;
use crate::serve::error::ApiError;
use crate::serve::tools;
use crate::serve::transport::unix_now;
use crate::serve::voice_store::{ClonedClip, CLONED_VOICE_PREFIX};
use crate::serve::voices::Voices;

/// Largest request body; more is a 413.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// How long an answer's audio id can be referred to in a later turn.
pub const AUDIO_TTL: Duration = Duration::from_secs(3600);
/// Answers whose transcript is kept for later turns (oldest dropped first).
const AUDIO_STORE_CAP: usize = 1024;
/// Output formats per endpoint (OpenAI's names).
const CHAT_FORMATS: &[&str] = &["pcm16", "wav", "mp3", "opus", "flac"];
const SPEECH_FORMATS: &[&str] = &["mp3", "wav", "pcm", "opus", "flac"];

/// `POST /v1/chat/completions`. Fields not listed are ignored, as OpenAI does.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    messages: Vec<InMessage>,
    #[serde(default)]
    modalities: Option<Vec<String>>,
    #[serde(default)]
    audio: Option<AudioParam>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    n: Option<i64>,
    /// vLLM's extension: generate exactly `max_tokens` (benchmarks' equal work).
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct InMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    /// An earlier answer's audio (`{"id": ...}`), for an assistant turn.
    #[serde(default)]
    audio: Option<AudioRef>,
    /// An assistant turn's function calls.
    #[serde(default)]
    tool_calls: Option<Vec<Value>>,
    /// A `tool` turn's call.
    #[serde(default)]
    tool_call_id: Option<String>,
}

#[derive(Debug, Deserialize)]
struct AudioRef {
    id: String,
}

#[derive(Debug, Deserialize)]
struct AudioParam {
    #[serde(default)]
    voice: Option<Value>,
    #[serde(default)]
    format: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// `POST /v1/audio/speech`.
#[derive(Debug, Deserialize)]
pub struct SpeechRequest {
    input: String,
    #[serde(default)]
    voice: Option<Value>,
    #[serde(default)]
    response_format: Option<String>,
    #[serde(default)]
    speed: Option<f64>,
    #[serde(default)]
    stream_format: Option<String>,
    /// How to speak (a Talker that takes instructions: Qwen3-TTS).
    #[serde(default)]
    instructions: Option<String>,
    /// The language to speak (a Talker that takes one: Qwen3-TTS); "auto" by default.
    #[serde(default)]
    language: Option<String>,
    /// A reference clip to clone the voice from (base64 WAV or Ogg Opus, or a
    /// `data:` URI), for a Talker that clones (Qwen3-TTS Base).
    #[serde(default)]
    ref_audio: Option<String>,
    /// The clip's words: in-context cloning, the speech continuing the clip's.
    #[serde(default)]
    ref_text: Option<String>,
    /// The most codec frames to speak (a Talker that speaks frame by frame:
    /// Qwen3-TTS, 12.5 a second). Piper makes a sentence at once and takes none.
    #[serde(default)]
    max_tokens: Option<u64>,
    /// Benchmarks (vLLM's extension, as on chat): speak exactly `max_tokens`
    /// frames, past the text's end, so that runs compare like for like.
    #[serde(default)]
    ignore_eos: Option<bool>,
}

impl SpeechRequest {
    /// The id of a cloned voice (`voice: "voice_…"` or `{"id": "voice_…"}`).
    pub fn cloned_voice_id(&self) -> Option<&str> {
        cloned_voice_id(self.voice.as_ref())
    }

    /// The request's own reference clip and its transcript (in-context
    /// cloning), checked against the other voice fields first.
    pub fn ref_audio(&self) -> Result<Option<(&str, Option<&str>)>, ApiError> {
        let transcript = self.ref_text.as_deref().filter(|t| !t.trim().is_empty());
        match (&self.ref_audio, self.cloned_voice_id()) {
            (Some(_), Some(_)) => Err(param(
                "ref_audio",
                invalid("give a cloned `voice` or a `ref_audio`, not both"),
            )),
            (Some(a), None) => Ok(Some((a.as_str(), transcript))),
            (None, _) if transcript.is_some() => Err(param(
                "ref_text",
                invalid("`ref_text` needs `ref_audio` (the clip it transcribes); a cloned voice keeps the words it was made with"),
            )),
            (None, _) => Ok(None),
        }
    }
}

/// The id of a cloned voice in a `voice` field (`"voice_…"` or `{"id": "voice_…"}`).
pub(crate) fn cloned_voice_id(voice: Option<&Value>) -> Option<&str> {
    let id = match voice {
        Some(Value::String(s)) => s.as_str(),
        Some(Value::Object(o)) => o.get("id").and_then(Value::as_str)?,
        _ => return None,
    };
    id.starts_with(CLONED_VOICE_PREFIX).then_some(id)
}

/// The longest `instructions` a speech request may give.
pub const MAX_INSTRUCTIONS_CHARS: usize = 4096;

/// A validated chat request.
#[derive(Debug)]
pub struct ChatPlan {
    pub spec: RequestSpec,
    pub audio: Option<OutputFormat>,
    pub stream: bool,
    pub include_usage: bool,
}

impl ChatPlan {
    pub fn from_request(
        mut r: ChatRequest,
        store: &AudioStore,
        voices: &Voices,
    ) -> Result<Self, ApiError> {
        if r.messages.is_empty() {
            return Err(invalid("`messages` must not be empty"));
        }
        // Speech in the last user message goes to a Thinker that hears it.
        let last = r.messages.len() - 1;
        let mut heard = None;
        for (i, m) in r.messages.iter_mut().enumerate() {
            if let Some(audio) = take_input_audio(i, m, i == last)? {
                heard = Some(audio);
            }
        }
        let messages = r
            .messages
            .iter()
            .enumerate()
            .filter(|(i, m)| !(heard.is_some() && *i == last && m.content.is_none()))
            .map(|(i, m)| to_chat_message(i, m, store))
            .collect::<Result<Vec<_>, _>>()?;
        let sampling = chat_sampling(&r)?;
        let tools = tools::parse(
            r.tools.as_ref(),
            r.tool_choice.as_ref(),
            &tools::Offer::auto(),
            tools::Shape::Chat,
            ("tools", "tool_choice"),
        )
        .map_err(|e| e.to_api())?
        .tools();
        let names = r.modalities.unwrap_or_else(|| vec!["text".into()]);
        let modalities =
            Modalities::from_names(&names).map_err(|e| invalid(format!("`modalities`: {e}")))?;
        let (audio, voice) = if modalities.audio {
            let a = r.audio.ok_or_else(|| {
                invalid("`audio` ({\"voice\", \"format\"}) is required when `modalities` includes \"audio\"",
                )
            })?;
            let name = a.format.as_deref().unwrap_or("pcm16");
            (
                Some(output_format(name, CHAT_FORMATS, "audio.format")?),
                check_voice(a.voice.as_ref(), voices)?,
            )
        } else {
            (None, None)
        };
        if r.n.is_some_and(|n| n != 1) {
            return Err(invalid("only `n` = 1 is supported"));
        }
        let stream = r.stream.unwrap_or(false);
        Ok(Self {
            spec: RequestSpec {
                input: match heard {
                    Some(audio) => RequestInput::Heard {
                        messages,
                        audio: audio.into(),
                    },
                    None => RequestInput::Chat { messages },
                },
                modalities,
                sampling,
                voice,
                tools,
                style: Default::default(),
            },
            audio,
            stream,
            include_usage: stream
                && r.stream_options
                    .and_then(|o| o.include_usage)
                    .unwrap_or(false),
        })
    }
}

/// `temperature`, `top_p`, `max_(completion_)tokens`, `seed`, checked against
/// OpenAI's ranges.
fn chat_sampling(r: &ChatRequest) -> Result<SamplingOverrides, ApiError> {
    let mut s = SamplingOverrides::default();
    if let Some(t) = r.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(invalid(format!(
                "`temperature` must be between 0 and 2, got {t}"
            )));
        }
        s.temperature = Some(t);
    }
    if let Some(p) = r.top_p {
        if !(0.0..=1.0).contains(&p) {
            return Err(invalid(format!("`top_p` must be between 0 and 1, got {p}")));
        }
        if p == 0.0 {
            // The smallest nucleus is the most likely token: greedy.
            s.temperature = Some(0.0);
        } else {
            s.top_p = Some(p);
        }
    }
    let (field, max) = match (r.max_completion_tokens, r.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    if let Some(m) = max {
        if m < 1 {
            return Err(invalid(format!("`{field}` must be at least 1, got {m}")));
        }
        s.max_tokens = Some(usize::try_from(m).unwrap_or(usize::MAX));
    }
    // OpenAI's seed is any 64-bit integer; the bits are the seed.
    s.seed = r.seed.map(|v| v as u64);
    if r.ignore_eos == Some(true) {
        if max.is_none() {
            return Err(invalid(
                "`ignore_eos` needs `max_tokens` (or `max_completion_tokens`): the answer would never end",
            ));
        }
        s.ignore_eos = true;
    }
    Ok(s)
}

fn to_chat_message(i: usize, m: &InMessage, store: &AudioStore) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => {
            let id = m.tool_call_id.as_deref().filter(|id| !id.is_empty());
            let id = id.ok_or_else(|| {
                invalid(format!("messages[{i}]: a tool message needs `tool_call_id`"))
            })?;
            let content = match &m.content {
                Some(c) if !c.is_null() => content_text(i, c)?,
                _ => return Err(invalid(format!("messages[{i}]: `content` is required"))),
            };
            return Ok(ChatMessage::tool(id, content));
        }
        other => {
            return Err(invalid(format!(
            "messages[{i}]: invalid role {other:?}; expected system, developer, user, assistant or tool"
        )))
        }
    };
    let calls = match (&m.tool_calls, role) {
        (Some(calls), Role::Assistant) => calls
            .iter()
            .map(|c| {
                let f = c.get("function");
                tools::client_call(
                    c.get("id").and_then(Value::as_str),
                    f.and_then(|f| f.get("name")).and_then(Value::as_str),
                    f.and_then(|f| f.get("arguments")),
                    "messages",
                )
                .map_err(|e| invalid(format!("messages[{i}].tool_calls: {}", e.message)))
            })
            .collect::<Result<Vec<_>, _>>()?,
        (Some(_), _) => {
            return Err(invalid(format!(
                "messages[{i}]: only an assistant message has `tool_calls`"
            )))
        }
        (None, _) => Vec::new(),
    };
    if !calls.is_empty() && m.content.as_ref().is_none_or(Value::is_null) {
        let mut msg = ChatMessage::assistant("");
        msg.tool_calls = calls;
        return Ok(msg);
    }
    let content = match (&m.content, &m.audio) {
        (Some(c), _) if !c.is_null() => content_text(i, c)?,
        (_, Some(a)) if role == Role::Assistant => store.get(&a.id).ok_or_else(|| {
            invalid(format!(
                "messages[{i}]: audio {:?} is unknown or expired",
                a.id
            ))
        })?,
        _ => return Err(invalid(format!("messages[{i}]: `content` is required"))),
    };
    let mut msg = ChatMessage::new(role, content);
    msg.tool_calls = calls;
    Ok(msg)
}

/// Takes the `{"type": "input_audio", "input_audio": {"data", "format"}}` parts
/// out of a message (WAV or Ogg Opus, base64), as 16 kHz mono; only the last
/// message, a user's, may carry speech. A message left without parts has its
/// `content` removed.
fn take_input_audio(i: usize, m: &mut InMessage, last: bool) -> Result<Option<Vec<f32>>, ApiError> {
    let Some(Value::Array(parts)) = &mut m.content else {
        return Ok(None);
    };
    let is_audio = |p: &Value| p.get("type").and_then(Value::as_str) == Some("input_audio");
    let Some(j) = parts.iter().position(is_audio) else {
        return Ok(None);
    };
    if !last || m.role != "user" {
        return Err(invalid(format!(
            "messages[{i}].content[{j}]: only the last message, a user's, may carry audio"
        )));
    }
    if parts.iter().filter(|p| is_audio(p)).count() > 1 {
        return Err(invalid(format!(
            "messages[{i}]: one input_audio part per message"
        )));
    }
    let part = parts.remove(j);
    let a = part.get("input_audio");
    let data = a
        .and_then(|a| a.get("data"))
        .and_then(Value::as_str)
        .ok_or_else(|| {
            invalid(format!(
                "messages[{i}].content[{j}]: input_audio needs `data` (base64)"
            ))
        })?;
    let format = a
        .and_then(|a| a.get("format"))
        .and_then(Value::as_str)
        .unwrap_or("wav");
    if !matches!(format, "wav" | "opus" | "ogg") {
        return Err(invalid(format!(
            "messages[{i}].content[{j}]: input_audio format {format:?} is not supported (wav, opus)"
        )));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| {
            invalid(format!(
                "messages[{i}].content[{j}]: input_audio data is not base64: {e}"
            ))
        })?;
    let (samples, rate) = super::transcriptions::decode_upload(&bytes)?;
    if samples.is_empty() {
        return Err(invalid(format!(
            "messages[{i}].content[{j}]: the audio is empty"
        )));
    }
    let audio = crate::serve::audio::resample(&samples, rate)
        .map_err(|e| ApiError::bad_request(e.code, e.message))?;
    if parts.is_empty() {
        m.content = None;
    }
    Ok(Some(audio))
}

/// A message's text: a string, or an array of `{"type": "text", "text"}` parts.
fn content_text(i: usize, c: &Value) -> Result<String, ApiError> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("text" | "input_text", Some(t)) => texts.push(t),
                    ("text" | "input_text", None) => {
                        return Err(invalid(format!("messages[{i}].content[{j}]: a text part needs `text`"),
                        ))
                    }
                    _ => {
                        return Err(invalid(format!(
                                "messages[{i}].content[{j}]: content part type {kind:?} is not supported (only \"text\")"
                            ),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(invalid(format!(
            "messages[{i}].content must be a string or an array of text parts"
        ))),
    }
}

/// A validated speech request.
#[derive(Debug)]
pub struct SpeechPlan {
    pub spec: RequestSpec,
    pub format: OutputFormat,
    pub sse: bool,
}

impl SpeechPlan {
    /// `languages`: what the pipeline's Talker takes (none: it takes no
    /// language and no instructions).
    /// `cloned`: the request's cloned voice (looked up or computed by the
    /// caller), which then stands for `voice`.
    pub fn from_request(
        r: SpeechRequest,
        voices: &Voices,
        languages: &[String],
        cloned: Option<ClonedClip>,
    ) -> Result<Self, ApiError> {
        if r.input.trim().is_empty() {
            return Err(param("input", invalid("`input` must not be empty")));
        }
        // The rule: speech needs a letter or a digit; punctuation and markup
        // alone would be an empty recording.
        if !r.input.chars().any(char::is_alphanumeric) {
            return Err(param(
                "input",
                ApiError::bad_request(
                    "nothing_to_say",
                    "`input` has no letters or digits: there is nothing to say",
                ),
            ));
        }
        let n = r.input.chars().count();
        if n > MAX_SPEECH_CHARS {
            return Err(param(
                "input",
                invalid(format!(
                    "`input` is {n} characters; the limit is {MAX_SPEECH_CHARS}"
                )),
            ));
        }
        let voice = match cloned {
            Some(_) => None,
            None => check_voice(r.voice.as_ref(), voices).map_err(|e| param("voice", e))?,
        };
        if cloned.is_none() && voice.is_none() && voices.is_empty() {
            return Err(param(
                "voice",
                ApiError::bad_request("no_voice", crate::serve::voices::NO_PRESET_VOICES),
            ));
        }
        let format = output_format(
            // OpenAI's default.
            r.response_format.as_deref().unwrap_or("mp3"),
            SPEECH_FORMATS,
            "response_format",
        )
        .map_err(|e| param("response_format", e))?;
        let speed = match r.speed {
            Some(s) if !(0.25..=4.0).contains(&s) => {
                return Err(param(
                    "speed",
                    invalid(format!("`speed` must be between 0.25 and 4.0, got {s}")),
                ))
            }
            // Qwen3-TTS (the Talker that takes languages) has no pace control.
            Some(s) if s != 1.0 && !languages.is_empty() => {
                return Err(param(
                    "speed",
                    invalid(format!(
                        "this server's voice speaks at its own pace: `speed` must be 1.0, got {s}"
                    )),
                ))
            }
            s => s.map(|s| s as f32),
        };
        let sse = match r.stream_format.as_deref() {
            None | Some("audio") => false,
            Some("sse") => true,
            Some(other) => {
                return Err(param(
                    "stream_format",
                    invalid(format!(
                        "unsupported `stream_format` {other:?}; expected \"audio\" or \"sse\""
                    )),
                ))
            }
        };
        let mut style = speech_style(r.instructions, r.language, languages)?;
        if let Some(c) = cloned {
            style.speaker_embedding = Some(c.embedding);
            style.reference = c.reference;
        }
        let mut spec = crate::run::speech_spec(&r.input, voice, speed);
        spec.style = style;
        speech_length(&mut spec.sampling, r.max_tokens, r.ignore_eos, languages)?;
        Ok(Self { spec, format, sse })
    }
}

/// `max_tokens` and `ignore_eos` on `/v1/audio/speech`: frames of a Talker that
/// speaks frame by frame (the one that takes languages: Qwen3-TTS).
fn speech_length(
    s: &mut SamplingOverrides,
    max_tokens: Option<u64>,
    ignore_eos: Option<bool>,
    languages: &[String],
) -> Result<(), ApiError> {
    if max_tokens.is_some() && languages.is_empty() {
        return Err(param(
            "max_tokens",
            invalid("this server's voice speaks a sentence at once: it takes no `max_tokens`"),
        ));
    }
    if let Some(m) = max_tokens {
        if m < 1 {
            return Err(param(
                "max_tokens",
                invalid(format!("`max_tokens` must be at least 1, got {m}")),
            ));
        }
        s.max_tokens = Some(usize::try_from(m).unwrap_or(usize::MAX));
    }
    if ignore_eos == Some(true) {
        if max_tokens.is_none() {
            return Err(param(
                "ignore_eos",
                invalid("`ignore_eos` needs `max_tokens`: the speech would never end"),
            ));
        }
        s.ignore_eos = true;
    }
    Ok(())
}

/// A speech session's `voice`, `instructions` and `language` (the speech
/// stream's `session.update`), checked as `/v1/audio/speech` checks them.
pub(crate) fn speech_session(
    voice: Option<&Value>,
    instructions: Option<String>,
    language: Option<String>,
    voices: &Voices,
    languages: &[String],
) -> Result<(Option<String>, SpeechStyle), ApiError> {
    let voice = check_voice(voice, voices).map_err(|e| param("voice", e))?;
    Ok((voice, speech_style(instructions, language, languages)?))
}

/// `e`, naming the request parameter it is about.
fn param(p: &'static str, e: ApiError) -> ApiError {
    ApiError {
        param: Some(p),
        ..e
    }
}

/// `instructions` and `language`, checked against what the Talker takes.
fn speech_style(
    instructions: Option<String>,
    language: Option<String>,
    languages: &[String],
) -> Result<SpeechStyle, ApiError> {
    let param = |p: &'static str, msg: String| param(p, invalid(msg));
    // OpenAI's field: a Talker that takes none (Piper) ignores it, as OpenAI's
    // tts-1 does (the Agents SDK sends it to every voice).
    let instructions = instructions.filter(|i| !i.trim().is_empty() && !languages.is_empty());
    if let Some(i) = &instructions {
        let n = i.chars().count();
        if n > MAX_INSTRUCTIONS_CHARS {
            return Err(param(
                "instructions",
                format!("`instructions` is {n} characters; the limit is {MAX_INSTRUCTIONS_CHARS}"),
            ));
        }
    }
    let language = match language {
        None => None,
        Some(l) => {
            let known = languages.iter().find(|k| k.eq_ignore_ascii_case(l.trim()));
            match (known, languages.is_empty()) {
                (Some(k), _) => Some(k.clone()),
                (None, true) => {
                    return Err(param(
                        "language",
                        "this server's voice takes no `language`".into(),
                    ))
                }
                (None, false) => {
                    return Err(param(
                        "language",
                        format!(
                            "unknown `language` {l:?}; available: {}",
                            languages.join(", ")
                        ),
                    ))
                }
            }
        }
    };
    Ok(SpeechStyle {
        instructions,
        language,
        ..SpeechStyle::default()
    })
}

/// One of the pipeline's voices or an alias, by name or as `{"id": ...}`, or
/// a cloned voice's id (the caller's voice store has it: `speak_cloned`, as
/// the request is started); none = the default.
fn check_voice(v: Option<&Value>, voices: &Voices) -> Result<Option<String>, ApiError> {
    let name = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s.as_str(),
        Some(Value::Object(o)) => o.get("id").and_then(Value::as_str).unwrap_or(""),
        Some(other) => return Err(invalid(format!("`voice` must be a string, got {other}"))),
    };
    if name.starts_with(CLONED_VOICE_PREFIX) {
        return Ok(Some(name.to_string()));
    }
    voices.resolve(name).map(Some).map_err(invalid)
}

fn output_format(name: &str, allowed: &[&str], field: &str) -> Result<OutputFormat, ApiError> {
    let unsupported = || {
        invalid(format!(
            "unsupported `{field}` {name:?}; supported: {}",
            allowed.join(", ")
        ))
    };
    if !allowed.contains(&name) {
        return Err(unsupported());
    }
    OutputFormat::from_name(name).map_err(invalid)
}

/// Reads the body (413 past the limit) and parses it (400 with serde's reason).
pub async fn read_json<T: DeserializeOwned>(req: Request) -> Result<T, ApiError> {
    // JSON or nothing said: a text/plain or form body is what a page elsewhere
    // can send without asking first (a CORS "simple request").
    let ctype = req
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("?").to_ascii_lowercase());
    if let Some(t) = ctype {
        let essence = t.split(';').next().unwrap_or("").trim();
        if essence != "application/json" && !essence.ends_with("+json") {
            return Err(ApiError::unsupported_media_type(format!(
                "Content-Type {essence:?}: send application/json"
            )));
        }
    }
    let bytes = read_body(req, MAX_BODY_BYTES).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("invalid request body: {e}")))
}

pub fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::bad_request("invalid_value", message)
}

pub fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(e.to_string())
}

// ---------------------------------------------------------------- audio ids

/// Transcripts of recent spoken answers by audio id, so that a later turn can
/// send `{"role": "assistant", "audio": {"id": ...}}` as OpenAI allows.
#[derive(Default)]
pub struct AudioStore {
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    by_id: HashMap<String, (String, u64)>,
    order: VecDeque<String>,
}

impl AudioStore {
    pub fn put(&self, id: &str, transcript: &str, expires_at: u64) {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while s.order.len() >= AUDIO_STORE_CAP {
            if let Some(old) = s.order.pop_front() {
                s.by_id.remove(&old);
            }
        }
        s.order.push_back(id.to_string());
        s.by_id
            .insert(id.to_string(), (transcript.to_string(), expires_at));
    }

    fn get(&self, id: &str) -> Option<String> {
        let s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        s.by_id
            .get(id)
            .filter(|(_, exp)| *exp > unix_now())
            .map(|(t, _)| t.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use omnistream_stages::roles::PIPER_VOICE_NAME;
    use serde_json::json;

    fn chat_req(v: Value) -> Result<ChatPlan, ApiError> {
        let r: ChatRequest = serde_json::from_value(v).map_err(|e| invalid(e.to_string()))?;
        ChatPlan::from_request(r, &AudioStore::default(), &voices())
    }

    fn voices() -> Voices {
        Voices::new(vec![PIPER_VOICE_NAME.to_string()], &Default::default()).unwrap()
    }

    fn msgs() -> Value {
        json!([{"role": "user", "content": "hi"}])
    }

    #[test]
    fn chat_requests_are_validated() {
        let ok = chat_req(json!({"model": "x", "messages": msgs(), "unknown_field": 1})).unwrap();
        assert!(!ok.spec.modalities.audio && !ok.stream);
        for bad in [
            json!({"messages": []}),
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            json!({"messages": [{"role": "user"}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            json!({"messages": msgs(), "temperature": 2.5}),
            json!({"messages": msgs(), "top_p": 1.5}),
            json!({"messages": msgs(), "max_tokens": -1}),
            json!({"messages": msgs(), "max_completion_tokens": 0}),
            json!({"messages": msgs(), "n": 2}),
            json!({"messages": msgs(), "modalities": ["text", "video"]}),
            json!({"messages": msgs(), "modalities": ["text", "audio"]}),
            json!({"messages": msgs(), "modalities": ["text", "audio"], "audio": {"voice": "joe", "format": "aac"}}),
            json!({"messages": msgs(), "modalities": ["text", "audio"], "audio": {"voice": "bob", "format": "wav"}}),
        ] {
            let e = chat_req(bad.clone()).expect_err(&bad.to_string());
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        }
        let e = chat_req(json!({"messages": msgs(), "modalities": ["audio"], "audio": {"voice": "bob", "format": "wav"}}))
            .unwrap_err();
        assert!(
            e.message.contains("joe") && e.message.contains("alloy"),
            "{}",
            e.message
        );
        // OpenAI's names speak in the pipeline's voice.
        let p = chat_req(json!({"messages": msgs(), "modalities": ["audio"], "audio": {"voice": "Alloy", "format": "wav"}}))
            .unwrap();
        assert_eq!(p.spec.voice.as_deref(), Some(PIPER_VOICE_NAME));
    }

    #[test]
    fn chat_fields_reach_the_spec() {
        let p = chat_req(json!({
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"},
                {"role": "user", "content": "d"},
            ],
            "modalities": ["text", "audio"],
            "audio": {"voice": {"id": "joe"}, "format": "opus"},
            "stream": true,
            "stream_options": {"include_usage": true},
            "temperature": 0.5, "top_p": 0.9, "max_tokens": 99, "max_completion_tokens": 7, "seed": -1,
        }))
        .unwrap();
        let RequestInput::Chat { messages } = &p.spec.input else {
            panic!("not a chat")
        };
        let got: Vec<_> = messages
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("system", "Be brief."),
                ("user", "a\nb"),
                ("assistant", "c"),
                ("user", "d")
            ]
        );
        assert!(p.spec.modalities.audio && p.stream && p.include_usage);
        assert_eq!(p.spec.voice.as_deref(), Some("joe"));
        assert_eq!(p.spec.sampling.max_tokens, Some(7));
        assert_eq!(p.spec.sampling.temperature, Some(0.5));
        assert_eq!(p.spec.sampling.top_p, Some(0.9));
        assert_eq!(p.spec.sampling.seed, Some(u64::MAX));
    }

    #[test]
    fn earlier_audio_answers_stand_in_for_their_transcript() {
        let store = AudioStore::default();
        store.put("audio_1", "Paris.", unix_now() + 60);
        store.put("audio_old", "gone", unix_now().saturating_sub(1));
        let m = |id: &str| InMessage {
            role: "assistant".into(),
            content: None,
            audio: Some(AudioRef { id: id.into() }),
            tool_calls: None,
            tool_call_id: None,
        };
        assert_eq!(
            to_chat_message(0, &m("audio_1"), &store).unwrap().content,
            "Paris."
        );
        assert!(to_chat_message(0, &m("audio_old"), &store).is_err());
        assert!(to_chat_message(0, &m("audio_nope"), &store).is_err());
    }

    #[test]
    fn speech_requests_are_validated() {
        let plan = |v: Value| {
            let r: SpeechRequest = serde_json::from_value(v).map_err(|e| invalid(e.to_string()))?;
            SpeechPlan::from_request(r, &voices(), &[], None)
        };
        let p = plan(json!({"model": "tts-1", "input": "Hello.", "voice": "joe", "speed": 1.5, "stream_format": "sse"})).unwrap();
        assert!(p.sse);
        assert_eq!(p.spec.sampling.speed, Some(1.5));
        assert!(plan(json!({"input": "Hello."})).is_ok());
        for bad in [
            json!({"input": ""}),
            json!({"input": "x".repeat(MAX_SPEECH_CHARS + 1)}),
            json!({"input": "Hi", "voice": "bob"}),
            json!({"input": "Hi", "response_format": "aac"}),
            json!({"input": "Hi", "response_format": "pcm16"}),
            json!({"input": "Hi", "speed": 4.5}),
            json!({"input": "Hi", "speed": 0.1}),
            json!({"input": "Hi", "stream_format": "ws"}),
            json!({"voice": "joe"}),
        ] {
            assert!(plan(bad.clone()).is_err(), "{bad}");
        }
    }
}
