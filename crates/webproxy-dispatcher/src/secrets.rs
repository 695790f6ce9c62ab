//! Credentials that request rules inject into upstream requests, so callers never hold
//! them: where each comes from (an environment variable or a file), reading them at
//! start and the files again on reload, and the [`Redactor`] that keeps their values
//! out of everything webproxy writes itself (logs, dead letters, error replies).

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};

use serde_json::Value;
use thiserror::Error;

use crate::rules::RequestRules;
use crate::secret_source::read_secret;

/// What replaces a secret value in text webproxy writes.
pub(crate) const REDACTED: &str = Redactor::REDACTED;

/// A secret that cannot be read; the message names the rule, the header and the
/// variable or path.
#[derive(Debug, Clone, Error)]
#[error("{key}: {message}")]
pub struct SecretError {
    pub(crate) key: String,
    pub(crate) message: String,
}

/// One header a rule injects, with its value read.
#[derive(Clone)]
pub(crate) struct Injection {
    pub(crate) header: String,
    /// The prefix and the secret.
    pub(crate) value: String,
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
    #[cfg(test)]
    pub(crate) fn empty() -> Secrets {
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
    pub(crate) fn for_rule(&self, index: usize) -> Arc<[Injection]> {
        self.current()
            .per_rule
            .get(index)
            .cloned()
            .unwrap_or_else(|| Arc::from(Vec::new()))
    }

    pub(crate) fn redactor(&self) -> &Redactor {
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
                        "request_rules[{index}] ({}).inject_headers.{header}",
                        rule.name
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
        let needles = self.needles();
        let mut out = Cow::Borrowed(text);
        for needle in needles.iter() {
            if out.contains(needle.as_str()) {
                out = Cow::Owned(out.replace(needle.as_str(), REDACTED));
            }
        }
        out
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

    /// A request payload with secret values redacted inside its JSON strings, so it
    /// stays valid JSON; a payload that is not JSON is redacted as bytes. Untouched
    /// (byte for byte) when it contains no secret.
    pub(crate) fn redact_payload<'a>(&self, payload: &'a [u8]) -> Cow<'a, [u8]> {
        let needles = self.needles();
        if !needles
            .iter()
            .any(|n| find(payload, n.as_bytes()).is_some())
        {
            return Cow::Borrowed(payload);
        }
        match serde_json::from_slice::<Value>(payload) {
            Ok(mut value) => {
                self.redact_value(&mut value);
                Cow::Owned(serde_json::to_vec(&value).unwrap_or_default())
            }
            Err(_) => Cow::Owned(self.redact_bytes(payload).into_owned()),
        }
    }

    fn redact_value(&self, value: &mut Value) {
        match value {
            Value::String(s) => {
                if let Cow::Owned(redacted) = self.redact(s) {
                    *s = redacted;
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| self.redact_value(v)),
            Value::Object(map) => {
                let keys: Vec<String> = map.keys().cloned().collect();
                for key in keys {
                    if let Some(mut v) = map.remove(&key) {
                        self.redact_value(&mut v);
                        map.insert(self.redact(&key).into_owned(), v);
                    }
                }
            }
            _ => {}
        }
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
    use std::collections::HashMap;
    use std::path::Path;

    use super::*;
    use crate::secret_source::SecretSource;

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
    fn a_redacted_payload_stays_json_and_a_clean_one_is_untouched() {
        let redactor = Redactor::default();
        redactor.set(vec!["tok-123".into()]);
        let clean = br#"{"id":"a",  "headers":{"X":"y"}}"#;
        assert!(matches!(redactor.redact_payload(clean), Cow::Borrowed(_)));
        let dirty = br#"{"id":"a","headers":{"Authorization":"Bearer tok-123"}}"#;
        let redacted = redactor.redact_payload(dirty);
        let value: Value = serde_json::from_slice(&redacted).expect("json");
        assert_eq!(
            value["headers"]["Authorization"],
            format!("Bearer {REDACTED}")
        );
        assert_eq!(
            redactor.redact_payload(b"\xff tok-123").as_ref(),
            b"\xff [REDACTED]"
        );
    }

    /// Every `Debug` path that holds secret values: the redactor (its state holds
    /// every value it redacts) and the loaded secrets.
    #[test]
    fn debug_of_the_redactor_and_the_secrets_shows_no_value() {
        let redactor = Redactor::default();
        redactor.add_fixed(vec!["nats-pw-91".into()]);
        redactor.set(vec!["injected-77".into()]);
        let shown = format!("{redactor:?} {redactor:#?}");
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
