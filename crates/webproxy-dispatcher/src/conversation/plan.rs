//! Every decision before an attempt, made by pure code: the plan for one delivery
//! (a recorded cancel, poison, a payload that is no request, admission by the rules, the request limits,
//! expiry, and a move to the rule's pool, in that order), which `before` carries out;
//! and which rule a request goes under, `admit` for the request as the caller sent it,
//! `target` for it and every redirect leg (an accepting rule's origin and path
//! parameters included), which `egress` asks for each leg. Unit-tested without a
//! server.

use std::time::{Duration, SystemTime};

use webproxy_config::human;
use webproxy_config::rules::{RequestRule, RequestRules, RuleAction};
use webproxy_config::security::Outbound;
use webproxy_config::settings::Settings;
use webproxy_protocol::{ErrorBody, ErrorCode, Method, ParseError, Request};

use crate::conversation::hop::MAX_HOP_HEADER_BYTES;
use crate::conversation::outbox::{HEADER_ALLOWANCE, invalid_request};

/// Everything the plan depends on: the settings (whose rules the plan names, for
/// `'r`) and the delivery (for `'d`).
#[derive(Debug)]
pub(crate) struct PlanInput<'r, 'd> {
    pub(crate) settings: &'r Settings,
    /// The pool whose consumer delivered the message.
    pub(crate) pool: &'d str,
    /// The server's delivery count of this message.
    pub(crate) delivered: u64,
    pub(crate) parsed: &'d Result<Request, ParseError>,
    /// The size of the stored message's payload.
    pub(crate) payload_len: usize,
    /// The server's `max_payload`.
    pub(crate) max_payload: usize,
    pub(crate) now: SystemTime,
    /// The caller's publish: queue waits count from it.
    pub(crate) since: SystemTime,
    /// No attempt has been made yet in this generation.
    pub(crate) first_attempt: bool,
    /// The error of a cancel recorded for the conversation, if there is one.
    pub(crate) cancelled: Option<ErrorBody>,
}

/// What happens to the delivery.
#[derive(Debug)]
pub(crate) enum Plan<'r> {
    /// Delivered more often than `max_deliver`: it crashed or stalled an instance each
    /// time. Answered `internal`, dead-lettered and terminated.
    Poison(ErrorBody),
    /// Not a request envelope at all: dead-lettered and terminated.
    Undecodable(ErrorBody),
    /// Ended with this error without an attempt: invalid, denied, over a limit, or
    /// expired.
    Reject {
        error: ErrorBody,
        /// The rule that matched, if one did.
        rule: Option<&'r RequestRule>,
    },
    /// The rule's pool is not the pool it arrived in: hand it over, so that publishing
    /// everything to one pool cannot bypass another pool's limit.
    Move(&'r RequestRule),
    /// Attempt under this rule; `queue_wait` is the wait before a first attempt.
    Attempt {
        rule: &'r RequestRule,
        queue_wait: Option<Duration>,
    },
}

/// The largest request envelope the service takes: one that, with the largest hop
/// state beside it, still fits the server's `max_payload`, so every hop of it can be
/// published.
pub(crate) fn max_envelope_bytes(max_payload: usize) -> usize {
    max_payload.saturating_sub(HEADER_ALLOWANCE + MAX_HOP_HEADER_BYTES)
}

/// Decides what happens to a delivery.
pub(crate) fn plan<'r>(input: &PlanInput<'r, '_>) -> Plan<'r> {
    // The caller took it back: nothing else is asked of it.
    if let Some(error) = &input.cancelled {
        return Plan::Reject {
            error: error.clone(),
            rule: None,
        };
    }
    let max_deliver = input.settings.cluster.max_deliver;
    if input.delivered > u64::from(max_deliver) {
        return Plan::Poison(ErrorBody {
            code: ErrorCode::Internal,
            message: format!(
                "delivered {} times without finishing (more than [service] max_deliver = {max_deliver}): it crashed or stalled an instance each time, so it is not attempted again",
                input.delivered
            ),
            status: None,
        });
    }
    let request = match input.parsed {
        Ok(request) => request,
        Err(ParseError::Undecodable { reason }) => {
            return Plan::Undecodable(ErrorBody {
                code: ErrorCode::InvalidRequest,
                message: format!("payload is not a request envelope: {reason}"),
                status: None,
            });
        }
        Err(ParseError::Invalid(invalid)) => {
            return Plan::Reject {
                error: invalid_request(invalid.field, &invalid.message),
                rule: None,
            };
        }
    };
    let largest = max_envelope_bytes(input.max_payload);
    if input.payload_len > largest {
        return Plan::Reject {
            error: invalid_request(
                "payload",
                &format!(
                    "the envelope is {} bytes; with the server's max_payload of {} bytes the largest that every retry and move can carry is {largest}",
                    input.payload_len, input.max_payload
                ),
            ),
            rule: None,
        };
    }
    let settings = input.settings;
    let rule = match admit(request, &settings.cluster.rules) {
        Admission::Reject { error, rule } => return Plan::Reject { error, rule },
        Admission::Attempt(rule) => rule,
    };
    if let Err(error) = check_request(request, &settings.cluster.outbound) {
        return Plan::Reject {
            error,
            rule: Some(rule),
        };
    }
    if let Some(error) = expired(input, request, rule, input.now) {
        return Plan::Reject {
            error,
            rule: Some(rule),
        };
    }
    if rule.pool != input.pool {
        return Plan::Move(rule);
    }
    Plan::Attempt {
        rule,
        queue_wait: input
            .first_attempt
            .then(|| input.now.duration_since(input.since).unwrap_or_default()),
    }
}

/// Whether `request`, under `rule`, is past its deadline or its pool's
/// `queue_timeout` at `now`: when planned, and again after a wait at the pool's gate.
pub(crate) fn expired(
    input: &PlanInput<'_, '_>,
    request: &Request,
    rule: &RequestRule,
    now: SystemTime,
) -> Option<ErrorBody> {
    let waited = now.duration_since(input.since).unwrap_or_default();
    // The queue that counts is the rule's pool's, where the request runs; a moved
    // request's wait counts from the caller's publish all the same.
    let queued = input
        .settings
        .cluster
        .pools
        .get(&rule.pool)
        .and_then(|p| p.queue_timeout)
        .filter(|_| input.first_attempt)
        .map(|limit| (waited, limit));
    let deadline = request.deadline.map(SystemTime::from);
    expiry(now, deadline, queued)
}

/// Whether a request is within the request limits; the error is `invalid_request`
/// naming the limit. Counted on the caller's headers as received.
pub(crate) fn check_request(request: &Request, outbound: &Outbound) -> Result<(), ErrorBody> {
    if request.body.len() as u64 > outbound.max_request_bytes {
        return Err(invalid_request(
            "body",
            &format!(
                "is {} bytes, more than [outbound] max_request_bytes = {}",
                request.body.len(),
                outbound.max_request_bytes
            ),
        ));
    }
    if request.headers.len() > outbound.max_headers {
        return Err(invalid_request(
            "headers",
            &format!(
                "has {} headers, more than [outbound] max_headers = {}",
                request.headers.len(),
                outbound.max_headers
            ),
        ));
    }
    let bytes: usize = request
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    if bytes > outbound.max_header_bytes {
        return Err(invalid_request(
            "headers",
            &format!(
                "has {bytes} bytes of names and values, more than [outbound] max_header_bytes = {}",
                outbound.max_header_bytes
            ),
        ));
    }
    Ok(())
}

/// Why a request may not start its next attempt, if it may not: the deadline has
/// passed, or it waited in the queue longer than the pool's `queue_timeout` before its
/// first attempt (`queued` is how long it waited and the limit).
pub(crate) fn expiry(
    now: SystemTime,
    deadline: Option<SystemTime>,
    queued: Option<(Duration, Duration)>,
) -> Option<ErrorBody> {
    if let Some(deadline) = deadline
        && now > deadline
    {
        let late = now.duration_since(deadline).unwrap_or_default();
        return Some(ErrorBody {
            code: ErrorCode::Expired,
            message: format!(
                "the deadline passed {} before the attempt could start",
                human(late)
            ),
            status: None,
        });
    }
    match queued {
        Some((waited, limit)) if waited > limit => Some(ErrorBody {
            code: ErrorCode::Expired,
            message: format!(
                "waited {} in the pool's queue, longer than its queue_timeout of {}",
                human(waited),
                human(limit)
            ),
            status: None,
        }),
        _ => None,
    }
}

/// Whether a parsed request may be attempted.
#[derive(Debug)]
pub(crate) enum Admission<'r> {
    /// Answer with this error at once; no attempt is made.
    Reject {
        error: ErrorBody,
        /// The rule that matched, if one did.
        rule: Option<&'r RequestRule>,
    },
    /// Attempt under this rule.
    Attempt(&'r RequestRule),
}

/// Matches a request against the rules: no match, a deny rule, or an accept rule
/// bound to another origin is `denied`; a path parameter the accepting rule does not
/// allow is `invalid_request`.
pub(crate) fn admit<'r>(request: &Request, rules: &'r RequestRules) -> Admission<'r> {
    match target(rules, request.method, &request.url) {
        Ok(rule) => Admission::Attempt(rule),
        Err(refusal) => Admission::Reject {
            error: ErrorBody {
                code: refusal.code,
                message: refusal.message,
                status: None,
            },
            rule: refusal.rule,
        },
    }
}

/// Why nothing may be sent to a URL.
#[derive(Debug)]
pub(crate) struct TargetRefusal<'r> {
    /// `denied` (the rules refuse the destination) or `invalid_request` (the URL is
    /// one webproxy does not send under the rule that accepts it).
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
    /// The rule that matched (a deny rule, an accept rule bound to another origin,
    /// or one that does not allow the URL's path parameter), if one did.
    pub(crate) rule: Option<&'r RequestRule>,
}

/// The rule under which `method url` may be sent, for the first hop and every
/// redirect hop alike: the first matching rule must accept, an accept rule with
/// an origin must name exactly the URL's scheme, host and port, and a `;` in the path
/// needs the rule's `allow_path_parameters` (else `invalid_request`, as for a URL
/// the envelope's parser refuses: the rule is known only here).
pub(crate) fn target<'r>(
    rules: &'r RequestRules,
    method: Method,
    url: &url::Url,
) -> Result<&'r RequestRule, TargetRefusal<'r>> {
    let refused = |message: String, rule| {
        Err(TargetRefusal {
            code: ErrorCode::Denied,
            message,
            rule,
        })
    };
    match rules.find(method, url.as_str()) {
        None => refused(format!("no request rule accepts {method} {url}"), None),
        Some(rule) if rule.action == RuleAction::Deny => refused(
            format!("request rule {:?} denies {method} {url}", rule.name),
            Some(rule),
        ),
        Some(rule) => match rule.security.check_origin(url) {
            Err(why) => refused(
                format!(
                    "request rule {:?} matches {method} {url} but {why}",
                    rule.name
                ),
                Some(rule),
            ),
            // The URL is not repeated: a path parameter may carry a session id.
            Ok(()) => match rule.security.check_path(url) {
                Ok(()) => Ok(rule),
                Err(why) => Err(TargetRefusal {
                    code: ErrorCode::InvalidRequest,
                    message: format!("request rule {:?} {why}", rule.name),
                    rule: Some(rule),
                }),
            },
        },
    }
}

#[cfg(test)]
mod tests;
