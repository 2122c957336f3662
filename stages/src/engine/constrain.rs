//! Constrained decoding of forced tool calls: when a request's `tool_choice`
//! makes the model call (`required`, or a named function), every token after
//! the forced prefix is drawn only from those that keep the answer a call of
//! one of the request's tools whose arguments match that tool's JSON schema,
//! then `}` and `</tool_call>`, and the answer ends there.
//!
//! Without it a small model copies the schema instead of filling it in
//! (SmolLM2-135M, asked for the weather in Paris, wrote
//! `{"city": {"description": "The city", "type": "string"}}`); with it the
//! arguments parse and validate as the app declared them, as OpenAI's strict
//! function calling promises. The grammar engine is llguidance (Microsoft's
//! Earley parser over the token trie, the structured-output backend vLLM,
//! SGLang and llama.cpp use): a mask costs tens of microseconds a token.
//! An `auto` choice is not constrained: whether to call is the model's.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::tools::{InvalidToolCall, ToolChoice, Tools, CALL_CLOSE};

/// The grammar engine for one tokenizer: built once (its token trie), shared
/// by every request's [`CallConstraint`].
#[derive(Clone)]
pub struct GrammarFactory(Arc<ParserFactory>);

impl std::fmt::Debug for GrammarFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrammarFactory")
    }
}

/// The tokenizer as llguidance sees it: each id's bytes, in a trie.
struct TokenEnv {
    tokenizer: Tokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for TokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Grammars here are text; a lossy decode only touches invalid UTF-8.
        let text = String::from_utf8_lossy(s);
        self.tokenizer
            .encode(text.as_ref(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }
}

impl GrammarFactory {
    /// The engine for a byte-level BPE (or byte-fallback) tokenizer; `eos`
    /// is the id that ends an answer.
    pub fn new(tokenizer: &Tokenizer, eos: u32) -> Result<Self, String> {
        let json: Value = serde_json::from_str(
            &tokenizer
                .to_string(false)
                .map_err(|e| format!("the tokenizer as JSON: {e}"))?,
        )
        .map_err(|e| format!("the tokenizer as JSON: {e}"))?;
        let bytes = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| format!("the tokens' bytes: {e}"))?;
        let info = TokRxInfo::new(bytes.len() as u32, eos);
        let trie = TokTrie::from(&info, &bytes);
        let env = Arc::new(TokenEnv {
            tokenizer: tokenizer.clone(),
            trie,
        });
        let mut factory = ParserFactory::new_simple(&(env as llguidance::toktrie::TokEnv))
            .map_err(|e| format!("the grammar engine: {e}"))?;
        // Its warnings go to our log, not the server's stderr.
        factory.set_stderr_log_level(0);
        Ok(Self(Arc::new(factory)))
    }

    /// The constraint for one answer to a request offering `tools`, if its
    /// choice forces a call; `None` for `auto`.
    pub fn call_constraint(&self, tools: &Tools) -> Result<Option<CallConstraint>, String> {
        let Some(lark) = call_grammar(tools) else {
            return Ok(None);
        };
        let parser = self
            .0
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| format!("the tools' schemas as a grammar: {e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(format!("the tools' schemas as a grammar: {e}"));
        }
        Ok(Some(CallConstraint { matcher }))
    }
}

/// A JSON string literal, which Lark reads as the same string.
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The function's `parameters` schema as the arguments' grammar: compact
/// separators as Hermes templates write them, unknown keywords tolerated,
/// and (unless the schema says) no properties beyond those declared.
fn arguments_schema(function: &Value) -> Value {
    let mut schema = match function.pointer("/function/parameters") {
        Some(s @ Value::Object(_)) => s.clone(),
        _ => json!({"type": "object", "properties": {}}),
    };
    if let Value::Object(m) = &mut schema {
        if m.get("type").and_then(Value::as_str) == Some("object") {
            m.entry("additionalProperties")
                .or_insert(Value::Bool(false));
        }
        m.insert(
            "x-guidance".into(),
            json!({
                "item_separator": ", ",
                "key_separator": ": ",
                "whitespace_flexible": false,
                "lenient": true,
            }),
        );
    }
    schema
}

/// The Lark grammar of what follows [`Tools::forced_prefix`], or `None` when
/// the choice forces nothing.
pub fn call_grammar(tools: &Tools) -> Option<String> {
    let close = lit(&format!("}}\n{CALL_CLOSE}"));
    let named = |name: &str| {
        tools
            .functions
            .iter()
            .find(|f| f.pointer("/function/name").and_then(Value::as_str) == Some(name))
    };
    match &tools.choice {
        ToolChoice::Auto => None,
        ToolChoice::Function(name) => {
            let schema = arguments_schema(named(name)?);
            Some(format!("start: args {close}\nargs: %json {schema}\n"))
        }
        ToolChoice::Required => {
            // The prefix ends inside the name's opening quote.
            let mut rules = String::new();
            let mut alts = Vec::new();
            for (i, name) in tools.names().enumerate() {
                let schema = arguments_schema(named(name)?);
                let head = lit(&format!("{name}\", \"arguments\": "));
                rules.push_str(&format!(
                    "call{i}: {head} args{i}\nargs{i}: %json {schema}\n"
                ));
                alts.push(format!("call{i}"));
            }
            if alts.is_empty() {
                return None;
            }
            Some(format!("start: ({}) {close}\n{rules}", alts.join(" | ")))
        }
    }
}

/// One answer's constraint: masks each step's logits, is told each token.
pub struct CallConstraint {
    matcher: Matcher,
}

impl std::fmt::Debug for CallConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallConstraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl CallConstraint {
    fn failed(&self, what: &str) -> InvalidToolCall {
        InvalidToolCall(format!(
            "the tool call's grammar {what}: {}",
            self.matcher.get_error().unwrap_or_default()
        ))
    }

    /// Sets every token the grammar does not allow next to `-inf` (ids past
    /// the tokenizer's vocabulary, the checkpoint's padding, too).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), InvalidToolCall> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|_| self.failed("failed"))?;
        let mut any = false;
        for (id, l) in logits.iter_mut().enumerate() {
            if id < allowed.len() && allowed.is_allowed(id as TokenId) {
                any |= l.is_finite() || *l == f32::INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            return Err(self.failed("allows no token"));
        }
        Ok(())
    }

    /// The token drawn from the masked logits.
    pub fn commit(&mut self, token: u32) -> Result<(), InvalidToolCall> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|_| self.failed("refused a token"))
    }

    /// The call is complete (nothing but the end may follow): the answer
    /// ends here.
    pub fn done(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {
            "name": "get_weather",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn auto_is_not_constrained() {
        let t = Tools {
            functions: vec![weather()],
            choice: ToolChoice::Auto,
        };
        assert_eq!(call_grammar(&t), None);
    }

    #[test]
    fn forced_choices_have_a_grammar() {
        let t = Tools {
            functions: vec![weather()],
            choice: ToolChoice::Function("get_weather".into()),
        };
        let g = call_grammar(&t).unwrap();
        assert!(g.starts_with("start: args \"}\\n</tool_call>\""), "{g}");
        assert!(g.contains("\"additionalProperties\":false"), "{g}");
        let t = Tools {
            choice: ToolChoice::Required,
            ..t
        };
        let g = call_grammar(&t).unwrap();
        assert!(
            g.contains("call0: \"get_weather\\\", \\\"arguments\\\": \" args0"),
            "{g}"
        );
    }
}
