//! Function calling: the tools a request offers the Thinker, how they reach
//! its prompt, and how its answer is split into words and tool calls.
//!
//! The format is Hermes' (Qwen2.5/Qwen3 and the templates modelled on them):
//! the tools as JSON inside `<tools></tools>` in the system turn, each call
//! as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the
//! answer, each result as `<tool_response>...</tool_response>` in a user
//! turn. A chat template that knows tools renders them itself; for one that
//! does not, [`template_messages`] writes the same text into the messages.
//!
//! [`ToolParser`] is fed the answer's text as it is generated and hands back
//! what may be shown and spoken, and each call once it is complete: a call is
//! never spoken, and text that might still become `<tool_call>` is held back
//! until it is known not to.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::request::{ChatMessage, Event, RequestCtx, Role};

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";
/// A result's tags, as the template writes results back. A small model
/// echoes them at the start of its answer; they are dropped from its words.
const RESULT_OPEN: &str = "<tool_response>";
const RESULT_CLOSE: &str = "</tool_response>";
/// What the parser looks for in words: a call's start, a result's tags.
const MARKERS: [&str; 3] = [CALL_OPEN, RESULT_OPEN, RESULT_CLOSE];
/// Prefix of the engine's error for a call it could not read (the server
/// maps it to the error code `invalid_tool_call`).
pub const INVALID_TOOL_CALL: &str = "invalid_tool_call";
/// Longest call the parser buffers: a model that never closes one is cut off.
const MAX_CALL_BYTES: usize = 64 * 1024;

/// One function call the model made, in the OpenAI Chat Completions shape
/// (which chat templates read: `tool_call.function.name`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON object, serialized.
    pub arguments: String,
}

impl ToolCall {
    pub fn new(name: impl Into<String>, arguments: impl Into<String>) -> Self {
        Self {
            id: format!("call_{:024x}", rand::random::<u128>() >> 32),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }

    /// As the answer's text writes it (Hermes).
    pub fn hermes(&self) -> String {
        // Name first, as the template writes it (a JSON map would sort it).
        let name = serde_json::to_string(&self.function.name).unwrap_or_default();
        let args = match serde_json::from_str::<Value>(&self.function.arguments) {
            Ok(v) => v.to_string(),
            Err(_) => serde_json::to_string(&self.function.arguments).unwrap_or_default(),
        };
        format!("{CALL_OPEN}\n{{\"name\": {name}, \"arguments\": {args}}}\n{CALL_CLOSE}")
    }
}

/// Whether and how the model must call a tool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToolChoice {
    /// The model decides.
    Auto,
    /// The model must call one of the tools: the answer starts with
    /// `<tool_call>` (written into the prompt, so it always does).
    Required,
    /// The model must call this function: the answer starts with the call's
    /// opening up to its arguments.
    Function(String),
}

/// The tools offered to one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// Each tool in the Chat Completions shape
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`
    /// (what chat templates render).
    pub functions: Vec<Value>,
    pub choice: ToolChoice,
}

impl Tools {
    /// The functions' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.functions
            .iter()
            .filter_map(|f| f.pointer("/function/name").and_then(Value::as_str))
    }

    /// What the answer is made to start with, if the choice forces a call.
    pub fn forced_prefix(&self) -> Option<String> {
        match &self.choice {
            ToolChoice::Auto => None,
            ToolChoice::Required => Some(format!("{CALL_OPEN}\n{{\"name\": \"")),
            ToolChoice::Function(name) => {
                let name = serde_json::to_string(name).unwrap_or_default();
                Some(format!("{CALL_OPEN}\n{{\"name\": {name}, \"arguments\": "))
            }
        }
    }

    /// The system prompt's tool section, as Qwen3's template writes it.
    pub fn hermes_system(&self) -> String {
        let mut s = String::from(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        for f in &self.functions {
            s.push('\n');
            s.push_str(&f.to_string());
        }
        s.push_str(
            "\n</tools>\n\nFor each function call, return a json object with function name and \
             arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        s
    }
}

/// The messages for a chat template that does not know tools: the tools in
/// the system turn, calls as `<tool_call>` text in the assistant's turns and
/// results as `<tool_response>` in user turns (consecutive results in one),
/// as Qwen3's template renders them.
pub fn template_messages(messages: &[ChatMessage], tools: Option<&Tools>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    if let Some(t) = tools {
        let block = t.hermes_system();
        match messages.first() {
            Some(m) if m.role == Role::System => {
                out.push(ChatMessage::system(format!("{}\n\n{block}", m.content)))
            }
            _ => out.push(ChatMessage::system(block)),
        }
    }
    let skip =
        usize::from(tools.is_some() && messages.first().is_some_and(|m| m.role == Role::System));
    let mut in_results = false;
    for m in &messages[skip..] {
        match m.role {
            Role::Tool => {
                let r = format!("<tool_response>\n{}\n</tool_response>", m.content);
                match out.last_mut().filter(|_| in_results) {
                    Some(last) => {
                        last.content.push('\n');
                        last.content.push_str(&r);
                    }
                    None => out.push(ChatMessage::user(r)),
                }
                in_results = true;
                continue;
            }
            Role::Assistant if !m.tool_calls.is_empty() => {
                let mut text = m.content.clone();
                for c in &m.tool_calls {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&c.hermes());
                }
                out.push(ChatMessage::assistant(text));
            }
            _ => out.push(ChatMessage::new(m.role, m.content.clone())),
        }
        in_results = false;
    }
    out
}

/// What the parser found in the answer's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// Words to show and speak.
    Text(String),
    Call(ToolCall),
}

/// A call the model wrote that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{INVALID_TOOL_CALL}: {0}")]
pub struct InvalidToolCall(pub String);

/// Splits an answer's text, as it is generated, into words and tool calls.
#[derive(Debug, Clone)]
pub struct ToolParser {
    names: Vec<String>,
    /// Text not yet handed back: a possible start of `<tool_call>`, or the
    /// body of an open call.
    pending: String,
    in_call: bool,
    /// Whitespace right after a call is not words.
    after_call: bool,
    /// Words followed a call: the answer is over (see [`Self::ended`]).
    ended: bool,
}

impl ToolParser {
    /// A parser for an answer to a request offering `tools`; the forced
    /// prefix, if any, is the answer's start.
    pub fn new(tools: &Tools) -> Self {
        let mut p = Self {
            names: tools.names().map(str::to_owned).collect(),
            pending: String::new(),
            in_call: false,
            after_call: false,
            ended: false,
        };
        if let Some(prefix) = tools.forced_prefix() {
            p.pending = prefix[CALL_OPEN.len()..].to_string();
            p.in_call = true;
        }
        p
    }

    /// Whether the parser is inside a call (nothing it is fed is spoken).
    pub fn in_call(&self) -> bool {
        self.in_call
    }

    /// Whether the answer is over: after its calls the model went on with
    /// words, which would be said before the calls' results exist (as
    /// OpenAI's models do, an answer that calls tools ends with its calls;
    /// Hermes models end there themselves, small ones may not).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Feeds the next piece of the answer.
    pub fn feed(&mut self, text: &str) -> Result<Vec<Parsed>, InvalidToolCall> {
        if self.ended {
            return Ok(Vec::new());
        }
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.call_end() else {
                    if self.pending.len() > MAX_CALL_BYTES {
                        return Err(InvalidToolCall(format!(
                            "a tool call longer than {MAX_CALL_BYTES} bytes"
                        )));
                    }
                    break;
                };
                let body: String = self.pending.drain(..end + CALL_CLOSE.len()).collect();
                out.push(Parsed::Call(self.call(&body[..end])?));
                self.in_call = false;
                self.after_call = true;
                continue;
            }
            if self.after_call {
                let trimmed = self.pending.trim_start().len();
                self.pending.drain(..self.pending.len() - trimmed);
                if self.pending.is_empty() || CALL_OPEN.starts_with(self.pending.as_str()) {
                    break; // maybe another call
                }
                if !self.pending.starts_with(CALL_OPEN) {
                    self.ended = true;
                    self.pending.clear();
                    break;
                }
                self.after_call = false;
            }
            let first = MARKERS
                .iter()
                .filter_map(|m| self.pending.find(m).map(|at| (at, *m)))
                .min();
            if let Some((start, marker)) = first {
                let words: String = self.pending.drain(..start).collect();
                self.pending.drain(..marker.len());
                push_text(&mut out, words);
                // A result's tags are the template's, never the model's to say.
                self.in_call = marker == CALL_OPEN;
                continue;
            }
            // Keep back a tail that may be the start of a marker.
            let keep = MARKERS
                .iter()
                .filter_map(|m| {
                    (1..m.len()).rev().find(|&n| {
                        self.pending.len() >= n
                            && self.pending.is_char_boundary(self.pending.len() - n)
                            && m.starts_with(&self.pending[self.pending.len() - n..])
                    })
                })
                .max()
                .unwrap_or(0);
            let words: String = self.pending.drain(..self.pending.len() - keep).collect();
            push_text(&mut out, words);
            break;
        }
        Ok(out)
    }

    /// Where the open call's closing tag is: the first `</tool_call>` after
    /// a whole JSON body. The tag inside one of the call's strings (a model
    /// may write it there) does not end the call.
    fn call_end(&self) -> Option<usize> {
        let mut from = 0;
        while let Some(at) = self.pending[from..].find(CALL_CLOSE) {
            let end = from + at;
            if serde_json::from_str::<serde::de::IgnoredAny>(self.pending[..end].trim()).is_ok() {
                return Some(end);
            }
            from = end + CALL_CLOSE.len();
        }
        None
    }

    /// The answer ended: what was held back is words, and a call left open
    /// is read as it stands (a model may end on it without the closing tag).
    pub fn finish(&mut self) -> Result<Vec<Parsed>, InvalidToolCall> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        if self.in_call {
            self.in_call = false;
            if !rest.trim().is_empty() {
                out.push(Parsed::Call(self.call(&rest)?));
            }
        } else if !self.after_call {
            push_text(&mut out, rest);
        }
        Ok(out)
    }

    fn call(&self, body: &str) -> Result<ToolCall, InvalidToolCall> {
        let shown = || {
            let b = body.trim();
            match b.char_indices().nth(200) {
                Some((i, _)) => format!("{}…", &b[..i]),
                None => b.to_string(),
            }
        };
        let v: Value = serde_json::from_str(body.trim()).map_err(|e| {
            InvalidToolCall(format!(
                "the model's tool call is not JSON ({e}): {}",
                shown()
            ))
        })?;
        let name = v.get("name").and_then(Value::as_str).ok_or_else(|| {
            InvalidToolCall(format!(
                "the model's tool call has no \"name\": {}",
                shown()
            ))
        })?;
        if !self.names.iter().any(|n| n == name) {
            return Err(InvalidToolCall(format!(
                "the model called {name:?}, which is not among the request's tools"
            )));
        }
        let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
            None | Some(Value::Null) => "{}".to_string(),
            // Some models write the arguments as a JSON string.
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(o @ Value::Object(_)) => o.to_string(),
                _ => {
                    return Err(InvalidToolCall(format!(
                        "the arguments of the model's call to {name:?} are not a JSON object"
                    )))
                }
            },
            Some(o @ Value::Object(_)) => o.to_string(),
            Some(_) => {
                return Err(InvalidToolCall(format!(
                    "the arguments of the model's call to {name:?} are not a JSON object"
                )))
            }
        };
        Ok(ToolCall::new(name, arguments))
    }
}

/// An answer's text on its way out of the Thinker: its words and calls sent
/// to the client in order ([`Event::TextDelta`], [`Event::ToolCall`]), the
/// words handed back to send on to the Talker. Without tools everything is
/// words.
#[derive(Debug, Default)]
pub struct AnswerWords {
    parser: Option<ToolParser>,
}

impl AnswerWords {
    pub fn new(tools: Option<&Tools>) -> Self {
        Self {
            parser: tools.map(ToolParser::new),
        }
    }

    /// Sends the next piece of the answer to the client; returns its words,
    /// and whether the piece was all words (no part of a call: a Talker that
    /// speaks tokens may take it).
    pub fn push(
        &mut self,
        ctx: &RequestCtx,
        text: String,
    ) -> Result<(String, bool), InvalidToolCall> {
        let Some(p) = &mut self.parser else {
            if !text.is_empty() {
                ctx.emit(Event::TextDelta(text.clone()));
            }
            return Ok((text, true));
        };
        let was_in_call = p.in_call();
        let parsed = p.feed(&text)?;
        let words = send(ctx, parsed);
        // Not held back, not dropped after a call, not part of one.
        let all_words = !was_in_call && !p.in_call() && words == text;
        Ok((words, all_words))
    }

    /// The answer is over before the model ended it ([`ToolParser::ended`]).
    pub fn ended(&self) -> bool {
        self.parser.as_ref().is_some_and(ToolParser::ended)
    }

    /// The answer ended: sends what was held back; returns its words.
    pub fn finish(&mut self, ctx: &RequestCtx) -> Result<String, InvalidToolCall> {
        match &mut self.parser {
            Some(p) => Ok(send(ctx, p.finish()?)),
            None => Ok(String::new()),
        }
    }
}

/// Sends `parsed` to the client in order; returns the words.
fn send(ctx: &RequestCtx, parsed: Vec<Parsed>) -> String {
    let mut words = String::new();
    for x in parsed {
        match x {
            Parsed::Text(t) => {
                words.push_str(&t);
                ctx.emit(Event::TextDelta(t));
            }
            Parsed::Call(c) => ctx.emit(Event::ToolCall(c)),
        }
    }
    words
}

fn push_text(out: &mut Vec<Parsed>, s: String) {
    if !s.is_empty() {
        out.push(Parsed::Text(s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather(choice: ToolChoice) -> Tools {
        Tools {
            functions: vec![json!({"type": "function", "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }})],
            choice,
        }
    }

    /// Feeds `text` in pieces of `n` characters, then ends.
    fn run(
        tools: &Tools,
        text: &str,
        n: usize,
    ) -> Result<(String, Vec<ToolCall>), InvalidToolCall> {
        let mut p = ToolParser::new(tools);
        let chars: Vec<char> = text.chars().collect();
        let mut parsed = Vec::new();
        for piece in chars.chunks(n) {
            parsed.extend(p.feed(&piece.iter().collect::<String>())?);
        }
        parsed.extend(p.finish()?);
        let mut words = String::new();
        let mut calls = Vec::new();
        for x in parsed {
            match x {
                Parsed::Text(t) => words.push_str(&t),
                Parsed::Call(c) => calls.push(c),
            }
        }
        Ok((words, calls))
    }

    #[test]
    fn qwen3_calls_are_split_from_words_in_any_pieces() {
        // As Qwen3 writes it: `<tool_call>` is one token, the JSON a few.
        let answer = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let tools = weather(ToolChoice::Auto);
        for n in [1, 2, 3, 7, 11, 1000] {
            let (words, calls) = run(&tools, answer, n).unwrap();
            assert_eq!(words, "Let me check.\n", "pieces of {n}");
            assert_eq!(calls.len(), 2);
            assert_eq!(calls[0].function.name, "get_weather");
            assert_eq!(calls[0].function.arguments, r#"{"city":"Paris"}"#);
            assert_eq!(calls[1].function.arguments, r#"{"city":"Rome"}"#);
            assert!(calls[0].id.starts_with("call_") && calls[0].id != calls[1].id);
        }
    }

    #[test]
    fn words_that_only_look_like_a_call_are_spoken() {
        let tools = weather(ToolChoice::Auto);
        let (words, calls) = run(&tools, "a <tool and <b> and <tool_ca", 1).unwrap();
        assert_eq!(words, "a <tool and <b> and <tool_ca");
        assert!(calls.is_empty());
        // Held back only while it may still be a call.
        let mut p = ToolParser::new(&tools);
        assert_eq!(
            p.feed("Hi <tool").unwrap(),
            vec![Parsed::Text("Hi ".into())]
        );
        assert_eq!(p.feed("s!").unwrap(), vec![Parsed::Text("<tools!".into())]);
    }

    #[test]
    fn result_tags_the_model_echoes_are_not_spoken() {
        let tools = weather(ToolChoice::Auto);
        for n in [1, 3, 1000] {
            let (words, calls) = run(
                &tools,
                "<tool_response>\nIt is sunny.</tool_response> <tool_resp",
                n,
            )
            .unwrap();
            assert_eq!(words, "\nIt is sunny. <tool_resp", "pieces of {n}");
            assert!(calls.is_empty());
        }
    }

    #[test]
    fn a_call_left_open_at_the_end_is_read_and_words_after_calls_end_the_answer() {
        let tools = weather(ToolChoice::Auto);
        let (words, calls) = run(
            &tools,
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}",
            4,
        )
        .unwrap();
        assert_eq!((words.as_str(), calls.len()), ("", 1));
        assert_eq!(calls[0].function.arguments, "{}");
        // Words after the calls end the answer (they would come before the
        // calls' results); more calls do not.
        let mut p = ToolParser::new(&tools);
        let call = "<tool_call>{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Oslo\\\"}\"}</tool_call>";
        let first = p.feed(call).unwrap();
        let Parsed::Call(c) = &first[0] else {
            panic!("{first:?}")
        };
        assert_eq!(c.function.arguments, r#"{"city":"Oslo"}"#);
        assert_eq!(p.feed("  \n <tool_").unwrap(), vec![]);
        assert!(!p.ended());
        assert!(matches!(p.feed(&call[6..]).unwrap()[..], [Parsed::Call(_)]));
        assert_eq!(p.feed(" \nThe weather is").unwrap(), vec![]);
        assert!(p.ended());
        assert_eq!(p.feed("<tool_call>").unwrap(), vec![]);
        assert_eq!(p.finish().unwrap(), vec![]);
    }

    #[test]
    fn the_closing_tag_inside_a_string_does_not_end_the_call() {
        let tools = weather(ToolChoice::Function("get_weather".into()));
        let (words, calls) = run(
            &tools,
            "{\"city\": \"NY}}</tool_call> and on\"}}\n</tool_call>",
            3,
        )
        .unwrap();
        assert_eq!(words, "");
        assert_eq!(
            calls[0].function.arguments,
            r#"{"city":"NY}}</tool_call> and on"}"#
        );
    }

    #[test]
    fn malformed_calls_are_clear_errors() {
        let tools = weather(ToolChoice::Auto);
        for (answer, says) in [
            (
                "<tool_call>{\"name\": \"get_weather\", </tool_call>",
                "not JSON",
            ),
            ("<tool_call>{\"arguments\": {}}</tool_call>", "no \"name\""),
            ("<tool_call>{\"name\": \"rm_rf\"}</tool_call>", "not among"),
            (
                "<tool_call>{\"name\": \"get_weather\", \"arguments\": [1]}</tool_call>",
                "not a JSON object",
            ),
            ("<tool_call>{\"name\": \"get_weather\"", "not JSON"),
        ] {
            let e = run(&tools, answer, 5).unwrap_err();
            assert!(e.to_string().starts_with(INVALID_TOOL_CALL), "{e}");
            assert!(e.0.contains(says), "{answer}: {e}");
        }
        let mut p = ToolParser::new(&tools);
        p.feed("<tool_call>").unwrap();
        let e = p.feed(&"x".repeat(MAX_CALL_BYTES + 1)).unwrap_err();
        assert!(e.0.contains("longer than"));
    }

    #[test]
    fn a_forced_choice_starts_the_answer_inside_the_call() {
        let tools = weather(ToolChoice::Function("get_weather".into()));
        let prefix = tools.forced_prefix().unwrap();
        assert!(prefix.starts_with(CALL_OPEN) && prefix.ends_with("\"arguments\": "));
        // The model's continuation after the prefix.
        let (words, calls) = run(&tools, "{\"city\": \"Lima\"}}\n</tool_call>", 2).unwrap();
        assert_eq!(
            (words.as_str(), calls[0].function.arguments.as_str()),
            ("", r#"{"city":"Lima"}"#)
        );
        let tools = weather(ToolChoice::Required);
        let (_, calls) = run(&tools, "get_weather\", \"arguments\": {}}</tool_call>", 2).unwrap();
        assert_eq!(calls[0].function.name, "get_weather");
    }

    #[test]
    fn template_messages_write_tools_calls_and_results_as_qwen3_does() {
        let tools = weather(ToolChoice::Auto);
        let mut call_turn = ChatMessage::assistant("");
        call_turn.tool_calls = vec![ToolCall::new("get_weather", r#"{"city":"Paris"}"#)];
        let result = |s: &str| ChatMessage {
            role: Role::Tool,
            tool_call_id: Some("call_1".into()),
            ..ChatMessage::new(Role::Tool, s)
        };
        let msgs = vec![
            ChatMessage::system("Be brief."),
            ChatMessage::user("Weather in Paris and Rome?"),
            call_turn,
            result("sunny"),
            result("rain"),
        ];
        let out = template_messages(&msgs, Some(&tools));
        assert_eq!(out.len(), 4);
        assert!(out[0].content.starts_with("Be brief.\n\n# Tools"));
        assert!(out[0].content.contains("\"name\":\"get_weather\""));
        assert_eq!(
            out[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert_eq!(out[3].role, Role::User);
        assert_eq!(
            out[3].content,
            "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        );
        // No tools: the history's calls and results are still written out.
        let out = template_messages(&msgs, None);
        assert_eq!(out.len(), 4);
        assert_eq!(out[0].content, "Be brief.");
    }
}
