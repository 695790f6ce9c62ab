//! Subject, stream and consumer names, all derived from one configurable prefix so
//! that two deployments with different prefixes can share a NATS account.

use crate::name::InvalidName;
use crate::origin::Origin;

fn is_token_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

/// A conversation id: 1 to 128 characters of `[A-Za-z0-9_-]`, so it is one subject token.
pub fn validate_id(id: &str) -> Result<(), InvalidName> {
    if id.is_empty() || id.len() > 128 {
        return Err(InvalidName(format!(
            "must be 1 to 128 characters long, got {}",
            id.len()
        )));
    }
    if let Some(c) = id.chars().find(|c| !is_token_char(*c)) {
        return Err(InvalidName(format!(
            "may contain only A-Z, a-z, 0-9, '_' and '-', found {c:?}"
        )));
    }
    Ok(())
}

/// Endings a pool name may not have: pool `x`'s replies and dead-letter streams are
/// named like the work streams of pools `x_replies` and `x_dead` would be.
const RESERVED_POOL_SUFFIXES: [&str; 2] = ["_replies", "_dead"];

/// A pool name: 1 to 32 of `[a-z0-9_-]`, not ending in `_replies` or `_dead`.
pub fn validate_pool_name(pool: &str) -> Result<(), InvalidName> {
    let ok = !pool.is_empty()
        && pool.len() <= 32
        && pool
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
    if !ok {
        return Err(InvalidName(format!(
            "pool name {pool:?} must be 1 to 32 characters of a-z, 0-9, '_' and '-'"
        )));
    }
    if let Some(suffix) = RESERVED_POOL_SUFFIXES
        .iter()
        .find(|suffix| pool.ends_with(*suffix))
    {
        return Err(InvalidName(format!(
            "pool name {pool:?} must not end in {suffix:?}: the replies and dead-letter streams of a pool without it have that name"
        )));
    }
    Ok(())
}

/// A caller name, the optional last token of a request subject
/// (`<prefix>.request.<pool>.<caller>`): 1 to 64 characters of `[A-Za-z0-9_-]`. NATS
/// permissions decide who may publish under which name; the service takes the name
/// from the subject and checks the request's `reply_to` against that caller's space.
pub fn validate_caller(caller: &str) -> Result<(), InvalidName> {
    let ok = !caller.is_empty() && caller.len() <= 64 && caller.chars().all(is_token_char);
    if ok {
        Ok(())
    } else {
        Err(InvalidName(format!(
            "caller name {caller:?} must be 1 to 64 characters of A-Z, a-z, 0-9, '_' and '-'"
        )))
    }
}

/// The token of a `reply_to_allow` pattern that stands for the caller's own name, as its
/// request subject gives it: `callers.{caller}.replies.>` allows caller `a` the subjects
/// under `callers.a.replies.` and nothing of caller `b`'s.
pub const CALLER_PLACEHOLDER: &str = "{caller}";

/// What a custom `reply_to` may be when `reply_to_allow` is empty: the NATS default
/// inboxes, whose names are random and which no stream captures.
pub const DEFAULT_REPLY_TO_ALLOW: &str = "_INBOX.>";

/// The subject prefix: one or more dot-separated tokens of `[A-Za-z0-9_-]`.
pub fn validate_prefix(prefix: &str) -> Result<(), InvalidName> {
    let ok = !prefix.is_empty()
        && prefix
            .split('.')
            .all(|t| !t.is_empty() && t.chars().all(is_token_char));
    if ok {
        Ok(())
    } else {
        Err(InvalidName(format!(
            "prefix {prefix:?} must be dot-separated tokens of A-Z, a-z, 0-9, '_' and '-'"
        )))
    }
}

/// A literal NATS subject: non-empty tokens, no wildcards, no white space.
pub fn validate_subject_literal(subject: &str) -> Result<(), InvalidName> {
    if subject.is_empty() {
        return Err(InvalidName("must not be empty".into()));
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return Err(InvalidName(format!("{subject:?} has an empty token")));
        }
        if token.contains(['*', '>']) {
            return Err(InvalidName(format!("{subject:?} contains a wildcard")));
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(InvalidName(format!("{subject:?} contains white space")));
        }
    }
    Ok(())
}

/// A subject pattern: non-empty tokens, `*` matching one token and `>` (last only)
/// matching one or more.
pub fn validate_subject_pattern(pattern: &str) -> Result<(), InvalidName> {
    let tokens: Vec<&str> = pattern.split('.').collect();
    for (i, token) in tokens.iter().enumerate() {
        if token.is_empty() {
            return Err(InvalidName(format!("{pattern:?} has an empty token")));
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(InvalidName(format!("{pattern:?} contains white space")));
        }
        let wildcard = *token == "*" || *token == ">";
        if !wildcard && token.contains(['*', '>']) {
            return Err(InvalidName(format!(
                "{pattern:?}: a wildcard must be a whole token"
            )));
        }
        if *token == ">" && i + 1 != tokens.len() {
            return Err(InvalidName(format!(
                "{pattern:?}: `>` may only be the last token"
            )));
        }
    }
    Ok(())
}

/// Whether the literal `subject` matches `pattern` as NATS matches subscriptions.
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for token in pattern.split('.') {
        match (token, subject_tokens.next()) {
            (">", Some(_)) => return true,
            (_, None) => return false,
            ("*", Some(_)) => {}
            (literal, Some(actual)) if literal == actual => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

/// The first token of the private inbox prefix webproxy's own connections use
/// (`_WEBPROXY_INBOX.<random>`), so that no caller's `reply_to` can name the subjects
/// on which the service receives its JetStream API responses and publish acks.
/// Callers keep the NATS default, `_INBOX.`.
pub const SERVICE_INBOX: &str = "_WEBPROXY_INBOX";

/// Every subject, stream and consumer name of one deployment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
    stream_prefix: String,
    /// Patterns a custom `reply_to` must match, each token [`CALLER_PLACEHOLDER`]
    /// standing for the caller's name; empty allows only [`DEFAULT_REPLY_TO_ALLOW`].
    reply_to_allow: Vec<String>,
}

impl Subjects {
    /// Names under `prefix`; see [`validate_prefix`].
    pub fn new(prefix: &str) -> Result<Self, InvalidName> {
        validate_prefix(prefix)?;
        Ok(Subjects {
            prefix: prefix.to_string(),
            stream_prefix: prefix.replace('.', "_").to_ascii_uppercase(),
            reply_to_allow: Vec::new(),
        })
    }

    /// Confines custom `reply_to` subjects to `patterns` (on top of the reserved
    /// prefixes); empty allows only [`DEFAULT_REPLY_TO_ALLOW`]. Each is checked with
    /// [`validate_subject_pattern`], [`CALLER_PLACEHOLDER`] only as a whole token; the
    /// error gives the index.
    pub fn with_reply_to_allow(
        mut self,
        patterns: &[String],
    ) -> Result<Self, (usize, InvalidName)> {
        for (i, pattern) in patterns.iter().enumerate() {
            let stray = pattern
                .split('.')
                .any(|token| token != CALLER_PLACEHOLDER && token.contains(['{', '}']));
            if stray {
                return Err((
                    i,
                    InvalidName(format!(
                        "{pattern:?}: {CALLER_PLACEHOLDER} must be a whole token, and no other braces are allowed"
                    )),
                ));
            }
            validate_subject_pattern(&pattern.replace(CALLER_PLACEHOLDER, "caller"))
                .map_err(|e| (i, e))?;
        }
        self.reply_to_allow = patterns.to_vec();
        Ok(self)
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Where callers publish requests for `pool` with no caller name: their `reply_to`
    /// may use only the `reply_to_allow` patterns that name no caller.
    pub fn request(&self, pool: &str) -> String {
        format!("{}.request.{pool}", self.prefix)
    }

    /// Where caller `caller` publishes requests for `pool`, when NATS permissions let it
    /// publish only under its own name: `<prefix>.request.<pool>.<caller>`.
    pub fn caller_request(&self, pool: &str, caller: &str) -> String {
        format!("{}.request.{pool}.{caller}", self.prefix)
    }

    /// Every named caller's request subject of `pool`.
    pub fn caller_requests(&self, pool: &str) -> String {
        format!("{}.request.{pool}.*", self.prefix)
    }

    /// Whether `subject` is one of `pool`'s request subjects and, if so, the caller it
    /// names: `Some(None)` for `<prefix>.request.<pool>`, `Some(Some(caller))` for a
    /// named caller's, `None` for any other subject (a hop, or nothing of this pool).
    pub fn request_caller<'s>(&self, pool: &str, subject: &'s str) -> Option<Option<&'s str>> {
        let rest = subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".request.")?
            .strip_prefix(pool)?;
        if rest.is_empty() {
            return Some(None);
        }
        let caller = rest.strip_prefix('.')?;
        validate_caller(caller).ok()?;
        Some(Some(caller))
    }

    /// Where the service parks one conversation's request until its next attempt is
    /// due. Service-only: callers' permissions deny it.
    pub fn retry(&self, pool: &str, token: &str) -> String {
        format!("{}.retry.{pool}.{token}", self.prefix)
    }

    /// Every parked retry of `pool`: the retry consumer's filter.
    pub fn retry_filter(&self, pool: &str) -> String {
        format!("{}.retry.{pool}.>", self.prefix)
    }

    /// Where the service hands one conversation's request to `pool` again: a move to
    /// the rule's pool, a retry that came due, or a replay. Service-only.
    pub fn hop(&self, pool: &str, token: &str) -> String {
        format!("{}.hop.{pool}.{token}", self.prefix)
    }

    /// Where the service moves one conversation's request into `pool` under a rule
    /// that names that pool: a hop subject of its own, with the caller's name when the
    /// request had one, so that the requests moved into a pool can be counted against
    /// their caller's `max_waiting` apart from retries and replays. Service-only.
    pub fn moved(&self, pool: &str, caller: Option<&str>, token: &str) -> String {
        match caller {
            None => format!("{}.hop.{pool}.move.{token}", self.prefix),
            Some(caller) => format!("{}.hop.{pool}.move.{caller}.{token}", self.prefix),
        }
    }

    /// Every request of `caller` (or of no named caller) moved into `pool` and not yet
    /// taken.
    pub fn moved_filter(&self, pool: &str, caller: Option<&str>) -> String {
        match caller {
            None => format!("{}.hop.{pool}.move.*", self.prefix),
            Some(caller) => format!("{}.hop.{pool}.move.{caller}.*", self.prefix),
        }
    }

    /// Every hop into `pool`: with the request subject, the pool consumer's filter.
    pub fn hop_filter(&self, pool: &str) -> String {
        format!("{}.hop.{pool}.>", self.prefix)
    }

    /// The live reply of conversations with id `id`, published with core NATS and not
    /// stored. Any caller may reuse an id, so a caller keeps only the replies whose
    /// `Webproxy-Origin` is its own.
    pub fn reply(&self, id: &str) -> String {
        format!("{}.reply.{id}", self.prefix)
    }

    /// The stored reply of exactly one conversation: `<prefix>.reply.<id>.<STREAM>.<seq>`.
    pub fn stored_reply(&self, id: &str, origin: &Origin) -> String {
        format!(
            "{}.reply.{id}.{}.{}",
            self.prefix, origin.stream, origin.seq
        )
    }

    /// What layout 2's shared replies stream captured: every pool's stored replies,
    /// never the live copies. Since layout 3 each pool stream's replies have a stream
    /// of their own ([`Subjects::pool_replies_filter`]).
    pub fn stored_reply_wildcard(&self) -> String {
        format!("{}.reply.*.*.*", self.prefix)
    }

    /// What the replies stream of the pool stream `pool_stream` captures: the stored
    /// replies of the conversations that started there, `<prefix>.reply.*.<STREAM>.*`.
    /// Disjoint from every other pool stream's, and from the live copies.
    pub fn pool_replies_filter(&self, pool_stream: &str) -> String {
        format!("{}.reply.*.{pool_stream}.*", self.prefix)
    }

    /// Where failed conversations of `pool` are copied.
    pub fn dead(&self, pool: &str) -> String {
        format!("{}.dead.{pool}", self.prefix)
    }

    /// Where the service marks a dead letter of `pool` superseded: a stalled delivery
    /// wrote it, and another delivery of the same conversation answered with a response
    /// (`dead list` and `dead replay` skip it).
    pub fn dead_superseded(&self, pool: &str) -> String {
        format!("{}.dead.{pool}.superseded", self.prefix)
    }

    /// The dead letters of every pool, without the superseded marks.
    pub fn dead_letters_wildcard(&self) -> String {
        format!("{}.dead.*", self.prefix)
    }

    /// The superseded marks of every pool.
    pub fn dead_superseded_wildcard(&self) -> String {
        format!("{}.dead.*.superseded", self.prefix)
    }

    /// Every reply subject, live and stored (layout 1's replies stream captured it).
    pub fn reply_wildcard(&self) -> String {
        format!("{}.reply.>", self.prefix)
    }

    /// Every dead-letter subject.
    pub fn dead_wildcard(&self) -> String {
        format!("{}.dead.>", self.prefix)
    }

    /// The work stream of `pool`, e.g. `WEBPROXY_POOL_DEFAULT`.
    pub fn pool_stream(&self, pool: &str) -> String {
        format!("{}_POOL_{}", self.stream_prefix, pool.to_ascii_uppercase())
    }

    /// Layout 2's stream of every pool's stored replies, `WEBPROXY_REPLIES`. Layout 3
    /// retires it: its subjects become [`Subjects::retired_replies_subject`], and what
    /// it stored stays readable by subject until it ages out (`reply_max_age`), so a
    /// reader that finds nothing in [`Subjects::replies_stream_of`] looks here.
    pub fn replies_stream(&self) -> String {
        format!("{}_REPLIES", self.stream_prefix)
    }

    /// Layout 2's stream of every pool's dead letters, `WEBPROXY_DEAD`, retired like
    /// [`Subjects::replies_stream`] (subjects [`Subjects::retired_dead_subject`]).
    pub fn dead_stream(&self) -> String {
        format!("{}_DEAD", self.stream_prefix)
    }

    /// The stream that stores the replies of the conversations whose origin is in the
    /// pool stream `pool_stream`: `<pool_stream>_REPLIES`, e.g.
    /// `WEBPROXY_POOL_DEFAULT_REPLIES`. A client derives it from an origin alone
    /// ([`Subjects::replies_stream_of`]); each has its own `reply_max_bytes`, so one
    /// pool's flood cannot evict another pool's replies.
    pub fn pool_replies_stream(&self, pool_stream: &str) -> String {
        format!("{pool_stream}_REPLIES")
    }

    /// The stream that holds the stored reply of the conversation `origin`.
    pub fn replies_stream_of(&self, origin: &Origin) -> String {
        self.pool_replies_stream(&origin.stream)
    }

    /// The stream that stores `pool`'s dead letters and superseded marks,
    /// `<pool stream>_DEAD`, e.g. `WEBPROXY_POOL_DEFAULT_DEAD`, with its own
    /// `dead_max_bytes`.
    pub fn pool_dead_stream(&self, pool: &str) -> String {
        format!("{}_DEAD", self.pool_stream(pool))
    }

    /// Where callers ask the service for a stored body's chunks: `<prefix>.body.get`.
    pub fn body_get(&self) -> String {
        format!("{}.body.get", self.prefix)
    }

    /// Where callers take a request back: `<prefix>.cancel`.
    pub fn cancel(&self) -> String {
        format!("{}.cancel", self.prefix)
    }

    /// Where operators cancel by origin alone: `<prefix>.admin.cancel`, which only the
    /// operator role may publish.
    pub fn admin_cancel(&self) -> String {
        format!("{}.admin.cancel", self.prefix)
    }

    /// Where callers upload a large request body for `pool`: `<prefix>.body.put.<pool>`.
    pub fn body_put(&self, pool: &str) -> String {
        format!("{}.body.put.{pool}", self.prefix)
    }

    /// A named caller's upload subject for `pool`: `<prefix>.body.put.<pool>.<caller>`.
    pub fn caller_body_put(&self, pool: &str, caller: &str) -> String {
        format!("{}.body.put.{pool}.{caller}", self.prefix)
    }

    /// Every upload subject, for the service's subscription.
    pub fn body_put_filter(&self) -> String {
        format!("{}.body.put.>", self.prefix)
    }

    /// The pool and caller an upload subject names; `None` for any other subject.
    pub fn body_put_target<'s>(&self, subject: &'s str) -> Option<(&'s str, Option<&'s str>)> {
        let rest = subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(".body.put.")?;
        let (pool, caller) = match rest.split_once('.') {
            Some((pool, caller)) => (pool, Some(caller)),
            None => (rest, None),
        };
        validate_pool_name(pool).ok()?;
        if let Some(caller) = caller {
            validate_caller(caller).ok()?;
        }
        Some((pool, caller))
    }

    /// The Object Store bucket of `pool`'s uploads, `<pool stream>_UPLOADS`, whose
    /// stream's `max_bytes` is the pool's upload quota.
    pub fn pool_upload_bucket(&self, pool: &str) -> String {
        Subjects::upload_bucket_of(&self.pool_stream(pool))
    }

    /// The upload store of the pool whose work stream is `pool_stream`, as an origin
    /// names it.
    pub fn upload_bucket_of(pool_stream: &str) -> String {
        format!("{pool_stream}_UPLOADS")
    }

    /// The chunk token of upload `name` in its store: `up_<name>`.
    pub fn upload_token(name: &str) -> String {
        format!("up_{name}")
    }

    /// The body store that keeps the receipts of conversations that started in
    /// `pool_stream`: `<pool stream>_BODIES`, found from an origin alone.
    pub fn body_bucket_of(pool_stream: &str) -> String {
        format!("{pool_stream}_BODIES")
    }

    /// The subject of the receipt of the conversation `<stream>:<seq>` in `bucket`:
    /// which body its latest generation stored, and the capability's hash.
    pub fn body_receipt(bucket: &str, origin: &Origin) -> String {
        format!("$O.{bucket}.R.{}.{}", origin.stream, origin.seq)
    }

    /// Every receipt subject of `bucket`.
    pub fn body_receipts(bucket: &str) -> String {
        format!("$O.{bucket}.R.>")
    }

    /// The Object Store bucket that keeps `pool`'s large bodies, `<pool stream>_BODIES`
    /// (e.g. `WEBPROXY_POOL_DEFAULT_BODIES`), with its own `body_max_bytes`; its stream
    /// is [`Subjects::object_stream`] of it.
    pub fn pool_body_bucket(&self, pool: &str) -> String {
        Subjects::body_bucket_of(&self.pool_stream(pool))
    }

    /// The stream of Object Store bucket `bucket`, `OBJ_<bucket>`, as every Object
    /// Store client names it.
    pub fn object_stream(bucket: &str) -> String {
        format!("OBJ_{bucket}")
    }

    /// The subject of `bucket`'s chunks of the object whose chunk token is `token`.
    pub fn object_chunks(bucket: &str, token: &str) -> String {
        format!("$O.{bucket}.C.{token}")
    }

    /// The subject of the metadata of `bucket`'s object `encoded_name` (its name in
    /// padded base64url).
    pub fn object_meta(bucket: &str, encoded_name: &str) -> String {
        format!("$O.{bucket}.M.{encoded_name}")
    }

    /// The subject the retired [`Subjects::replies_stream`] captures once layout 3
    /// took its subjects away: nothing publishes on it. Its only purpose is that the
    /// stream keeps a subject that overlaps no other stream's.
    pub fn retired_replies_subject(&self) -> String {
        format!("{}.retired.replies", self.prefix)
    }

    /// The subject the retired [`Subjects::dead_stream`] captures; nothing publishes
    /// on it.
    pub fn retired_dead_subject(&self) -> String {
        format!("{}.retired.dead", self.prefix)
    }

    /// The KV bucket of progress records (conversations that parked or moved).
    pub fn progress_bucket(&self) -> String {
        format!("{}_PROGRESS", self.stream_prefix)
    }

    /// The KV bucket of recorded cancels, keyed `<STREAM>.<seq>.<generation>`.
    pub fn cancel_bucket(&self) -> String {
        format!("{}_CANCELS", self.stream_prefix)
    }

    /// The KV bucket that holds the cluster part of the configuration, with history,
    /// when `[config] source = "kv"`.
    pub fn config_bucket(&self) -> String {
        format!("{}_CONFIG", self.stream_prefix)
    }

    /// The KV bucket where every running instance reports the configuration revision
    /// it runs (a heartbeat, expiring with the instance).
    pub fn instances_bucket(&self) -> String {
        format!("{}_INSTANCES", self.stream_prefix)
    }

    /// The KV bucket of each pool's runtime state, one key per pool: its pauses (each
    /// with a reason and an end) and an adaptive limit, which the owner of the pool
    /// consumers' settings applies on top of the configured limits.
    pub fn pool_state_bucket(&self) -> String {
        format!("{}_POOL_STATE", self.stream_prefix)
    }

    /// The KV bucket of the pools' rate schedules, one key per pool with a `rate`: the
    /// time of its next unclaimed slot.
    pub fn rate_bucket(&self) -> String {
        format!("{}_RATE", self.stream_prefix)
    }

    /// The KV bucket of the HTTP gateway's minted conversation ids: each id's route,
    /// token identity and origin, kept for `reply_max_age`.
    pub fn gateway_bucket(&self) -> String {
        format!("{}_GATEWAY", self.stream_prefix)
    }

    /// The KV bucket holding the HTTP gateway's shared HMAC key when `[gateway] key`
    /// is unset: created once with compare-and-set, kept without an age limit.
    pub fn gateway_key_bucket(&self) -> String {
        format!("{}_GATEWAY_KEY", self.stream_prefix)
    }

    /// The durable consumer of `pool`'s request and hop subjects, e.g.
    /// `webproxy-default-l3`. The suffix names the stream layout: a layout's consumers
    /// get names of their own, so that an instance of an older layout cannot find, and
    /// take messages from, a consumer of a newer one.
    pub fn pool_consumer(&self, pool: &str) -> String {
        format!("{}-{pool}-l3", self.consumer_prefix())
    }

    /// The durable consumer of `pool`'s retry subjects, e.g. `webproxy-default-retry-l3`.
    pub fn retry_consumer(&self, pool: &str) -> String {
        format!("{}-{pool}-retry-l3", self.consumer_prefix())
    }

    /// Layout 2's pool consumer (`webproxy-<pool>-l2`), which a migration to layout 3
    /// deletes.
    pub fn layout2_pool_consumer(&self, pool: &str) -> String {
        format!("{}-{pool}-l2", self.consumer_prefix())
    }

    /// Layout 2's retry consumer (`webproxy-<pool>-retry-l2`), which a migration
    /// deletes.
    pub fn layout2_retry_consumer(&self, pool: &str) -> String {
        format!("{}-{pool}-retry-l2", self.consumer_prefix())
    }

    fn consumer_prefix(&self) -> String {
        self.prefix.replace('.', "_")
    }

    /// Layout 1's pool consumer (`webproxy-<pool>`, filter `<prefix>.request.<pool>`),
    /// which a migration to layout 2 deletes.
    pub fn layout1_pool_consumer(&self, pool: &str) -> String {
        format!("{}-{pool}", self.consumer_prefix())
    }

    /// Layout 1's retry consumer (`webproxy-<pool>-retry`), which a migration deletes.
    pub fn layout1_retry_consumer(&self, pool: &str) -> String {
        format!("{}-{pool}-retry", self.consumer_prefix())
    }

    /// Layout 1's one retry subject of a pool, `<prefix>.retry.<pool>`: its parked
    /// retries are migrated once, and afterwards the pool's fence stream captures it.
    pub fn layout1_retry(&self, pool: &str) -> String {
        format!("{}.retry.{pool}", self.prefix)
    }

    /// The fence of a pool stream, e.g. `WEBPROXY_FENCE_POOL_DEFAULT`: a tiny stream
    /// that captures [`Subjects::layout1_retry`], so that an instance of layout 1,
    /// which lists that subject in its pool stream, cannot rewrite the pool stream.
    pub fn pool_fence_stream(&self, pool: &str) -> String {
        format!(
            "{}_FENCE_POOL_{}",
            self.stream_prefix,
            pool.to_ascii_uppercase()
        )
    }

    /// The fence of the replies stream, `WEBPROXY_FENCE_REPLIES`: it captures
    /// [`Subjects::replies_fence_subject`].
    pub fn replies_fence_stream(&self) -> String {
        format!("{}_FENCE_REPLIES", self.stream_prefix)
    }

    /// `<prefix>.reply.*.*`: overlaps layout 1's `<prefix>.reply.>`, not the stored
    /// replies' `<prefix>.reply.*.*.*`, and nothing is ever published on it.
    pub fn replies_fence_subject(&self) -> String {
        format!("{}.reply.*.*", self.prefix)
    }

    /// Whether a caller may name `subject` as its `reply_to`: a literal subject outside
    /// the service's own namespace (except exactly its own default reply subject),
    /// outside every server subject (those that start with `$`: `$JS.`, `$SYS.`,
    /// `$KV.`, `$O.`, `$MQTT.`, `$SRV.`, ...) and outside webproxy's private inboxes
    /// ([`SERVICE_INBOX`]), and inside the space `reply_to_allow` gives `caller`: the
    /// patterns that name no caller, and those with [`CALLER_PLACEHOLDER`] read as
    /// `caller`'s own name. `caller` is the name on the request subject; a request
    /// without one gets no pattern that names a caller.
    pub fn check_reply_to(
        &self,
        subject: &str,
        id: &str,
        caller: Option<&str>,
    ) -> Result<(), InvalidName> {
        validate_subject_literal(subject)?;
        if subject == self.reply(id) {
            return Ok(());
        }
        if subject.starts_with('$') {
            return Err(InvalidName(format!(
                "{subject:?} is a server subject: every subject that starts with '$' is reserved"
            )));
        }
        let first_token = |prefix: &str| {
            subject
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
        };
        for reserved in [self.prefix.as_str(), SERVICE_INBOX] {
            if first_token(reserved) {
                return Err(InvalidName(format!(
                    "{subject:?} is under the reserved prefix \"{reserved}.\""
                )));
            }
        }
        if self.reply_to_allow.is_empty() {
            return if subject_matches(DEFAULT_REPLY_TO_ALLOW, subject) {
                Ok(())
            } else {
                Err(InvalidName(format!(
                    "{subject:?} is not an {DEFAULT_REPLY_TO_ALLOW:?} inbox, the only custom reply subjects allowed while [streams] reply_to_allow is empty"
                )))
            };
        }
        let allowed = self.reply_to_allow.iter().any(|pattern| {
            match (pattern.contains(CALLER_PLACEHOLDER), caller) {
                (false, _) => subject_matches(pattern, subject),
                (true, Some(caller)) => {
                    subject_matches(&pattern.replace(CALLER_PLACEHOLDER, caller), subject)
                }
                (true, None) => false,
            }
        });
        if allowed {
            return Ok(());
        }
        Err(InvalidName(match caller {
            Some(caller) => format!(
                "{subject:?} is outside caller {caller:?}'s reply subjects ([streams] reply_to_allow)"
            ),
            None => format!(
                "{subject:?} matches none of the reply subjects allowed to a request without a caller name ([streams] reply_to_allow; a caller's own name comes from its request subject, <prefix>.request.<pool>.<caller>)"
            ),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subjects() -> Subjects {
        Subjects::new("webproxy").expect("valid prefix")
    }

    #[test]
    fn names_derive_from_prefix() {
        let s = subjects();
        assert_eq!(s.request("default"), "webproxy.request.default");
        assert_eq!(s.retry("p1", "t0"), "webproxy.retry.p1.t0");
        assert_eq!(s.retry_filter("p1"), "webproxy.retry.p1.>");
        assert_eq!(s.hop("p1", "t0"), "webproxy.hop.p1.t0");
        assert_eq!(s.hop_filter("p1"), "webproxy.hop.p1.>");
        let origin = Origin::new("WEBPROXY_POOL_P1", 7);
        assert_eq!(
            s.stored_reply("order-42", &origin),
            "webproxy.reply.order-42.WEBPROXY_POOL_P1.7"
        );
        assert!(subject_matches(
            &s.stored_reply_wildcard(),
            &s.stored_reply("order-42", &origin)
        ));
        assert!(!subject_matches(
            &s.stored_reply_wildcard(),
            &s.reply("order-42")
        ));
        assert_eq!(s.progress_bucket(), "WEBPROXY_PROGRESS");
        assert_eq!(s.config_bucket(), "WEBPROXY_CONFIG");
        assert_eq!(s.instances_bucket(), "WEBPROXY_INSTANCES");
        assert_eq!(s.pool_state_bucket(), "WEBPROXY_POOL_STATE");
        assert_eq!(s.rate_bucket(), "WEBPROXY_RATE");
        assert_eq!(s.reply("order-42"), "webproxy.reply.order-42");
        assert_eq!(s.dead("p1"), "webproxy.dead.p1");
        assert_eq!(s.dead_superseded("p1"), "webproxy.dead.p1.superseded");
        assert_eq!(s.pool_stream("default"), "WEBPROXY_POOL_DEFAULT");
        assert_eq!(s.replies_stream(), "WEBPROXY_REPLIES");
        assert_eq!(s.dead_stream(), "WEBPROXY_DEAD");
        assert_eq!(s.pool_consumer("default"), "webproxy-default-l3");
        assert_eq!(s.retry_consumer("default"), "webproxy-default-retry-l3");
        assert_eq!(s.layout2_pool_consumer("default"), "webproxy-default-l2");
        assert_eq!(
            s.layout2_retry_consumer("default"),
            "webproxy-default-retry-l2"
        );
        assert_eq!(s.layout1_pool_consumer("default"), "webproxy-default");
        assert_eq!(
            s.layout1_retry_consumer("default"),
            "webproxy-default-retry"
        );
        assert_eq!(s.layout1_retry("p1"), "webproxy.retry.p1");
        assert_eq!(s.pool_fence_stream("p1"), "WEBPROXY_FENCE_POOL_P1");
        assert_eq!(s.replies_fence_stream(), "WEBPROXY_FENCE_REPLIES");
        // The fences capture what layout 1 listed, and nothing layout 2 uses.
        let fence = s.replies_fence_subject();
        assert!(subject_matches(&s.reply_wildcard(), "webproxy.reply.a.b"));
        assert!(subject_matches(&fence, "webproxy.reply.a.b"));
        assert!(!subject_matches(&fence, &s.reply("order-42")));
        assert!(!subject_matches(
            &fence,
            &s.stored_reply("order-42", &origin)
        ));
        assert!(!subject_matches(
            &s.retry_filter("p1"),
            &s.layout1_retry("p1")
        ));
        let dotted = Subjects::new("acme.wp").expect("valid prefix");
        assert_eq!(dotted.pool_stream("a-b"), "ACME_WP_POOL_A-B");
        assert_eq!(dotted.pool_consumer("a"), "acme_wp-a-l3");
        assert_eq!(dotted.layout1_pool_consumer("a"), "acme_wp-a");
    }

    #[test]
    fn per_pool_streams_derive_from_the_origin_and_overlap_nothing() {
        let s = subjects();
        let default = s.pool_stream("default");
        let partner = s.pool_stream("partner");
        assert_eq!(
            s.pool_replies_stream(&default),
            "WEBPROXY_POOL_DEFAULT_REPLIES"
        );
        assert_eq!(s.pool_dead_stream("default"), "WEBPROXY_POOL_DEFAULT_DEAD");
        let origin = Origin::new(&default, 7);
        assert_eq!(
            s.replies_stream_of(&origin),
            "WEBPROXY_POOL_DEFAULT_REPLIES"
        );
        assert_eq!(
            s.pool_replies_filter(&default),
            "webproxy.reply.*.WEBPROXY_POOL_DEFAULT.*"
        );
        let stored = s.stored_reply("order-42", &origin);
        assert!(subject_matches(&s.pool_replies_filter(&default), &stored));
        assert!(!subject_matches(&s.pool_replies_filter(&partner), &stored));
        assert!(!subject_matches(
            &s.pool_replies_filter(&default),
            &s.reply("order-42")
        ));
        // Layout 1's fence keeps its subject apart from every pool's replies.
        assert!(!subject_matches(&s.replies_fence_subject(), &stored));
        // The retired shared streams capture nothing anyone publishes on.
        for retired in [s.retired_replies_subject(), s.retired_dead_subject()] {
            assert!(!subject_matches(&s.stored_reply_wildcard(), &retired));
            assert!(!subject_matches(&s.dead_wildcard(), &retired));
            assert!(!subject_matches(&s.reply_wildcard(), &retired));
        }
        assert_eq!(s.retired_replies_subject(), "webproxy.retired.replies");
        assert_eq!(s.retired_dead_subject(), "webproxy.retired.dead");
        let dotted = Subjects::new("acme.wp").expect("valid prefix");
        assert_eq!(
            dotted.pool_replies_stream(&dotted.pool_stream("a-b")),
            "ACME_WP_POOL_A-B_REPLIES"
        );
        assert_eq!(dotted.pool_dead_stream("a-b"), "ACME_WP_POOL_A-B_DEAD");
    }

    #[test]
    fn ids() {
        assert!(validate_id("order-42_A").is_ok());
        assert!(validate_id("").is_err());
        assert!(validate_id(&"a".repeat(128)).is_ok());
        assert!(validate_id(&"a".repeat(129)).is_err());
        assert!(validate_id("a.b").is_err());
        assert!(validate_id("a*").is_err());
        assert!(validate_id("a b").is_err());
        assert!(validate_id("a:b").is_err());
    }

    #[test]
    fn pool_names() {
        assert!(validate_pool_name("default").is_ok());
        assert!(validate_pool_name("netsuite_1-a").is_ok());
        assert!(validate_pool_name("Default").is_err());
        assert!(validate_pool_name("").is_err());
        assert!(validate_pool_name(&"p".repeat(33)).is_err());
        assert!(validate_pool_name("a.b").is_err());
        // Pool x's own streams are named as pool x_dead's and x_replies' would be.
        assert!(validate_pool_name("x_dead").is_err());
        assert!(validate_pool_name("x_replies").is_err());
        assert!(validate_pool_name("dead").is_ok());
        assert!(validate_pool_name("x-dead").is_ok());
        assert!(validate_pool_name("x_deadline").is_ok());
    }

    #[test]
    fn prefixes() {
        assert!(validate_prefix("webproxy").is_ok());
        assert!(validate_prefix("acme.webproxy").is_ok());
        assert!(validate_prefix("a..b").is_err());
        assert!(validate_prefix("a.*").is_err());
        assert!(validate_prefix("").is_err());
    }

    #[test]
    fn reply_to_rules() {
        // Everything allowed but what is reserved whatever the patterns say.
        let s = subjects()
            .with_reply_to_allow(&[">".into()])
            .expect("valid");
        assert!(s.check_reply_to("app.replies.42", "x", None).is_ok());
        assert!(s.check_reply_to("webproxy.reply.x", "x", None).is_ok());
        assert!(s.check_reply_to("webproxy.reply.y", "x", None).is_err());
        assert!(
            s.check_reply_to("webproxy.request.default", "x", None)
                .is_err()
        );
        assert!(
            s.check_reply_to("$JS.API.STREAM.DELETE.X", "x", None)
                .is_err()
        );
        assert!(s.check_reply_to("$SYS.x", "x", None).is_err());
        assert!(s.check_reply_to("$KV.b.k", "x", None).is_err());
        // Every server subject, not only the ones listed before.
        for subject in [
            "$O.bucket.x",
            "$MQTT.sess.x",
            "$SRV.PING",
            "$G",
            "$anything.x",
        ] {
            let e = s.check_reply_to(subject, "x", None).expect_err(subject);
            assert!(e.0.contains("'$'"), "{e}");
        }
        // webproxy's own inboxes, whatever follows the private prefix.
        for subject in [
            "_WEBPROXY_INBOX.a1b2.c3",
            "_WEBPROXY_INBOX.x",
            "_WEBPROXY_INBOX",
        ] {
            let e = s.check_reply_to(subject, "x", None).expect_err(subject);
            assert!(e.0.contains("_WEBPROXY_INBOX."), "{e}");
        }
        assert!(s.check_reply_to("webproxy", "x", None).is_err());
        // Callers' own inboxes stay usable, and look-alike prefixes are not reserved.
        assert!(s.check_reply_to("_INBOX.abc.1", "x", None).is_ok());
        assert!(s.check_reply_to("_WEBPROXY_INBOXES.x", "x", None).is_ok());
        assert!(s.check_reply_to("app.*", "x", None).is_err());
        assert!(s.check_reply_to("app.>", "x", None).is_err());
        assert!(s.check_reply_to("app..x", "x", None).is_err());
        assert!(s.check_reply_to("app x", "x", None).is_err());
        assert!(s.check_reply_to("", "x", None).is_err());
        // a subject that merely starts with the prefix's letters is the caller's own
        assert!(s.check_reply_to("webproxyish.replies", "x", None).is_ok());
    }

    #[test]
    fn an_empty_reply_to_allow_allows_only_inboxes() {
        let s = subjects();
        assert!(s.check_reply_to("_INBOX.abc.1", "x", None).is_ok());
        assert!(s.check_reply_to("_INBOX.abc.1", "x", Some("a")).is_ok());
        assert!(s.check_reply_to("webproxy.reply.x", "x", None).is_ok());
        for subject in [
            "app.replies.42",
            "callers.b.replies.1",
            "_INBOXES.x",
            "_INBOX",
        ] {
            let e = s
                .check_reply_to(subject, "x", Some("a"))
                .expect_err(subject);
            assert!(e.0.contains("_INBOX.>"), "{e}");
        }
    }

    #[test]
    fn a_caller_may_name_only_its_own_reply_space() {
        let s = subjects()
            .with_reply_to_allow(&["callers.{caller}.replies.>".into(), "shared.inbox".into()])
            .expect("valid patterns");
        assert!(
            s.check_reply_to("callers.a.replies.42", "x", Some("a"))
                .is_ok()
        );
        let e = s
            .check_reply_to("callers.b.replies.42", "x", Some("a"))
            .expect_err("b's space");
        assert!(e.0.contains("caller \"a\""), "{e}");
        // No name on the request subject: no pattern that names a caller applies.
        let e = s
            .check_reply_to("callers.a.replies.42", "x", None)
            .expect_err("anonymous");
        assert!(e.0.contains("without a caller name"), "{e}");
        // A pattern without the placeholder is every caller's.
        assert!(s.check_reply_to("shared.inbox", "x", None).is_ok());
        assert!(s.check_reply_to("shared.inbox", "x", Some("b")).is_ok());
        // Inboxes are not allowed once the list is set, unless it names them.
        assert!(s.check_reply_to("_INBOX.abc", "x", Some("a")).is_err());
        for bad in ["callers.{caller}x.>", "callers.{call}.>", "a.{caller}.{"] {
            assert!(
                subjects().with_reply_to_allow(&[bad.into()]).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn request_subjects_name_their_caller() {
        let s = subjects();
        assert_eq!(s.caller_request("p1", "a"), "webproxy.request.p1.a");
        assert_eq!(s.request_caller("p1", "webproxy.request.p1"), Some(None));
        assert_eq!(
            s.request_caller("p1", "webproxy.request.p1.a"),
            Some(Some("a"))
        );
        for other in [
            "webproxy.request.p10",
            "webproxy.request.p1.a.b",
            "webproxy.request.p2.a",
            "webproxy.hop.p1.t",
            "webproxy.request.p1.",
            "other.request.p1",
        ] {
            assert_eq!(s.request_caller("p1", other), None, "{other}");
        }
        assert!(subject_matches(
            &s.caller_requests("p1"),
            &s.caller_request("p1", "a")
        ));
        assert_eq!(s.moved("p1", None, "t"), "webproxy.hop.p1.move.t");
        assert_eq!(s.moved("p1", Some("a"), "t"), "webproxy.hop.p1.move.a.t");
        assert!(subject_matches(
            &s.moved_filter("p1", None),
            &s.moved("p1", None, "t")
        ));
        assert!(!subject_matches(
            &s.moved_filter("p1", None),
            &s.moved("p1", Some("a"), "t")
        ));
        assert!(subject_matches(
            &s.moved_filter("p1", Some("a")),
            &s.moved("p1", Some("a"), "t")
        ));
        assert!(!subject_matches(
            &s.moved_filter("p1", Some("b")),
            &s.moved("p1", Some("a"), "t")
        ));
        assert!(validate_caller(&"a".repeat(64)).is_ok());
        assert!(validate_caller(&"a".repeat(65)).is_err());
        assert!(validate_caller("a.b").is_err());
        assert!(validate_caller("").is_err());
    }

    #[test]
    fn reply_to_allow_confines_custom_subjects() {
        let s = subjects()
            .with_reply_to_allow(&["callers.*.replies.>".into(), "app.inbox".into()])
            .expect("valid patterns");
        assert!(s.check_reply_to("callers.a.replies.42", "x", None).is_ok());
        assert!(s.check_reply_to("app.inbox", "x", None).is_ok());
        let e = s
            .check_reply_to("callers.a.other.42", "x", None)
            .expect_err("not allowed");
        assert!(e.0.contains("reply_to_allow"), "{e}");
        assert!(s.check_reply_to("callers.a.replies", "x", None).is_err());
        assert!(s.check_reply_to("app.inbox.1", "x", None).is_err());
        // The reserved prefixes stay refused even when a pattern would match them.
        let broad = subjects()
            .with_reply_to_allow(&[">".into()])
            .expect("valid");
        assert!(
            broad
                .check_reply_to("webproxy.request.default", "x", None)
                .is_err()
        );
        // The default reply subject needs no pattern.
        assert!(s.check_reply_to("webproxy.reply.x", "x", None).is_ok());
    }

    #[test]
    fn subject_patterns() {
        for ok in ["a", "a.*", "a.>", "*.b.>", ">"] {
            assert!(validate_subject_pattern(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a..b", "a.>.b", "a.b*", "a.>x", "a b"] {
            assert!(validate_subject_pattern(bad).is_err(), "{bad}");
        }
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*.c", "a.b.c.d"));
        assert!(!subject_matches("a.*", "a"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches("a", "a"));
        assert!(!subject_matches("a", "a.b"));
        assert!(subject_matches(">", "x.y"));
    }
}
