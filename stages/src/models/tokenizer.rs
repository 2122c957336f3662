//! Chat tokenizers: byte-level BPE + chat template, from a GGUF file's metadata
//! or from a Hugging Face checkpoint's `tokenizer.json` / `tokenizer_config.json`.
//!
//! `tokenizer.ggml.model == "gpt2"` files carry a byte-level BPE (`tokenizer.ggml.tokens`,
//! `tokenizer.ggml.merges`) and name their pre-tokenizer regex in `tokenizer.ggml.pre`; we rebuild
//! the equivalent `tokenizers::Tokenizer` (what the original `tokenizer.json` would have been).
//! Control / user-defined tokens (`token_type` 3 / 4) become added tokens, so `"<|im_start|>"` in
//! text encodes as one id. `tokenizer.chat_template` is rendered with minijinja the way
//! transformers renders it (trim_blocks, lstrip_blocks, python string methods, `raise_exception`).

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::{ModelError, Result};

use crate::engine::constrain::{CallConstraint, GrammarFactory};
use crate::engine::tools::{self, Tools};
use crate::engine::{ChatMessage, Role};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The tokenizer of a GGUF model. Immutable after loading; `Send + Sync`.
pub struct ChatTokenizer {
    tokenizer: Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos: Option<u32>,
    eos_ids: Vec<u32>,
    vocab_size: usize,
    /// The grammar engine for forced tool calls, built at the first one
    /// (its token trie takes a moment); an error if this tokenizer has none.
    grammar: std::sync::OnceLock<std::result::Result<GrammarFactory, String>>,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("eos_ids", &self.eos_ids)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn format_err(path: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::Format {
        path: PathBuf::from(path),
        msg: msg.into(),
    }
}

fn md<'a>(content: &'a gguf_file::Content, key: &str) -> Option<&'a gguf_file::Value> {
    content.metadata.get(key)
}

fn md_u32(content: &gguf_file::Content, key: &str) -> Option<u32> {
    md(content, key).and_then(|v| match v {
        gguf_file::Value::U8(x) => Some(*x as u32),
        gguf_file::Value::U16(x) => Some(*x as u32),
        gguf_file::Value::U32(x) => Some(*x),
        gguf_file::Value::U64(x) => u32::try_from(*x).ok(),
        gguf_file::Value::I8(x) => u32::try_from(*x).ok(),
        gguf_file::Value::I16(x) => u32::try_from(*x).ok(),
        gguf_file::Value::I32(x) => u32::try_from(*x).ok(),
        gguf_file::Value::I64(x) => u32::try_from(*x).ok(),
        _ => None,
    })
}

fn md_i64(v: &gguf_file::Value) -> Option<i64> {
    match v {
        gguf_file::Value::U8(x) => Some(*x as i64),
        gguf_file::Value::U16(x) => Some(*x as i64),
        gguf_file::Value::U32(x) => Some(*x as i64),
        gguf_file::Value::U64(x) => i64::try_from(*x).ok(),
        gguf_file::Value::I8(x) => Some(*x as i64),
        gguf_file::Value::I16(x) => Some(*x as i64),
        gguf_file::Value::I32(x) => Some(*x as i64),
        gguf_file::Value::I64(x) => Some(*x),
        _ => None,
    }
}

fn md_bool(content: &gguf_file::Content, key: &str) -> Option<bool> {
    md(content, key).and_then(|v| v.to_bool().ok())
}

fn md_strings(content: &gguf_file::Content, path: &Path, key: &str) -> Result<Vec<String>> {
    let v = md(content, key).ok_or_else(|| format_err(path, format!("missing {key}")))?;
    let arr = v
        .to_vec()
        .map_err(|_| format_err(path, format!("{key} is not an array")))?;
    arr.iter()
        .map(|x| {
            x.to_string()
                .cloned()
                .map_err(|_| format_err(path, format!("{key} holds a non-string")))
        })
        .collect()
}

const LLAMA3_PRE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PRE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The HF pre-tokenizer equivalent to llama.cpp's `tokenizer.ggml.pre` name.
fn pre_tokenizer_for(pre: &str, path: &Path) -> Result<PreTokenizerWrapper> {
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        let s = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(s.into())
    };
    Ok(match pre {
        // Sequence[Digits(individual_digits), ByteLevel(add_prefix_space=false, use_regex=true)]
        "smollm" | "starcoder" | "refact" => {
            Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into()
        }
        "gpt2" | "default" | "gpt-2" => byte_level(true).into(),
        "llama3" | "llama-bpe" | "llama-v3" => {
            Sequence::new(vec![split(LLAMA3_PRE)?, byte_level(false).into()]).into()
        }
        "qwen2" => Sequence::new(vec![split(QWEN2_PRE)?, byte_level(false).into()]).into(),
        other => {
            return Err(format_err(
                path,
                format!("unsupported tokenizer.ggml.pre {other:?}"),
            ))
        }
    })
}

/// A special token in `tokenizer_config.json`: a string or an AddedToken object.
fn hf_token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| format_err(path, e.to_string()))
}

impl ChatTokenizer {
    /// Loads a Hugging Face checkpoint's tokenizer: `tokenizer.json` (the
    /// `tokenizers` format), special tokens from `tokenizer_config.json`, the chat
    /// template from `chat_template.jinja`, `chat_template.json` or
    /// `tokenizer_config.json` (newest convention first, as transformers does),
    /// and end-of-turn ids from `generation_config.json`.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let vocab_size = tokenizer.get_vocab_size(true);
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.exists() {
            Some(
                std::fs::read_to_string(&jinja).map_err(|source| ModelError::Io {
                    path: jinja.clone(),
                    source,
                })?,
            )
        } else {
            read_json(&dir.join("chat_template.json"))?
                .as_ref()
                .or(Some(&config))
                .and_then(|c| c.get("chat_template"))
                .and_then(|t| t.as_str())
                .map(str::to_string)
        };
        let bos_token = hf_token_text(config.get("bos_token"));
        let eos_token = hf_token_text(config.get("eos_token"));
        let mut eos_ids: Vec<u32> = Vec::new();
        let mut add_eos = |id: u32| {
            if (id as usize) < vocab_size && !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        };
        if let Some(id) = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
            add_eos(id);
        }
        let generation = read_json(&dir.join("generation_config.json"))?.unwrap_or_default();
        match generation.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => {
                if let Some(id) = n.as_u64().and_then(|i| u32::try_from(i).ok()) {
                    add_eos(id)
                }
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().and_then(|i| u32::try_from(i).ok()))
                .for_each(&mut add_eos),
            _ => {}
        }
        for name in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = tokenizer.token_to_id(name) {
                add_eos(id);
            }
        }
        if eos_ids.is_empty() {
            return Err(format_err(&tok_path, "no end-of-sequence token"));
        }
        // Qwen's tokenizers add no BOS; honour the flag where a config sets it.
        let add_bos = if config.get("add_bos_token").and_then(|b| b.as_bool()) == Some(true) {
            bos_token.as_deref().and_then(|t| tokenizer.token_to_id(t))
        } else {
            None
        };
        Ok(Self {
            tokenizer,
            chat_template,
            bos_token,
            eos_token,
            add_bos,
            eos_ids,
            vocab_size,
            grammar: Default::default(),
        })
    }

    /// Builds the tokenizer from the GGUF metadata (`path` is only used in error messages).
    pub fn from_gguf(content: &gguf_file::Content, path: &Path) -> Result<Self> {
        let model = md(content, "tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| format_err(path, "missing tokenizer.ggml.model"))?;
        if model != "gpt2" {
            return Err(format_err(
                path,
                format!(
                    "unsupported tokenizer.ggml.model {model:?} (only byte-level BPE \"gpt2\")"
                ),
            ));
        }
        let tokens = md_strings(content, path, "tokenizer.ggml.tokens")?;
        let merges_raw = md_strings(content, path, "tokenizer.ggml.merges")?;
        let types: Vec<i64> = match md(content, "tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .map_err(|_| format_err(path, "tokenizer.ggml.token_type is not an array"))?
                .iter()
                .map(|x| md_i64(x).unwrap_or(1))
                .collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(format_err(
                path,
                "tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length",
            ));
        }
        let vocab_size = tokens.len();
        if vocab_size == 0 || u32::try_from(vocab_size).is_err() {
            return Err(format_err(path, "bad vocabulary size"));
        }

        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut merges = Vec::with_capacity(merges_raw.len());
        for m in &merges_raw {
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| format_err(path, format!("bad merge {m:?}")))?;
            merges.push((a.to_string(), b.to_string()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut tokenizer = Tokenizer::new(bpe);
        let pre = md(content, "tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .map(|s| s.as_str())
            .unwrap_or("default");
        tokenizer.with_pre_tokenizer(Some(pre_tokenizer_for(pre, path)?));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &ty)| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
            .map(|(t, &ty)| AddedToken::from(t.clone(), ty == TOKEN_TYPE_CONTROL).normalized(false))
            .collect();
        tokenizer.add_special_tokens(&added);

        let id_ok = |id: u32| (id as usize) < vocab_size;
        let bos_id = md_u32(content, "tokenizer.ggml.bos_token_id").filter(|&i| id_ok(i));
        let eos_id = md_u32(content, "tokenizer.ggml.eos_token_id").filter(|&i| id_ok(i));
        let eot_id = md_u32(content, "tokenizer.ggml.eot_token_id").filter(|&i| id_ok(i));
        let mut eos_ids: Vec<u32> = Vec::new();
        for id in [eos_id, eot_id].into_iter().flatten() {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        // Chat-style end-of-turn / end-of-text control tokens also end generation.
        for name in [
            "<|im_end|>",
            "<|endoftext|>",
            "<|eot_id|>",
            "<|end_of_text|>",
            "<end_of_turn>",
        ] {
            if let Some(i) = tokens.iter().position(|t| t == name) {
                let id = i as u32;
                if types[i] == TOKEN_TYPE_CONTROL && !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        if eos_ids.is_empty() {
            return Err(format_err(
                path,
                "no end-of-sequence token in the vocabulary",
            ));
        }
        let add_bos = if md_bool(content, "tokenizer.ggml.add_bos_token").unwrap_or(false) {
            bos_id
        } else {
            None
        };
        let chat_template = md(content, "tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .cloned();
        Ok(Self {
            tokenizer,
            chat_template,
            bos_token: bos_id.map(|i| tokens[i as usize].clone()),
            eos_token: eos_id.map(|i| tokens[i as usize].clone()),
            add_bos,
            eos_ids,
            vocab_size,
            grammar: Default::default(),
        })
    }

    /// Encodes text; special tokens written in the text (e.g. `<|im_start|>`) become their ids.
    /// Prepends BOS only when the file says `tokenizer.ggml.add_bos_token = true`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if let Some(b) = self.add_bos {
            ids.push(b);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids back to text, special tokens included (the exact inverse of `encode`).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= self.vocab_size) {
            return Err(ModelError::Tokenizer(format!(
                "token id {bad} out of range (vocab {})",
                self.vocab_size
            )));
        }
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// Renders `tokenizer.chat_template` for `messages` like transformers'
    /// `apply_chat_template(..., tokenize=False)`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render(messages, None, add_generation_prompt)
    }

    /// The prompt of a request that may offer tools: rendered by the chat
    /// template where it knows tools (Qwen3's does), else with the tools,
    /// calls and results written into the messages the Hermes way
    /// ([`tools::template_messages`]); then the answer's start a forced tool
    /// choice makes.
    pub fn chat_prompt(&self, messages: &[ChatMessage], tools: Option<&Tools>) -> Result<String> {
        let has_tool_turns = messages
            .iter()
            .any(|m| m.role == Role::Tool || !m.tool_calls.is_empty());
        if tools.is_none() && !has_tool_turns {
            return self.render(messages, None, true);
        }
        let knows_tools = self
            .chat_template
            .as_deref()
            .is_some_and(|t| t.contains("tools") && t.contains("tool_call"));
        let mut prompt = if knows_tools {
            self.render(messages, tools.map(|t| t.functions.as_slice()), true)?
        } else {
            self.render(&tools::template_messages(messages, tools), None, true)?
        };
        if let Some(prefix) = tools.and_then(Tools::forced_prefix) {
            prompt.push_str(&prefix);
        }
        Ok(prompt)
    }

    fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| ModelError::Tokenizer("the model has no chat template".into()))?;
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", template)
            .map_err(|e| ModelError::Tokenizer(format!("chat template: {e}")))?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| ModelError::Tokenizer(format!("chat template: {e}")))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_deref().unwrap_or(""),
            eos_token => self.eos_token.as_deref().unwrap_or(""),
        })
        .map_err(|e| ModelError::Tokenizer(format!("chat template: {e}")))
    }

    /// Every id that ends a turn (`eos_token_id`, `eot_token_id`, `<|im_end|>`, `<|endoftext|>`, ...).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of a token string (special or not), if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The constraint on an answer whose tool choice forces a call
    /// ([`crate::engine::constrain`]); `None` where nothing is forced, or
    /// where the grammar cannot be built (logged; the answer goes
    /// unconstrained and its call is parsed as the model wrote it).
    pub fn call_constraint(&self, tools: Option<&Tools>) -> Option<CallConstraint> {
        let tools = tools?;
        tools.forced_prefix()?;
        let factory = self.grammar.get_or_init(|| {
            let eos = self.eos_ids.first().copied().unwrap_or(0);
            GrammarFactory::new(&self.tokenizer, eos)
        });
        let built = match factory {
            Ok(f) => f.call_constraint(tools),
            Err(e) => Err(e.clone()),
        };
        built.unwrap_or_else(|e| {
            tracing::warn!("forced tool call left unconstrained: {e}");
            None
        })
    }

    /// The underlying `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &Tokenizer {
        &self.tokenizer
    }
}

/// Streaming detokenizer: text comes out only once it is complete UTF-8 (a multi-byte
/// character split over several byte-level tokens is held back until its last byte arrives).
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    tokens: Vec<u32>,
    prev_index: usize,
    current_index: usize,
}

impl IncrementalDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one generated id; returns the newly completed text, if any.
    pub fn push(&mut self, tok: &ChatTokenizer, id: u32) -> Result<Option<String>> {
        let prev_text = if self.tokens.is_empty() {
            String::new()
        } else {
            tok.decode(&self.tokens[self.prev_index..self.current_index])?
        };
        self.tokens.push(id);
        let text = tok.decode(&self.tokens[self.prev_index..])?;
        // A character is at most 4 bytes: past 4 held-back tokens the bytes are not
        // one (a model can emit any byte), so they go out as U+FFFD rather than
        // holding the rest of the answer back.
        let stuck = self.tokens.len() - self.current_index >= 4;
        if text.len() > prev_text.len() && (!text.ends_with('\u{FFFD}') || stuck) {
            let new = match text.get(prev_text.len()..) {
                Some(s) => s.to_string(),
                None => return Ok(None),
            };
            self.prev_index = self.current_index;
            self.current_index = self.tokens.len();
            // Keep only the tokens still needed as left context.
            self.tokens.drain(..self.prev_index);
            self.current_index -= self.prev_index;
            self.prev_index = 0;
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }

    /// Returns whatever is still held back (possibly with U+FFFD for truncated characters).
    pub fn flush(&mut self, tok: &ChatTokenizer) -> Result<Option<String>> {
        let prev_text = if self.tokens.is_empty() {
            String::new()
        } else {
            tok.decode(&self.tokens[self.prev_index..self.current_index])?
        };
        let text = tok.decode(&self.tokens[self.prev_index..])?;
        self.tokens.clear();
        self.prev_index = 0;
        self.current_index = 0;
        if text.len() > prev_text.len() {
            Ok(text.get(prev_text.len()..).map(|s| s.to_string()))
        } else {
            Ok(None)
        }
    }
}

#[cfg(test)]
mod hf_tests {
    use super::*;

    /// Bytes that never complete a character are let out after 4 tokens as U+FFFD;
    /// a character split over byte tokens still comes out whole.
    #[test]
    fn invalid_bytes_do_not_hold_the_answer_back() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/qwen3_omni/tokenizer");
        let tok = ChatTokenizer::from_hf_dir(&dir).unwrap();
        // A lone continuation byte (0x80) as its byte-level token.
        let cont = tok.encode("\u{e9}").unwrap(); // é = C3 A9
        let lone = (0..tok.vocab_size() as u32)
            .find(|&id| tok.decode(&[id]).is_ok_and(|t| t == "\u{FFFD}") && !cont.contains(&id))
            .expect("a byte token that is no character alone");
        let mut d = IncrementalDecoder::new();
        let mut out = Vec::new();
        for _ in 0..4 {
            out.push(d.push(&tok, lone).unwrap());
        }
        assert_eq!(out[..3], [None, None, None]);
        assert!(
            out[3].as_deref().is_some_and(|t| t.contains('\u{FFFD}')),
            "{out:?}"
        );
        // A split character is still held until it is whole.
        let mut d = IncrementalDecoder::new();
        let mut text = String::new();
        for &id in &cont {
            if let Some(t) = d.push(&tok, id).unwrap() {
                text.push_str(&t);
            }
        }
        assert_eq!(text, "\u{e9}");
    }

    /// A Qwen2-style tokenizer.json + tokenizer_config.json written by
    /// scripts/qwen3_omni/tokenizer.py, with transformers' own encodings.
    #[test]
    fn hf_checkpoint_tokenizer_matches_transformers() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/qwen3_omni/tokenizer");
        let tok = ChatTokenizer::from_hf_dir(&dir).unwrap();
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap())
                .unwrap();
        assert!(cases.len() >= 4);
        for case in cases {
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            let text = match case.get("messages") {
                Some(m) => {
                    let messages: Vec<ChatMessage> = serde_json::from_value(m.clone()).unwrap();
                    let rendered = tok.apply_chat_template(&messages, true).unwrap();
                    assert_eq!(rendered, case["text"].as_str().unwrap());
                    rendered
                }
                None => case["text"].as_str().unwrap().to_string(),
            };
            assert_eq!(tok.encode(&text).unwrap(), want, "{text}");
            assert_eq!(
                tok.decode(&want).unwrap(),
                case["decoded"].as_str().unwrap()
            );
        }
        let im_end = tok.token_to_id("<|im_end|>").unwrap();
        let eot = tok.token_to_id("<|endoftext|>").unwrap();
        assert_eq!(tok.eos_token_ids(), &[im_end, eot]);
        // Special tokens in text are single ids.
        assert_eq!(tok.encode("<|audio_pad|>").unwrap().len(), 1);
    }

    #[test]
    fn hf_checkpoint_without_tokenizer_is_a_clear_error() {
        let empty = tempfile::tempdir().unwrap();
        let err = ChatTokenizer::from_hf_dir(empty.path()).unwrap_err();
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }
}
