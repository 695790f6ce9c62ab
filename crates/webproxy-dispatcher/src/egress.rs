//! One attempt as the caller sees it: the request sent with its rule's headers, and
//! the redirects its rule allows followed hop by hop. Every hop is matched against the
//! request rules again (its rule's origin included), checked by the address guard
//! again (in the worker), and gets only the headers its own rule injects. The decisions are pure (`security`,
//! `redirect`); this module carries them out.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use webproxy_protocol::Request;
use webproxy_worker::{AttemptOutcome, AttemptRequest, FailureKind, TransportFailure, Worker};

use crate::decision::target;
use crate::rules::{RequestRule, RequestRules};
use crate::secrets::Secrets;
use crate::security::{Outbound, outgoing_headers, same_origin};
use webproxy_worker::redirect::{Redirect, is_content_header, redirect};

/// What the chain came to.
#[derive(Debug)]
pub struct Chain {
    /// The last hop's outcome: its response (a 3xx when the budget ran out), or why
    /// the chain ended.
    pub outcome: AttemptOutcome,
    /// Whether any connection was attempted: false when the first hop was refused by
    /// the guard, which then counts as no attempt.
    pub connected: bool,
    /// Redirects followed.
    pub redirects: u32,
}

/// What a chain runs on.
#[derive(Debug, Clone, Copy)]
pub struct Egress<'a> {
    pub worker: &'a Worker,
    pub rules: &'a RequestRules,
    pub outbound: &'a Outbound,
    pub secrets: &'a Secrets,
}

impl Egress<'_> {
    /// Sends `request` under `rule` and follows up to the rule's `follow_redirects`,
    /// all within `timeout`. `own_headers` are webproxy's own (an idempotency key, the
    /// trace context): they go on every hop and replace the caller's of the same name.
    /// Secret values are redacted from every message.
    pub async fn perform(
        &self,
        rule: &RequestRule,
        request: &Request,
        own_headers: &[(String, String)],
        timeout: Duration,
    ) -> Chain {
        let mut chain = self.run(rule, request, own_headers, timeout).await;
        self.redact(&mut chain.outcome);
        chain
    }

    async fn run(
        &self,
        first_rule: &RequestRule,
        request: &Request,
        own_headers: &[(String, String)],
        timeout: Duration,
    ) -> Chain {
        let deadline = Instant::now() + timeout;
        let budget = first_rule.security.follow_redirects;
        let mut rule = first_rule;
        let mut method = request.method;
        let mut url = request.url.clone();
        let mut body = Bytes::from(request.body.clone());
        let mut keep_content_headers = true;
        let mut left_first_origin = false;
        let mut connected = false;
        let mut redirects = 0;
        loop {
            let injections = self.secrets.for_rule(rule.security.index);
            let mut headers = outgoing_headers(
                &request.headers,
                self.outbound,
                &rule.security,
                &injections,
                left_first_origin,
            );
            if !keep_content_headers {
                headers.retain(|(name, _)| !is_content_header(name));
            }
            headers.retain(|(name, _)| {
                !own_headers
                    .iter()
                    .any(|(own, _)| own.eq_ignore_ascii_case(name))
            });
            headers.extend(own_headers.iter().cloned());
            let remaining = deadline.saturating_duration_since(Instant::now());
            let outcome = if remaining.is_zero() {
                timed_out(timeout)
            } else {
                self.worker
                    .attempt(AttemptRequest {
                        method: method.as_str(),
                        url: &url,
                        headers: &headers,
                        body: body.clone(),
                        timeout: remaining,
                    })
                    .await
            };
            if !matches!(outcome, AttemptOutcome::Denied { .. }) {
                connected = true;
            }
            let AttemptOutcome::Response(response) = &outcome else {
                return Chain {
                    outcome,
                    connected,
                    redirects,
                };
            };
            let next = match redirect(method, &url, response.status, response.header("location")) {
                Redirect::None => None,
                // Past the budget the 3xx itself is the answer.
                _ if redirects >= budget => None,
                Redirect::Refused(message) => {
                    return Chain {
                        outcome: AttemptOutcome::Denied { message },
                        connected,
                        redirects,
                    };
                }
                Redirect::Invalid(message) => {
                    return Chain {
                        outcome: AttemptOutcome::Invalid { message },
                        connected,
                        redirects,
                    };
                }
                Redirect::Follow(hop) => Some(hop),
            };
            let Some(hop) = next else {
                return Chain {
                    outcome,
                    connected,
                    redirects,
                };
            };
            rule = match target(self.rules, hop.method, &hop.url) {
                Ok(next_rule) => next_rule,
                Err(refusal) => {
                    return Chain {
                        outcome: AttemptOutcome::Denied {
                            message: format!("redirect from {url}: {}", refusal.message),
                        },
                        connected,
                        redirects,
                    };
                }
            };
            redirects += 1;
            left_first_origin |= !same_origin(&request.url, &hop.url);
            if !hop.keep_body {
                body = Bytes::new();
                keep_content_headers = false;
            }
            method = hop.method;
            url = hop.url;
        }
    }

    /// Removes secret values from the messages webproxy writes about the outcome. The
    /// response itself (the upstream's own words) is delivered as it is.
    fn redact(&self, outcome: &mut AttemptOutcome) {
        let redactor = self.secrets.redactor();
        let message = match outcome {
            AttemptOutcome::Failed(failure) => &mut failure.message,
            AttemptOutcome::HeadersTooLarge { message, .. } => message,
            AttemptOutcome::Denied { message } | AttemptOutcome::Invalid { message } => message,
            AttemptOutcome::Response(_) | AttemptOutcome::TooLarge { .. } => return,
        };
        *message = redactor.redact(message).into_owned();
    }
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
