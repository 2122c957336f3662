//! SIP digest authentication (RFC 3261 §22, RFC 2617's MD5 with qop=auth):
//! a caller outside the allow-list answers our challenge with one of the
//! server's API keys as its password. Nonces are stateless: a time and a MAC
//! of it under a secret drawn at start, good for `NONCE_TTL`.

use std::collections::HashMap;

use md5::{Digest as _, Md5};

/// How long a challenge's nonce may be answered.
const NONCE_TTL_S: u64 = 300;

fn md5_hex(parts: &[&str]) -> String {
    let mut h = Md5::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            h.update(b":");
        }
        h.update(p.as_bytes());
    }
    hex::encode(h.finalize())
}

/// Issues and checks challenges.
pub struct DigestAuth {
    realm: String,
    secret: [u8; 16],
}

/// What an answer to a challenge turned out to be.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The key at this index of those given answered.
    Ok(usize),
    /// Right key, old nonce: challenge again with `stale=true`.
    Stale,
    /// Wrong, forged or malformed: the reason, for the log.
    Refused(&'static str),
}

impl DigestAuth {
    pub fn new(realm: &str) -> Self {
        Self {
            realm: realm.to_string(),
            secret: rand::random(),
        }
    }

    fn nonce_at(&self, unix_s: u64) -> String {
        let t = format!("{unix_s:x}");
        let mac = md5_hex(&[&hex::encode(self.secret), &t]);
        format!("{t}.{}", &mac[..16])
    }

    /// The `WWW-Authenticate` header's value for a challenge issued now.
    pub fn challenge(&self, unix_s: u64, stale: bool) -> String {
        let mut c = format!(
            "Digest realm=\"{}\", nonce=\"{}\", algorithm=MD5, qop=\"auth\"",
            self.realm,
            self.nonce_at(unix_s)
        );
        if stale {
            c.push_str(", stale=true");
        }
        c
    }

    /// Checks an `Authorization` header of a `method` request against each
    /// of `keys` as the password.
    pub fn verify(&self, header: &str, method: &str, keys: &[String], unix_s: u64) -> Verdict {
        let Some(p) = params(header) else {
            return Verdict::Refused("not a digest answer");
        };
        let get = |k: &str| p.get(k).map(String::as_str);
        let (Some(user), Some(realm), Some(nonce), Some(uri), Some(response)) = (
            get("username"),
            get("realm"),
            get("nonce"),
            get("uri"),
            get("response"),
        ) else {
            return Verdict::Refused("the digest answer lacks a field");
        };
        if realm != self.realm {
            return Verdict::Refused("another realm");
        }
        if get("algorithm").is_some_and(|a| !a.eq_ignore_ascii_case("md5")) {
            return Verdict::Refused("an algorithm other than MD5");
        }
        // The nonce is ours and recent.
        let Some(issued) = nonce
            .split_once('.')
            .and_then(|(t, _)| u64::from_str_radix(t, 16).ok())
        else {
            return Verdict::Refused("not our nonce");
        };
        if self.nonce_at(issued) != nonce || issued > unix_s + 5 {
            return Verdict::Refused("not our nonce");
        }
        let ha2 = md5_hex(&[method, uri]);
        let qop = get("qop");
        let matched = keys.iter().position(|key| {
            let ha1 = md5_hex(&[user, realm, key]);
            let expected = match qop {
                Some(q) => md5_hex(&[
                    &ha1,
                    nonce,
                    get("nc").unwrap_or(""),
                    get("cnonce").unwrap_or(""),
                    q,
                    &ha2,
                ]),
                None => md5_hex(&[&ha1, nonce, &ha2]),
            };
            // Not secret-dependent timing worth guarding: the digest is of
            // a fresh nonce each time.
            expected.eq_ignore_ascii_case(response)
        });
        match (matched, unix_s.saturating_sub(issued) > NONCE_TTL_S) {
            (None, _) => Verdict::Refused("wrong credentials"),
            (Some(_), true) => Verdict::Stale,
            (Some(k), false) => Verdict::Ok(k),
        }
    }
}

/// `Digest k=v, k="v", ...` → its parameters (keys lower-cased).
fn params(header: &str) -> Option<HashMap<String, String>> {
    let rest = header.trim();
    let scheme = rest.get(..6)?;
    if !scheme.eq_ignore_ascii_case("digest") {
        return None;
    }
    let mut out = HashMap::new();
    let mut s = rest[6..].trim_start();
    while !s.is_empty() {
        let eq = s.find('=')?;
        let key = s[..eq].trim().to_ascii_lowercase();
        s = s[eq + 1..].trim_start();
        let value;
        if let Some(q) = s.strip_prefix('"') {
            let end = q.find('"')?;
            value = q[..end].to_string();
            s = &q[end + 1..];
        } else {
            let end = s.find(',').unwrap_or(s.len());
            value = s[..end].trim().to_string();
            s = &s[end..];
        }
        out.insert(key, value);
        s = s.trim_start().strip_prefix(',').unwrap_or(s).trim_start();
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a phone computes from the challenge.
    fn answer(d: &DigestAuth, now: u64, key: &str, uri: &str) -> String {
        let c = d.challenge(now, false);
        let p = params(&c).unwrap();
        let (realm, nonce) = (&p["realm"], &p["nonce"]);
        let ha1 = md5_hex(&["bob", realm, key]);
        let ha2 = md5_hex(&["INVITE", uri]);
        let resp = md5_hex(&[&ha1, nonce, "00000001", "0a4f113b", "auth", &ha2]);
        format!(
            "Digest username=\"bob\", realm=\"{realm}\", nonce=\"{nonce}\", uri=\"{uri}\", \
             response=\"{resp}\", algorithm=MD5, cnonce=\"0a4f113b\", qop=auth, nc=00000001"
        )
    }

    #[test]
    fn the_rfc_2617_example() {
        // RFC 2617 §3.5 (HTTP GET, password "Circle Of Life").
        let ha1 = md5_hex(&["Mufasa", "testrealm@host.com", "Circle Of Life"]);
        let ha2 = md5_hex(&["GET", "/dir/index.html"]);
        let r = md5_hex(&[
            &ha1,
            "dcd98b7102dd2f0e8b11d0f600bfb0c093",
            "00000001",
            "0a4f113b",
            "auth",
            &ha2,
        ]);
        assert_eq!(r, "6629fae49393a05397450978507c4ef1");
    }

    #[test]
    fn a_key_answers_and_nothing_else_does() {
        let d = DigestAuth::new("omnistream");
        let keys = vec!["k1".to_string(), "sk-test".to_string()];
        let t = 1_800_000_000;
        let ok = answer(&d, t, "sk-test", "sip:agent@127.0.0.1");
        assert_eq!(d.verify(&ok, "INVITE", &keys, t + 1), Verdict::Ok(1));
        assert_eq!(d.verify(&ok, "INVITE", &keys, t + 3600), Verdict::Stale);
        // Another method, a wrong key, a nonce of another server, garbage.
        assert!(matches!(
            d.verify(&ok, "BYE", &keys, t),
            Verdict::Refused(_)
        ));
        let wrong = answer(&d, t, "guess", "sip:agent@127.0.0.1");
        assert_eq!(
            d.verify(&wrong, "INVITE", &keys, t),
            Verdict::Refused("wrong credentials")
        );
        let other = DigestAuth::new("omnistream");
        let forged = answer(&other, t, "sk-test", "sip:agent@127.0.0.1");
        assert_eq!(
            d.verify(&forged, "INVITE", &keys, t),
            Verdict::Refused("not our nonce")
        );
        for g in [
            "",
            "Basic Ym9iOms=",
            "Digest",
            "Digest username=\"bob",
            "Digest a=b",
        ] {
            assert!(
                matches!(d.verify(g, "INVITE", &keys, t), Verdict::Refused(_)),
                "{g}"
            );
        }
    }
}
