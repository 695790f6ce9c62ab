//! Credentials that request rules inject into upstream requests, so callers never hold
//! them: where each comes from (an environment variable or a file), reading them at
//! start and the files again on reload, and the [`Redactor`] that keeps their values
//! out of everything webproxy writes itself (logs, dead letters, error replies).

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};

use serde_json::Value;
use thiserror::Error;

use crate::error::element_key;
use crate::rules::RequestRules;
use crate::secret_source::read_secret;

/// What replaces a secret value in text webproxy writes.
pub const REDACTED: &str = Redactor::REDACTED;

/// A secret that cannot be read; the message names the rule, the header and the
/// variable or path.
#[derive(Debug, Clone, Error)]
#[error("{key}: {message}")]
pub struct SecretError {
    pub key: String,
    pub message: String,
}

/// One header a rule injects, with its value read.
#[derive(Clone)]
pub struct Injection {
    pub header: String,
    /// The prefix and the secret.
    pub value: String,
    secret: String,
}

impl fmt::Debug for Injection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Injection")
            .field("header", &self.header)
            .field("value", &REDACTED)
            .finish()
    }
}

/// Every rule's injections, read; indexed like the rules.
#[derive(Debug, Default)]
struct Loaded {
    per_rule: Vec<Arc<[Injection]>>,
}

impl Loaded {
    fn secrets(&self) -> Vec<String> {
        self.per_rule
            .iter()
            .flat_map(|injections| injections.iter().map(|i| i.secret.clone()))
            .collect()
    }
}

/// The injected secrets of every rule. Read at start; [`Secrets::reload_files`]
/// re-reads the file secrets (polled, and on SIGHUP) and swaps them in all at once.
#[derive(Debug)]
pub struct Secrets {
    loaded: RwLock<Arc<Loaded>>,
    redactor: Redactor,
}

impl Secrets {
    /// No rule injects anything.
    #[cfg(any(test, feature = "testing"))]
    pub fn empty() -> Secrets {
        Secrets {
            loaded: RwLock::new(Arc::new(Loaded::default())),
            redactor: Redactor::default(),
        }
    }

    /// Reads every rule's secrets from the process environment and the file system,
    /// and tells `redactor` their values.
    pub fn load(rules: &RequestRules, redactor: Redactor) -> Result<Secrets, SecretError> {
        let loaded = read_all(rules, None, &|var| std::env::var(var).ok(), &|path| {
            std::fs::read(path)
        })?;
        redactor.set(loaded.secrets());
        Ok(Secrets {
            loaded: RwLock::new(Arc::new(loaded)),
            redactor,
        })
    }

    /// Re-reads the file secrets and puts them in force when a value differs from
    /// the one in use (`true`); environment secrets keep the value read at start. All
    /// or nothing: on an error the old values stay in use. Contents are compared, not
    /// modification times: a Kubernetes Secret volume is rotated by swapping a
    /// symlink, which leaves the times of the paths read as they were.
    pub fn reload_files(&self, rules: &RequestRules) -> Result<bool, SecretError> {
        let current = self.current();
        let reloaded = read_all(
            rules,
            Some(&current),
            &|var| std::env::var(var).ok(),
            &|path| std::fs::read(path),
        )?;
        if reloaded.secrets() == current.secrets() {
            return Ok(false);
        }
        // The old values stay redacted too: they may still be in flight.
        let mut all = current.secrets();
        all.extend(reloaded.secrets());
        all.sort();
        all.dedup();
        self.redactor.set(all);
        *self.loaded.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(reloaded);
        Ok(true)
    }

    /// The headers the rule at `index` injects.
    pub fn for_rule(&self, index: usize) -> Arc<[Injection]> {
        self.current()
            .per_rule
            .get(index)
            .cloned()
            .unwrap_or_else(|| Arc::from(Vec::new()))
    }

    pub fn redactor(&self) -> &Redactor {
        &self.redactor
    }

    fn current(&self) -> Arc<Loaded> {
        self.loaded
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Reads every rule's injections. With `previous`, environment secrets are taken from
/// it rather than read again.
fn read_all(
    rules: &RequestRules,
    previous: Option<&Loaded>,
    env: &dyn Fn(&str) -> Option<String>,
    read_file: &dyn Fn(&std::path::Path) -> std::io::Result<Vec<u8>>,
) -> Result<Loaded, SecretError> {
    let mut per_rule = Vec::new();
    for (index, rule) in rules.iter().enumerate() {
        let mut injections = Vec::with_capacity(rule.security.inject.len());
        for (header, source) in &rule.security.inject {
            let kept = previous
                .filter(|_| !source.is_file())
                .and_then(|p| p.per_rule.get(index))
                .and_then(|old| old.iter().find(|i| i.header == *header))
                .map(|old| old.secret.clone());
            let secret = match kept {
                Some(secret) => secret,
                None => read_secret(source, env, read_file).map_err(|message| SecretError {
                    key: format!(
                        "{}.inject_headers.{header}",
                        element_key("request_rules", index, Some(&rule.name))
                    ),
                    message,
                })?,
            };
            injections.push(Injection {
                header: header.clone(),
                value: format!("{}{secret}", source.prefix),
                secret,
            });
        }
        per_rule.push(Arc::from(injections));
    }
    Ok(Loaded { per_rule })
}

/// Replaces secret values with [`Redactor::REDACTED`] in text webproxy writes. Cloned handles
/// share the list, so the logger's copy sees values loaded or reloaded later. Its
/// `Debug` shows how many values it knows, never the values.
#[derive(Clone, Default)]
pub struct Redactor {
    state: Arc<RwLock<RedactorState>>,
}

impl fmt::Debug for Redactor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Redactor")
            .field("fixed", &state.fixed.len())
            .field("injected", &state.injected.len())
            .finish()
    }
}

#[derive(Default)]
struct RedactorState {
    /// Set once at start (NATS token, password, seed).
    fixed: Vec<String>,
    /// The injected secrets, replaced on reload.
    injected: Vec<String>,
    /// Both, and their JSON-escaped forms, longest first.
    needles: Arc<Vec<String>>,
}

impl Redactor {
    /// What replaces a secret value in text webproxy writes.
    pub const REDACTED: &str = "[REDACTED]";

    /// Replaces the injected values to redact.
    pub fn set(&self, secrets: Vec<String>) {
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        state.injected = secrets;
        state.needles = Arc::new(needles(state.fixed.iter().chain(&state.injected)));
    }

    /// Adds values that are redacted for the life of the process.
    pub fn add_fixed(&self, secrets: Vec<String>) {
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        state.fixed.extend(secrets);
        state.needles = Arc::new(needles(state.fixed.iter().chain(&state.injected)));
    }

    fn needles(&self) -> Arc<Vec<String>> {
        self.state
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .needles
            .clone()
    }

    /// `text` with every secret value replaced.
    pub fn redact<'a>(&self, text: &'a str) -> Cow<'a, str> {
        replace_needles(&self.needles(), text)
    }

    /// Like [`Redactor::redact`] on bytes that may not be UTF-8 (a log line).
    pub fn redact_bytes<'a>(&self, bytes: &'a [u8]) -> Cow<'a, [u8]> {
        let needles = self.needles();
        let mut out = Cow::Borrowed(bytes);
        for needle in needles.iter() {
            let needle = needle.as_bytes();
            if find(&out, needle).is_some() {
                out = Cow::Owned(replace_bytes(&out, needle, REDACTED.as_bytes()));
            }
        }
        out
    }

    /// How the outputs of the conversation whose envelope is `payload` are redacted:
    /// every secret value but those the envelope itself holds.
    pub fn for_envelope(&self, payload: &[u8]) -> Redaction {
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        let secrets = || {
            state
                .fixed
                .iter()
                .chain(&state.injected)
                .filter(|s| !s.is_empty())
        };
        if secrets().next().is_none() {
            return Redaction {
                needles: state.needles.clone(),
            };
        }
        // Anywhere in the bytes (a number, say) or in a string once read: wherever a
        // caller's text may be quoted back, a guess there must not change it.
        let text = envelope_text(payload);
        let named = |s: &String| find(payload, s.as_bytes()).is_some() || text.contains(s.as_str());
        if !secrets().any(named) {
            return Redaction {
                needles: state.needles.clone(),
            };
        }
        Redaction {
            needles: Arc::new(needles(secrets().filter(|s| !named(s)))),
        }
    }
}

/// What one conversation's outputs (error messages, attempt failures) are redacted
/// with: every secret value except those its caller's own envelope holds. Redacting
/// what the caller wrote would answer a guess, since the text would change exactly
/// when the guess is right; a caller that names a secret learns nothing from seeing it.
#[derive(Clone)]
pub struct Redaction {
    needles: Arc<Vec<String>>,
}

impl fmt::Debug for Redaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redaction")
            .field("needles", &self.needles.len())
            .finish()
    }
}

impl Redaction {
    /// `text` with every secret value this conversation's caller did not name replaced.
    pub fn redact<'a>(&self, text: &'a str) -> Cow<'a, str> {
        replace_needles(&self.needles, text)
    }
}

fn replace_needles<'a>(needles: &[String], text: &'a str) -> Cow<'a, str> {
    let mut out = Cow::Borrowed(text);
    for needle in needles {
        if out.contains(needle.as_str()) {
            out = Cow::Owned(out.replace(needle.as_str(), REDACTED));
        }
    }
    out
}

/// An envelope's text as the caller meant it: its JSON strings and keys with their
/// escapes read (a secret spelled `\u0041...` is still named), one per line; the
/// bytes as UTF-8 when it is not JSON.
fn envelope_text(payload: &[u8]) -> String {
    fn walk(value: &Value, out: &mut String) {
        match value {
            Value::String(s) => {
                out.push_str(s);
                out.push('\n');
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            Value::Object(map) => {
                for (key, v) in map {
                    out.push_str(key);
                    out.push('\n');
                    walk(v, out);
                }
            }
            _ => {}
        }
    }
    match serde_json::from_slice::<Value>(payload) {
        Ok(value) => {
            let mut out = String::new();
            walk(&value, &mut out);
            out
        }
        Err(_) => String::from_utf8_lossy(payload).into_owned(),
    }
}

/// The strings to look for: each secret as it is, as `Debug` prints it, and both as
/// they appear inside a JSON string (JSON log lines, dead letters); longest first, so
/// a secret containing another is replaced whole.
fn needles<'a>(secrets: impl Iterator<Item = &'a String>) -> Vec<String> {
    let json = |text: &str| {
        let quoted = serde_json::to_string(text).unwrap_or_default();
        quoted
            .strip_prefix('"')
            .and_then(|e| e.strip_suffix('"'))
            .unwrap_or_default()
            .to_string()
    };
    let mut needles: Vec<String> = Vec::new();
    for secret in secrets.filter(|s| !s.is_empty()) {
        let debug = secret.escape_debug().to_string();
        needles.push(json(&debug));
        needles.push(json(secret));
        needles.push(debug);
        needles.push(secret.clone());
    }
    needles.retain(|n| !n.is_empty());
    needles.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    needles.dedup();
    needles
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || needle.len() > haystack.len() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn replace_bytes(haystack: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut rest = haystack;
    while let Some(at) = find(rest, needle) {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(with);
        rest = &rest[at + needle.len()..];
    }
    out.extend_from_slice(rest);
    out
}

#[cfg(test)]
mod tests {
    use crate::secret_source::SecretSource;
    use std::collections::HashMap;
    use std::path::Path;

    use super::*;

    fn env_source(var: &str, prefix: &str) -> SecretSource {
        SecretSource {
            env: Some(var.into()),
            file: None,
            prefix: prefix.into(),
        }
    }

    fn file_source(path: &str) -> SecretSource {
        SecretSource {
            env: None,
            file: Some(path.into()),
            prefix: String::new(),
        }
    }

    fn read(source: &SecretSource, files: &HashMap<&str, &str>) -> Result<String, String> {
        let env = |var: &str| (var == "SET").then(|| "from-env".to_string());
        let read_file = |path: &Path| {
            files
                .get(path.to_str().unwrap_or(""))
                .map(|text| text.as_bytes().to_vec())
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        };
        read_secret(source, &env, &read_file)
    }

    #[test]
    fn one_source_exactly() {
        assert!(env_source("X", "").validate().is_ok());
        assert!(file_source("/x").validate().is_ok());
        let both = SecretSource {
            env: Some("X".into()),
            file: Some("/x".into()),
            prefix: String::new(),
        };
        assert!(both.validate().is_err());
        let neither = SecretSource {
            env: None,
            file: None,
            prefix: "Bearer ".into(),
        };
        assert!(neither.validate().is_err());
    }

    #[test]
    fn env_and_file_secrets_are_read_and_trailing_newline_dropped() {
        let files = HashMap::from([
            ("/nl", "tok-1\n"),
            ("/crlf", "tok-2\r\n"),
            ("/plain", "tok-3"),
            ("/two", "tok-4\n\n"),
            ("/inner", "a\nb"),
            ("/empty", "\n"),
        ]);
        assert_eq!(
            read(&env_source("SET", ""), &files).as_deref(),
            Ok("from-env")
        );
        assert_eq!(read(&file_source("/nl"), &files).as_deref(), Ok("tok-1"));
        assert_eq!(read(&file_source("/crlf"), &files).as_deref(), Ok("tok-2"));
        assert_eq!(read(&file_source("/plain"), &files).as_deref(), Ok("tok-3"));
        // Only one trailing newline is dropped; what is left cannot be a header.
        assert!(read(&file_source("/two"), &files).is_err());
        assert!(read(&file_source("/inner"), &files).is_err());
        assert!(read(&file_source("/empty"), &files).is_err());
    }

    #[test]
    fn errors_name_the_variable_or_path() {
        let files = HashMap::new();
        let e = read(&env_source("PARTNER_TOKEN", ""), &files).expect_err("unset");
        assert!(e.contains("PARTNER_TOKEN"), "{e}");
        let e = read(&file_source("/run/secrets/x"), &files).expect_err("missing");
        assert!(e.contains("/run/secrets/x"), "{e}");
    }

    #[test]
    fn redactor_replaces_raw_and_json_escaped_values() {
        let redactor = Redactor::default();
        redactor.set(vec!["s3cr\"et".into(), "tok".into()]);
        assert_eq!(
            redactor.redact("a s3cr\"et and tok"),
            format!("a {REDACTED} and {REDACTED}")
        );
        assert_eq!(
            redactor.redact_bytes(br#"{"v":"s3cr\"et"}"#).as_ref(),
            format!(r#"{{"v":"{REDACTED}"}}"#).as_bytes()
        );
        assert!(matches!(redactor.redact("clean"), Cow::Borrowed(_)));
        redactor.add_fixed(vec!["nats-pw".into()]);
        redactor.set(vec!["new".into()]);
        assert_eq!(
            redactor.redact("nats-pw tok new"),
            format!("{REDACTED} tok {REDACTED}")
        );
    }

    #[test]
    fn a_conversation_keeps_the_secrets_its_own_envelope_names() {
        let redactor = Redactor::default();
        redactor.set(vec!["tok-123".into(), "other-9".into()]);
        let text = "failed for http://h/?q=tok-123 with other-9";
        let clean = br#"{"id":"a","url":"http://h/?q=tok-124"}"#;
        assert_eq!(
            redactor.for_envelope(clean).redact(text),
            format!("failed for http://h/?q={REDACTED} with {REDACTED}")
        );
        // Named raw, JSON-escaped, or as a key: the caller knows it, and redacting it
        // would confirm the guess.
        for named in [
            br#"{"id":"a","url":"http://h/?q=tok-123"}"#.as_slice(),
            br#"{"id":"a","headers":{"X":"tok\u002d123"}}"#.as_slice(),
            br#"{"id":"a","metadata":{"tok-123":1}}"#.as_slice(),
            b"\xff not json tok-123".as_slice(),
        ] {
            assert_eq!(
                redactor.for_envelope(named).redact(text),
                format!("failed for http://h/?q=tok-123 with {REDACTED}"),
                "{}",
                String::from_utf8_lossy(named)
            );
        }
    }

    /// Every `Debug` path that holds secret values: the redactor (its state holds
    /// every value it redacts), a conversation's redaction and the loaded secrets.
    #[test]
    fn debug_of_the_redactor_and_the_secrets_shows_no_value() {
        let redactor = Redactor::default();
        redactor.add_fixed(vec!["nats-pw-91".into()]);
        redactor.set(vec!["injected-77".into()]);
        let redaction = redactor.for_envelope(b"{}");
        let shown = format!("{redactor:?} {redactor:#?} {redaction:?} {redaction:#?}");
        assert!(
            !shown.contains("nats-pw-91") && !shown.contains("injected-77"),
            "{shown}"
        );
        assert!(shown.contains("fixed: 1"), "{shown}");
        let secrets = Secrets {
            loaded: RwLock::new(Arc::new(Loaded {
                per_rule: vec![Arc::from(vec![Injection {
                    header: "Authorization".into(),
                    value: "Bearer injected-77".into(),
                    secret: "injected-77".into(),
                }])],
            })),
            redactor,
        };
        let shown = format!("{secrets:?} {secrets:#?}");
        assert!(
            !shown.contains("injected-77") && !shown.contains("nats-pw-91"),
            "{shown}"
        );
    }

    #[test]
    fn debug_output_hides_injected_values() {
        let injection = Injection {
            header: "Authorization".into(),
            value: "Bearer tok".into(),
            secret: "tok".into(),
        };
        let shown = format!("{injection:?}");
        assert!(!shown.contains("tok"), "{shown}");
        assert!(shown.contains(REDACTED));
    }
}
