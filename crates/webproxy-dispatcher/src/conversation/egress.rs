//! The rules and the secrets as the worker's [`LegPolicy`]: a leg may go where
//! [`target`] finds an accepting rule (its origin included), with the headers that rule
//! drops and injects and the redirect budget it sets, and the outcome's messages are
//! redacted with the injected secrets the conversation's caller did not name. The chain itself is the worker's.

use std::borrow::Cow;

use url::Url;
use webproxy_config::rules::{RequestRule, RequestRules};
use webproxy_config::secrets::{Redaction, Secrets};
use webproxy_config::security::{AddressGuard, Outbound};
use webproxy_protocol::{ErrorCode, Method};
use webproxy_worker::{Denial, GuardPolicy, Leg, LegPolicy};

use crate::conversation::plan::target;

/// What a chain's legs are decided on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RulePolicy<'a> {
    pub(crate) rules: &'a RequestRules,
    pub(crate) outbound: &'a Outbound,
    pub(crate) secrets: &'a Secrets,
    /// The conversation's redaction: the secrets its caller did not name.
    pub(crate) redaction: &'a Redaction,
}

impl RulePolicy<'_> {
    /// The leg a request sends under `rule`: the caller's headers the outbound policy
    /// and the rule deny are dropped, the rule's secrets injected, its origin bound.
    pub(crate) fn leg_for(&self, rule: &RequestRule) -> Leg {
        let security = &rule.security;
        Leg {
            rule: rule.name.clone(),
            drop_headers: self
                .outbound
                .deny_request_headers
                .iter()
                .chain(&security.deny_request_headers)
                .cloned()
                .collect(),
            inject: self
                .secrets
                .for_rule(security.index)
                .iter()
                .map(|injection| (injection.header.clone(), injection.value.clone()))
                .collect(),
            origin: security.origin.clone(),
            follow_redirects: security.follow_redirects,
        }
    }
}

impl LegPolicy for RulePolicy<'_> {
    fn leg(&self, method: Method, url: &Url) -> Result<Leg, Denial> {
        match target(self.rules, method, url) {
            Ok(rule) => Ok(self.leg_for(rule)),
            Err(refusal) => Err(Denial {
                message: refusal.message,
                invalid: refusal.code == ErrorCode::InvalidRequest,
            }),
        }
    }

    fn redact<'t>(&self, text: &'t str) -> Cow<'t, str> {
        self.redaction.redact(text)
    }
}

/// `[outbound]`'s address guard as the worker applies it.
pub(crate) fn guard_policy(guard: &AddressGuard) -> GuardPolicy {
    GuardPolicy {
        allow_private_networks: guard.allow_private_networks,
        allow: guard.allow.clone(),
        deny: guard.deny.clone(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use webproxy_config::rules::RuleAction;
    use webproxy_config::testing::rule_config;

    use super::*;

    #[test]
    fn a_leg_is_its_rules_headers_origin_and_budget_and_a_refusal_is_a_denial() {
        let mut partner = rule_config("partner", "*", "^https://a\\.test/", RuleAction::Accept);
        partner.follow_redirects = 2;
        partner.origin = Some("https://a.test".into());
        partner.deny_request_headers = vec!["X-Rule".into()];
        let rules = RequestRules::new(
            [
                partner,
                rule_config("block", "*", "^https://b\\.test/", RuleAction::Deny),
            ]
            .iter()
            .map(|config| RequestRule::compile(config, &Arc::from([])).expect("valid"))
            .collect(),
        );
        let outbound = Outbound {
            max_response_bytes: webproxy_config::security::ByteLimit::Auto,
            max_large_body: 0,
            guard: Default::default(),
            max_request_bytes: 1,
            max_headers: 1,
            max_header_bytes: 1,
            deny_request_headers: vec!["x-global".into()],
            dns: webproxy_config::security::DnsBounds::default(),
        };
        let secrets = Secrets::empty();
        let policy = RulePolicy {
            rules: &rules,
            outbound: &outbound,
            secrets: &secrets,
            redaction: &secrets.redactor().for_envelope(b""),
        };
        let url = |text: &str| Url::parse(text).expect(text);
        let leg = policy
            .leg(Method::Get, &url("https://a.test/x"))
            .expect("accepted");
        assert_eq!(leg.rule, "partner");
        assert_eq!(leg.drop_headers, ["x-global", "x-rule"]);
        assert!(leg.inject.is_empty());
        assert_eq!(leg.origin, Some(url("https://a.test/").origin()));
        assert_eq!(leg.follow_redirects, 2);
        let denial = policy
            .leg(Method::Get, &url("https://b.test/x"))
            .expect_err("denied");
        assert!(denial.message.contains("\"block\" denies"), "{denial}");
        assert!(policy.leg(Method::Get, &url("https://c.test/")).is_err());
    }
}
