//! What a conversation remembers and what of it reaches the Thinker.

use omnistream_stages::engine::{ChatMessage, Role};

/// Conversation history sent to the Thinker, newest first, in characters.
const HISTORY_CHARS: usize = 16_000;
/// Messages a conversation keeps.
const MAX_HISTORY: usize = 256;

/// The conversation's messages, oldest first, at most `MAX_HISTORY`.
#[derive(Debug, Default, Clone)]
pub struct History(Vec<ChatMessage>);

impl History {
    /// Adds a message, forgetting the oldest past `MAX_HISTORY` (only the
    /// newest `HISTORY_CHARS` reach the Thinker anyway).
    pub fn remember(&mut self, m: ChatMessage) {
        self.0.push(m);
        if self.0.len() > MAX_HISTORY {
            let extra = self.0.len() - MAX_HISTORY;
            self.0.drain(..extra);
        }
    }

    #[cfg(test)]
    pub fn messages(&self) -> &[ChatMessage] {
        &self.0
    }

    /// Whether a function call `id` was made (its result may be added).
    pub fn has_call(&self, id: &str) -> bool {
        self.0
            .iter()
            .any(|m| m.tool_calls.iter().any(|c| c.id == id))
    }

    /// The last message, if it is the assistant's (an answer to cut back).
    pub fn last_assistant_mut(&mut self) -> Option<&mut ChatMessage> {
        self.0.last_mut().filter(|m| m.role == Role::Assistant)
    }

    /// The Thinker's messages: instructions, then the newest history that
    /// fits, then `extra` (a turn not yet remembered).
    pub fn prompt(
        &self,
        instructions: Option<&str>,
        extra: Option<&ChatMessage>,
    ) -> Vec<ChatMessage> {
        let all: Vec<&ChatMessage> = self.0.iter().chain(extra).collect();
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
        out.extend(all[all.len() - keep..].iter().map(|m| (*m).clone()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_keeps_the_newest_that_fit_and_instructions_first() {
        let mut h = History::default();
        for i in 0..300 {
            h.remember(ChatMessage::user(format!("m{i}")));
        }
        assert_eq!(h.messages().len(), MAX_HISTORY);
        assert_eq!(h.messages()[0].content, "m44");
        let big = "x".repeat(HISTORY_CHARS - 10);
        h.remember(ChatMessage::assistant(big));
        let p = h.prompt(Some("be brief"), Some(&ChatMessage::user("last")));
        assert_eq!(p[0].role, Role::System);
        assert_eq!(p.last().unwrap().content, "last");
        assert!(p.iter().map(|m| m.content.len()).sum::<usize>() <= HISTORY_CHARS + 8);
        // A single message longer than the budget still goes.
        let mut h = History::default();
        h.remember(ChatMessage::user("y".repeat(HISTORY_CHARS * 2)));
        assert_eq!(h.prompt(None, None).len(), 1);
    }
}
