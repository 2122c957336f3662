//! The voices a client may name: the pipeline's own, and other names for
//! them (`server.voice_aliases`), OpenAI's voice names first among them.

use std::collections::BTreeMap;

/// OpenAI's voice names (speech and Realtime), which apps hard-code.
pub const OPENAI_VOICES: &[&str] = &[
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
    "shimmer", "verse",
];

/// Why a pipeline without preset voices refuses a voice by name.
pub const NO_PRESET_VOICES: &str = "this server has no preset voices: speak a cloned one (a `voice_…` id from POST /v1/audio/voices, or `ref_audio` on /v1/audio/speech) where it clones voices";

/// The pipeline's voices and their aliases (names compared in any case).
#[derive(Debug, Clone, Default)]
pub struct Voices {
    names: Vec<String>,
    /// Lowercased alias → one of `names`.
    aliases: BTreeMap<String, String>,
}

impl Voices {
    /// `names` (the first is the default) with the profile's `configured`
    /// aliases; every OpenAI name not configured speaks in the default voice.
    /// An alias of a voice the pipeline lacks, or that hides one of its
    /// voices, is an error naming it.
    pub fn new(names: Vec<String>, configured: &BTreeMap<String, String>) -> Result<Self, String> {
        let own = |n: &str| names.iter().find(|v| v.eq_ignore_ascii_case(n)).cloned();
        let mut aliases = BTreeMap::new();
        if let Some(default) = names.first() {
            for a in OPENAI_VOICES {
                if own(a).is_none() {
                    aliases.insert(a.to_string(), default.clone());
                }
            }
        }
        for (alias, voice) in configured {
            if own(alias).is_some() {
                return Err(format!(
                    "server.voice_aliases: {alias:?} is already one of the pipeline's voices"
                ));
            }
            let target = own(voice).ok_or_else(|| {
                format!(
                    "server.voice_aliases.{alias}: {voice:?} is not one of the pipeline's voices ({})",
                    names.join(", ")
                )
            })?;
            aliases.insert(alias.to_ascii_lowercase(), target);
        }
        Ok(Self { names, aliases })
    }

    /// The pipeline's voice that `name` (a voice or an alias, any case) speaks
    /// in, or an error listing both.
    pub fn resolve(&self, name: &str) -> Result<String, String> {
        if let Some(v) = self.names.iter().find(|v| v.eq_ignore_ascii_case(name)) {
            return Ok(v.clone());
        }
        if let Some(v) = self.aliases.get(&name.to_ascii_lowercase()) {
            return Ok(v.clone());
        }
        let aliases: Vec<&str> = self.aliases.keys().map(String::as_str).collect();
        Err(if self.names.is_empty() {
            NO_PRESET_VOICES.to_string()
        } else {
            format!(
                "unsupported voice {name:?}; available voices: {} (also: {})",
                self.names.join(", "),
                aliases.join(", ")
            )
        })
    }

    /// The voice used when a request names none.
    /// Whether it has no voice of its own (a Qwen3-TTS Base checkpoint
    /// speaks only cloned voices; a pipeline without a Talker, none).
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn default_voice(&self) -> &str {
        self.names.first().map_or("", String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn voices(configured: &[(&str, &str)]) -> Result<Voices, String> {
        let c = configured
            .iter()
            .map(|(a, v)| (a.to_string(), v.to_string()))
            .collect();
        Voices::new(vec!["ethan".into(), "chelsie".into()], &c)
    }

    #[test]
    fn openai_names_speak_in_a_pipeline_voice() {
        let v = voices(&[("alloy", "Chelsie"), ("narrator", "ethan")]).unwrap();
        assert_eq!(v.resolve("ETHAN").unwrap(), "ethan");
        assert_eq!(v.resolve("alloy").unwrap(), "chelsie");
        assert_eq!(v.resolve("Narrator").unwrap(), "ethan");
        // Not configured: the default voice.
        for name in OPENAI_VOICES.iter().filter(|n| **n != "alloy") {
            assert_eq!(v.resolve(name).unwrap(), "ethan", "{name}");
        }
        let e = v.resolve("bob").unwrap_err();
        assert!(e.contains("ethan, chelsie") && e.contains("shimmer"), "{e}");
        assert_eq!(v.default_voice(), "ethan");
    }

    #[test]
    fn bad_aliases_are_refused() {
        let e = voices(&[("alloy", "bob")]).unwrap_err();
        assert!(
            e.contains("voice_aliases.alloy") && e.contains("bob"),
            "{e}"
        );
        assert!(voices(&[("Ethan", "chelsie")]).is_err());
        let none = Voices::new(vec![], &BTreeMap::new()).unwrap();
        assert!(none
            .resolve("alloy")
            .unwrap_err()
            .contains("no preset voices"));
    }
}
