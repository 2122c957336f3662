//! What a conversation remembers and what of it reaches the Thinker: its
//! items, each with the id the client knows it by (retrieved, deleted and
//! truncated by that id).

use serde_json::Value;

use omnistream_stages::engine::{ChatMessage, Role};

/// Conversation history sent to the Thinker, newest first, in characters.
const HISTORY_CHARS: usize = 16_000;
/// Items a conversation keeps.
const MAX_HISTORY: usize = 256;

/// How an item came to be, which is how the client is shown it.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    /// Added by the client: its content as it was sent.
    Client(Value),
    /// A user turn the client typed through its transport (not an item it made).
    Typed,
    /// A spoken user turn: the words are its transcript.
    Spoken,
    /// An answer; `audio_ms`: the audio it has (`None`: text only), which
    /// a cut shortens; `generated`: the whole answer as it was made, from
    /// which a later cut is taken (the client's own, which knows what it
    /// played, may come after the server's estimate at a barge-in).
    Answer {
        audio_ms: Option<u64>,
        generated: Option<Generated>,
    },
    /// A function call (the model's, or the client's); the message holds it.
    Call,
    /// A function call's result, from the client.
    Output,
}

/// An answer as it was generated, before any cut.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub text: String,
    pub audio_ms: u64,
}

/// One remembered item.
#[derive(Debug, Clone)]
pub struct Item {
    pub id: String,
    pub message: ChatMessage,
    pub origin: Origin,
}

/// The conversation's items, oldest first, at most `MAX_HISTORY`.
#[derive(Debug, Default, Clone)]
pub struct History(Vec<Item>);

impl History {
    /// Adds an item, forgetting the oldest past `MAX_HISTORY` (only the
    /// newest `HISTORY_CHARS` reach the Thinker anyway).
    pub fn remember(&mut self, id: String, message: ChatMessage, origin: Origin) {
        self.0.push(Item {
            id,
            message,
            origin,
        });
        if self.0.len() > MAX_HISTORY {
            let extra = self.0.len() - MAX_HISTORY;
            self.0.drain(..extra);
        }
    }

    #[cfg(test)]
    pub fn messages(&self) -> Vec<ChatMessage> {
        self.0.iter().map(|i| i.message.clone()).collect()
    }

    pub fn get(&self, id: &str) -> Option<&Item> {
        self.0.iter().find(|i| i.id == id)
    }

    pub fn get_mut(&mut self, id: &str) -> Option<&mut Item> {
        self.0.iter_mut().find(|i| i.id == id)
    }

    /// Forgets item `id`; false if there is none.
    pub fn delete(&mut self, id: &str) -> bool {
        let before = self.0.len();
        self.0.retain(|i| i.id != id);
        self.0.len() < before
    }

    /// The newest item's id.
    pub fn last_id(&self) -> Option<&str> {
        self.0.last().map(|i| i.id.as_str())
    }

    /// Whether a function call `id` was made (its result may be added).
    pub fn has_call(&self, id: &str) -> bool {
        self.0
            .iter()
            .any(|i| i.message.tool_calls.iter().any(|c| c.id == id))
    }

    /// The Thinker's messages: instructions, then the newest history that
    /// fits, then `extra` (a turn not yet remembered).
    pub fn prompt(
        &self,
        instructions: Option<&str>,
        extra: Option<&ChatMessage>,
    ) -> Vec<ChatMessage> {
        let all: Vec<&ChatMessage> = self.0.iter().map(|i| &i.message).chain(extra).collect();
        let mut budget = HISTORY_CHARS;
        let mut keep = 0;
        for m in all.iter().rev() {
            let n = m.content.len();
            if n > budget && keep > 0 {
                break;
            }
            budget = budget.saturating_sub(n);
            keep += 1;
        }
        let mut out = Vec::with_capacity(keep + 1);
        if let Some(i) = instructions.filter(|i| !i.trim().is_empty()) {
            out.push(ChatMessage::system(i));
        }
        out.extend(merge_calls(all[all.len() - keep..].iter().copied()));
        out
    }
}

/// The messages as the model wrote them: a call (its own item) joins the
/// assistant message it came with, so one answer's words and calls are one
/// assistant turn.
pub fn merge_calls<'a>(messages: impl IntoIterator<Item = &'a ChatMessage>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::new();
    for m in messages {
        let joins = m.role == Role::Assistant && m.content.is_empty() && !m.tool_calls.is_empty();
        match out.last_mut() {
            Some(prev) if joins && prev.role == Role::Assistant => {
                prev.tool_calls.extend(m.tool_calls.iter().cloned())
            }
            _ => out.push(m.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_keeps_the_newest_that_fit_and_instructions_first() {
        let mut h = History::default();
        for i in 0..300 {
            h.remember(
                format!("i{i}"),
                ChatMessage::user(format!("m{i}")),
                Origin::Typed,
            );
        }
        assert_eq!(h.messages().len(), MAX_HISTORY);
        assert_eq!(h.messages()[0].content, "m44");
        let big = "x".repeat(HISTORY_CHARS - 10);
        h.remember(
            "big".into(),
            ChatMessage::assistant(big),
            Origin::Answer {
                audio_ms: None,
                generated: None,
            },
        );
        let p = h.prompt(Some("be brief"), Some(&ChatMessage::user("last")));
        assert_eq!(p[0].role, Role::System);
        assert_eq!(p.last().unwrap().content, "last");
        assert!(p.iter().map(|m| m.content.len()).sum::<usize>() <= HISTORY_CHARS + 8);
        // A single message longer than the budget still goes.
        let mut h = History::default();
        h.remember(
            "y".into(),
            ChatMessage::user("y".repeat(HISTORY_CHARS * 2)),
            Origin::Typed,
        );
        assert_eq!(h.prompt(None, None).len(), 1);
    }

    #[test]
    fn a_call_joins_the_answer_it_came_with() {
        let mut h = History::default();
        h.remember("u".into(), ChatMessage::user("weather?"), Origin::Typed);
        h.remember(
            "a".into(),
            ChatMessage::assistant("Checking."),
            Origin::Answer {
                audio_ms: None,
                generated: None,
            },
        );
        let call = |id: &str| {
            let mut c = omnistream_stages::engine::ToolCall::new("weather", "{}");
            c.id = id.to_string();
            let mut m = ChatMessage::assistant("");
            m.tool_calls.push(c);
            m
        };
        h.remember("c1".into(), call("call_1"), Origin::Call);
        h.remember("c2".into(), call("call_2"), Origin::Call);
        let p = h.prompt(None, None);
        assert_eq!(p.len(), 2);
        assert_eq!(p[1].content, "Checking.");
        assert_eq!(p[1].tool_calls.len(), 2);
        assert!(h.has_call("call_2"));
        assert!(h.delete("c2") && !h.delete("c2"));
        assert!(!h.has_call("call_2"));
        assert_eq!(h.last_id(), Some("c1"));
    }
}
