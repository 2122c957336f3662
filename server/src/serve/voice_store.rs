//! Cloned voices: a reference clip uploaded once (`POST /v1/audio/voices`)
//! becomes a voice id whose speaker embedding is computed then and kept on
//! disk, one JSON file a voice, so it survives a restart. A voice belongs to the
//! API key that made it: another key neither lists, uses nor deletes it (with no
//! keys set, every client is the same owner). Keys are never stored, only a
//! SHA-256 of each.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use omnistream_stages::engine::VoiceReference;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Voices one owner may keep.
pub const MAX_VOICES_PER_OWNER: usize = 100;
/// Voices the store keeps in all.
pub const MAX_VOICES: usize = 10_000;
/// The ids of cloned voices start with this (where a `voice` field may name
/// a preset voice too).
pub const CLONED_VOICE_PREFIX: &str = "voice_";
/// The longest voice name.
pub const MAX_NAME_CHARS: usize = 64;

/// Why the store refused.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Full(String),
    #[error("voice store {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One cloned voice, as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoredVoice {
    pub id: String,
    pub name: String,
    pub created_at: u64,
    /// SHA-256 (hex) of the owning API key; empty where no keys are set.
    pub owner: String,
    /// The consent recording id the client gave (kept, not checked).
    pub consent: Option<String>,
    /// The reference clip's length.
    pub seconds: f32,
    /// The speaker embedding the Talker speaks from.
    pub embedding: Vec<f32>,
    /// In-context cloning: the clip's codes and transcript (a voice made with
    /// `ref_text`); none for a voice cloned from the embedding alone.
    #[serde(default)]
    pub reference: Option<VoiceReference>,
}

/// What a reference clip gives a cloned voice.
#[derive(Debug, Clone, PartialEq)]
pub struct ClonedClip {
    pub seconds: f32,
    pub embedding: Vec<f32>,
    pub reference: Option<VoiceReference>,
}

impl StoredVoice {
    /// OpenAI's `Voice` object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "object": "audio.voice",
            "name": self.name,
            "created_at": self.created_at,
            "type": "audio_sample",
        })
    }
}

/// The owner of a request's voices: a hash of its API key.
pub fn owner_of(key: Option<&str>) -> String {
    match key {
        Some(k) if !k.is_empty() => hex::encode(Sha256::digest(k.as_bytes())),
        _ => String::new(),
    }
}

pub struct VoiceStore {
    dir: PathBuf,
    voices: Mutex<HashMap<String, StoredVoice>>,
}

impl VoiceStore {
    /// The store in `dir` (made if missing), with the voices already there. A
    /// file that cannot be read is skipped with a warning, not fatal.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let io = |source| StoreError::Io {
            path: dir.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let mut voices = HashMap::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let parsed = std::fs::read_to_string(&path)
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str::<StoredVoice>(&t).map_err(|e| e.to_string()));
            match parsed {
                Ok(v) if path.file_stem().is_some_and(|s| *s == *v.id) => {
                    voices.insert(v.id.clone(), v);
                }
                Ok(_) => tracing::warn!("voice store: {} is not named by its id", path.display()),
                Err(e) => tracing::warn!("voice store: skipping {}: {e}", path.display()),
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            voices: Mutex::new(voices),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, StoredVoice>> {
        // A panic while holding the map leaves it as it was: keep serving.
        self.voices.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn file(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Saves a new voice (written to a temporary file, then renamed: a crash
    /// leaves the old state or the new, never half a voice).
    pub fn create(
        &self,
        owner: &str,
        name: &str,
        consent: Option<String>,
        clip: ClonedClip,
    ) -> Result<StoredVoice, StoreError> {
        let mut voices = self.lock();
        if voices.len() >= MAX_VOICES {
            return Err(StoreError::Full(format!(
                "the server keeps at most {MAX_VOICES} voices"
            )));
        }
        if voices.values().filter(|v| v.owner == owner).count() >= MAX_VOICES_PER_OWNER {
            return Err(StoreError::Full(format!(
                "at most {MAX_VOICES_PER_OWNER} voices per API key: delete one first"
            )));
        }
        let voice = StoredVoice {
            id: format!("{CLONED_VOICE_PREFIX}{}", uuid::Uuid::new_v4().simple()),
            name: name.to_string(),
            created_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            owner: owner.to_string(),
            consent,
            seconds: clip.seconds,
            embedding: clip.embedding,
            reference: clip.reference,
        };
        let path = self.file(&voice.id);
        let tmp = path.with_extension("json.tmp");
        let io = |source| StoreError::Io {
            path: path.clone(),
            source,
        };
        let text = serde_json::to_string(&voice).map_err(|e| io(std::io::Error::other(e)))?;
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        voices.insert(voice.id.clone(), voice.clone());
        Ok(voice)
    }

    /// `owner`'s voices, oldest first.
    pub fn list(&self, owner: &str) -> Vec<StoredVoice> {
        let mut v: Vec<StoredVoice> = self
            .lock()
            .values()
            .filter(|v| v.owner == owner)
            .cloned()
            .collect();
        v.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        v
    }

    /// `owner`'s voice `id` (another owner's is as good as missing).
    pub fn get(&self, owner: &str, id: &str) -> Option<StoredVoice> {
        self.lock().get(id).filter(|v| v.owner == owner).cloned()
    }

    /// Whether `owner` has a voice `id` (without copying its clip).
    pub fn has(&self, owner: &str, id: &str) -> bool {
        self.lock().get(id).is_some_and(|v| v.owner == owner)
    }

    /// Deletes `owner`'s voice `id`; whether there was one.
    pub fn delete(&self, owner: &str, id: &str) -> Result<bool, StoreError> {
        let mut voices = self.lock();
        if voices.get(id).is_none_or(|v| v.owner != owner) {
            return Ok(false);
        }
        let path = self.file(id);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(StoreError::Io { path, source }),
        }
        voices.remove(id);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clip(embedding: Vec<f32>) -> ClonedClip {
        ClonedClip {
            seconds: 3.0,
            embedding,
            reference: None,
        }
    }

    #[test]
    fn voices_survive_a_reopen_and_stay_with_their_owner() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (owner_of(Some("key-a")), owner_of(Some("key-b")));
        assert_ne!(a, b);
        assert!(!a.contains("key-a"), "keys are not stored");
        let store = VoiceStore::open(dir.path()).unwrap();
        let in_context = ClonedClip {
            reference: Some(VoiceReference {
                text: "Hello there.".into(),
                codes: vec![vec![1, 2], vec![3, 4]],
            }),
            ..clip(vec![0.5, -1.0])
        };
        let v = store
            .create(&a, "Mine", Some("cons_1".into()), in_context)
            .unwrap();
        assert!(v.id.starts_with("voice_"));
        assert_eq!(store.list(&a), vec![v.clone()]);
        assert!(store.list(&b).is_empty());
        assert!(store.get(&b, &v.id).is_none());
        assert!(!store.delete(&b, &v.id).unwrap(), "not b's to delete");
        // A corrupt file beside it is skipped, not fatal.
        std::fs::write(dir.path().join("voice_junk.json"), "{not json").unwrap();
        let again = VoiceStore::open(dir.path()).unwrap();
        assert_eq!(again.get(&a, &v.id), Some(v.clone()));
        assert!(again.delete(&a, &v.id).unwrap());
        assert!(again.get(&a, &v.id).is_none());
        assert!(VoiceStore::open(dir.path()).unwrap().list(&a).is_empty());
    }

    #[test]
    fn an_owner_is_capped() {
        let dir = tempfile::tempdir().unwrap();
        let store = VoiceStore::open(dir.path()).unwrap();
        for i in 0..MAX_VOICES_PER_OWNER {
            store
                .create("o", &format!("v{i}"), None, clip(vec![0.0]))
                .unwrap();
        }
        let err = store
            .create("o", "one more", None, clip(vec![0.0]))
            .unwrap_err();
        assert!(matches!(err, StoreError::Full(_)), "{err}");
        store
            .create("other", "theirs", None, clip(vec![0.0]))
            .unwrap();
    }
}
