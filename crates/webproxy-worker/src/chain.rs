//! One attempt as the caller sees it: the request sent with its leg's headers, and
//! the redirects the first leg's budget allows followed leg by leg. Every redirect leg
//! is asked of the [`LegPolicy`] again (the rules and the secrets, which the worker does
//! not know), checked by the address guard again, and sends only the credentials its
//! own leg injects, only to that leg's origin. The messages the chain writes about its
//! outcome are redacted by the policy. The decisions are pure (`redirect`,
//! [`outgoing_headers`]); this module carries them out.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use tokio::time::Instant;
use url::{Origin, Url};
use webproxy_protocol::Method;

use crate::redirect::{Redirect, is_content_header, redirect};
use crate::{
    AttemptOutcome, AttemptRequest, FailureKind, LargeBody, StreamedBody, TransportFailure, Worker,
};

/// What the worker must not know, given by the dispatcher: which legs the rules allow
/// and with which headers, and which values are secret.
pub trait LegPolicy {
    /// The leg `method url` may make, or why it may not. Asked for every redirect leg;
    /// `url` is canonical (see [`webproxy_protocol::canonical_url`]).
    fn leg(&self, method: Method, url: &Url) -> Result<Leg, Denial>;

    /// `text` with every secret value removed: applied to every message the chain
    /// writes about its outcome.
    fn redact<'t>(&self, text: &'t str) -> Cow<'t, str>;
}

/// One leg a policy allows.
#[derive(Clone, Default)]
pub struct Leg {
    /// The rule the leg is sent under.
    pub rule: String,
    /// The caller's headers not sent (lower-case names).
    pub drop_headers: Vec<String>,
    /// Headers set from secrets, replacing the caller's of the same name.
    pub inject: Vec<(String, String)>,
    /// The one origin this leg may go to; a leg that injects must have one.
    pub origin: Option<Origin>,
    /// The redirect budget of a whole chain that starts with this leg.
    pub follow_redirects: u32,
}

impl fmt::Debug for Leg {
    /// Names the injected headers, never their values.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let injected: Vec<&str> = self.inject.iter().map(|(name, _)| name.as_str()).collect();
        f.debug_struct("Leg")
            .field("rule", &self.rule)
            .field("drop_headers", &self.drop_headers)
            .field("inject", &injected)
            .field("origin", &self.origin)
            .field("follow_redirects", &self.follow_redirects)
            .finish()
    }
}

/// Why a policy allows no leg to a URL; the message is the caller's.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct Denial {
    pub message: String,
    /// The URL is one webproxy does not send under the rule that matches it (a `;` in
    /// the path the rule does not allow): the chain ends `Invalid` (`invalid_request`,
    /// as the same URL from a caller), not `Denied`.
    pub invalid: bool,
}

/// The caller's request, as the chain sends it.
#[derive(Debug, Clone)]
pub struct ChainRequest<'a> {
    pub method: Method,
    pub url: &'a Url,
    /// The caller's headers.
    pub headers: &'a [(String, String)],
    pub body: Bytes,
    /// Webproxy's own headers (an idempotency key, the trace context): they go on
    /// every leg and replace the caller's of the same name.
    pub own_headers: &'a [(String, String)],
    /// For the whole chain.
    pub timeout: Duration,
}

/// What the chain came to.
#[derive(Debug)]
pub struct Chain {
    /// The last leg's outcome: its response (a 3xx when the budget ran out), or why
    /// the chain ended.
    pub outcome: AttemptOutcome,
    /// Whether any connection was attempted: false when the first leg was refused by
    /// the guard, which then counts as no attempt.
    pub connected: bool,
    /// Redirects followed.
    pub redirects: u32,
}

impl Worker {
    /// Sends `request` as the leg `first` and follows up to its `follow_redirects`, all
    /// within the request's timeout. Secret values are redacted from every message.
    pub async fn perform(
        &self,
        policy: &impl LegPolicy,
        first: Leg,
        request: ChainRequest<'_>,
    ) -> Chain {
        self.perform_large(policy, first, request, None, None).await
    }

    /// [`Worker::perform`] for a request that opted in to a stored body: the final
    /// answer's body past the inline limit goes to `large`'s sink, up to its `max`;
    /// and for one whose body is `streamed` from storage (on the first leg only: a
    /// redirect that would send the body again is not followed, its 3xx is the answer).
    pub async fn perform_large(
        &self,
        policy: &impl LegPolicy,
        first: Leg,
        request: ChainRequest<'_>,
        large: Option<LargeBody<'_>>,
        streamed: Option<StreamedBody>,
    ) -> Chain {
        let mut chain = self.run(policy, first, request, large, streamed).await;
        if let Some(message) = chain.outcome.message_mut()
            && let Cow::Owned(redacted) = policy.redact(message)
        {
            *message = redacted;
        }
        chain
    }

    async fn run(
        &self,
        policy: &impl LegPolicy,
        first: Leg,
        request: ChainRequest<'_>,
        mut large: Option<LargeBody<'_>>,
        mut streamed: Option<StreamedBody>,
    ) -> Chain {
        let body_streamed = streamed.is_some();
        let timeout = request.timeout;
        let deadline = Instant::now() + timeout;
        let budget = first.follow_redirects;
        let mut leg = first;
        let mut method = request.method;
        let mut url = request.url.clone();
        let mut body = request.body.clone();
        let mut keep_content_headers = true;
        let mut left_first_origin = false;
        let mut connected = false;
        let mut redirects = 0;
        let end = |outcome, connected, redirects| Chain {
            outcome,
            connected,
            redirects,
        };
        if let Err(message) = bound(&leg, &url) {
            return end(AttemptOutcome::Denied { message }, connected, redirects);
        }
        loop {
            let mut headers = outgoing_headers(request.headers, &leg, left_first_origin);
            if !keep_content_headers {
                headers.retain(|(name, _)| !is_content_header(name));
            }
            headers.retain(|(name, _)| {
                !request
                    .own_headers
                    .iter()
                    .any(|(own, _)| own.eq_ignore_ascii_case(name))
            });
            headers.extend(request.own_headers.iter().cloned());
            let remaining = deadline.saturating_duration_since(Instant::now());
            let outcome = if remaining.is_zero() {
                timed_out(timeout)
            } else {
                self.attempt_leg(
                    AttemptRequest {
                        method: method.as_str(),
                        url: &url,
                        headers: &headers,
                        body: body.clone(),
                        timeout: remaining,
                    },
                    large.as_mut(),
                    streamed.take(),
                )
                .await
            };
            if !matches!(outcome, AttemptOutcome::Denied { .. }) {
                connected = true;
            }
            let AttemptOutcome::Response(response) = &outcome else {
                return end(outcome, connected, redirects);
            };
            let next = match redirect(method, &url, response.status, response.header("location")) {
                Redirect::None => None,
                // A streamed body is sent once.
                Redirect::Follow(next) if body_streamed && next.keep_body => None,
                // Past the budget the 3xx itself is the answer.
                _ if redirects >= budget => None,
                Redirect::Refused(message) => {
                    return end(AttemptOutcome::Denied { message }, connected, redirects);
                }
                Redirect::Invalid(message) => {
                    return end(AttemptOutcome::Invalid { message }, connected, redirects);
                }
                Redirect::Follow(next) => Some(next),
            };
            let Some(next) = next else {
                return end(outcome, connected, redirects);
            };
            leg = match policy.leg(next.method, &next.url).and_then(|leg| {
                bound(&leg, &next.url)
                    .map(|()| leg)
                    .map_err(|message| Denial {
                        message,
                        invalid: false,
                    })
            }) {
                Ok(leg) => leg,
                Err(denial) => {
                    let message = format!("redirect from {url}: {}", denial.message);
                    let outcome = if denial.invalid {
                        AttemptOutcome::Invalid { message }
                    } else {
                        AttemptOutcome::Denied { message }
                    };
                    return end(outcome, connected, redirects);
                }
            };
            redirects += 1;
            left_first_origin |= request.url.origin() != next.url.origin();
            if !next.keep_body {
                body = Bytes::new();
                keep_content_headers = false;
            }
            method = next.method;
            url = next.url;
        }
    }
}

/// Whether `leg` may go to `url`: a leg bound to an origin goes only there, and a leg
/// that injects credentials must be bound to one. The policy refuses such legs itself;
/// this is the worker's own check, so credentials never travel elsewhere whatever the
/// policy returns.
fn bound(leg: &Leg, url: &Url) -> Result<(), String> {
    match &leg.origin {
        Some(origin) if url.origin() != *origin => Err(format!(
            "request rule {:?} is bound to origin {}, not {}",
            leg.rule,
            origin.ascii_serialization(),
            url.origin().ascii_serialization()
        )),
        None if !leg.inject.is_empty() => Err(format!(
            "request rule {:?} injects headers but names no origin",
            leg.rule
        )),
        _ => Ok(()),
    }
}

/// Caller headers that carry the caller's own credentials, which do not follow a
/// redirect to another origin.
const CREDENTIAL_HEADERS: [&str; 4] = ["authorization", "cookie", "cookie2", "proxy-authorization"];

/// The headers one leg sends: the caller's, less the ones the leg drops, less any it
/// injects (an injected header replaces the caller's, never merges), less the caller's
/// credentials once the chain has left its first origin; then the leg's injections.
fn outgoing_headers(
    caller: &[(String, String)],
    leg: &Leg,
    left_first_origin: bool,
) -> Vec<(String, String)> {
    let dropped = |name: &str| {
        let lower = name.to_ascii_lowercase();
        leg.drop_headers.contains(&lower)
            || leg
                .inject
                .iter()
                .any(|(injected, _)| injected.eq_ignore_ascii_case(name))
            || (left_first_origin && CREDENTIAL_HEADERS.contains(&lower.as_str()))
    };
    caller
        .iter()
        .filter(|(name, _)| !dropped(name))
        .cloned()
        .chain(leg.inject.iter().cloned())
        .collect()
}

fn timed_out(timeout: Duration) -> AttemptOutcome {
    AttemptOutcome::Failed(TransportFailure {
        kind: FailureKind::Timeout,
        may_have_reached_upstream: true,
        message: format!(
            "the redirect chain took longer than the attempt's timeout of {timeout:?}"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn outgoing_headers_drop_denied_replace_injected_and_strip_credentials_off_origin() {
        let caller = pairs(&[
            ("proxy-authorization", "x"),
            ("X-Forwarded-Host", "evil"),
            ("X-Rule-Denied", "y"),
            ("authorization", "caller's"),
            ("Cookie", "c=1"),
            ("X-Api-Key", "caller-key"),
            ("Accept", "text/plain"),
        ]);
        let leg = Leg {
            drop_headers: vec![
                "proxy-authorization".into(),
                "x-forwarded-host".into(),
                "x-rule-denied".into(),
            ],
            inject: pairs(&[("X-API-KEY", "secret")]),
            ..Leg::default()
        };
        let same = outgoing_headers(&caller, &leg, false);
        let names: Vec<&str> = same.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["authorization", "Cookie", "Accept", "X-API-KEY"]);
        assert_eq!(same[3].1, "secret");

        let elsewhere = Leg {
            inject: Vec::new(),
            ..leg
        };
        let elsewhere = outgoing_headers(&caller, &elsewhere, true);
        let names: Vec<&str> = elsewhere.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["X-Api-Key", "Accept"]);
    }

    #[test]
    fn a_leg_goes_only_to_its_origin_and_an_injecting_leg_needs_one() {
        let url = |text: &str| Url::parse(text).expect(text);
        let bound_to = |origin: &str| Leg {
            rule: "partner".into(),
            origin: Some(url(origin).origin()),
            ..Leg::default()
        };
        let partner = bound_to("https://api.partner.com");
        assert_eq!(
            bound(&partner, &url("https://api.partner.com:443/x")),
            Ok(())
        );
        for other in [
            "http://api.partner.com/",
            "https://api.partner.com:8443/",
            "https://api.partner.com.evil.example/",
        ] {
            let why = bound(&partner, &url(other)).expect_err(other);
            assert!(
                why.contains("bound to origin https://api.partner.com"),
                "{why}"
            );
        }
        assert_eq!(bound(&Leg::default(), &url("https://any.example/")), Ok(()));
        let unbound = Leg {
            inject: pairs(&[("X-Api-Key", "k")]),
            ..Leg::default()
        };
        assert!(bound(&unbound, &url("https://any.example/")).is_err());
    }

    #[test]
    fn debug_of_a_leg_shows_no_injected_value() {
        let leg = Leg {
            inject: pairs(&[("Authorization", "Bearer tok-91")]),
            ..Leg::default()
        };
        let shown = format!("{leg:?} {leg:#?}");
        assert!(!shown.contains("tok-91"), "{shown}");
        assert!(shown.contains("Authorization"), "{shown}");
    }
}
