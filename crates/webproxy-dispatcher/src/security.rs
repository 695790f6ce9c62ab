//! The `[outbound]` security settings compiled into the form the service runs on:
//! the address guard's policy, checked CIDRs, with errors naming the key.

use ipnet::IpNet;
use webproxy_worker::GuardPolicy;

use crate::config::{ConfigError, OutboundConfig, config_error};

/// What may leave this instance.
#[derive(Debug, Clone)]
pub struct Outbound {
    pub guard: GuardPolicy,
}

impl Outbound {
    pub fn compile(config: &OutboundConfig) -> Result<Outbound, ConfigError> {
        Ok(Outbound {
            guard: GuardPolicy {
                allow_private_networks: config.allow_private_networks,
                allow: parse_cidrs("outbound.allow_cidrs", &config.allow_cidrs)?,
                deny: parse_cidrs("outbound.deny_cidrs", &config.deny_cidrs)?,
            },
        })
    }
}

/// CIDRs, or single addresses taken as one-address networks.
fn parse_cidrs(key: &str, items: &[String]) -> Result<Vec<IpNet>, ConfigError> {
    items
        .iter()
        .enumerate()
        .map(|(index, text)| {
            let text = text.trim();
            text.parse::<IpNet>()
                .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
                .map(|net| net.trunc())
                .map_err(|_| {
                    config_error(
                        format!("{key}[{index}]"),
                        format!("{text:?} is not a CIDR (like \"10.0.0.0/8\") or an IP address"),
                    )
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteLimit;

    fn outbound(allow: &[&str], deny: &[&str]) -> OutboundConfig {
        OutboundConfig {
            max_response_bytes: ByteLimit::Auto,
            allow_private_networks: false,
            allow_cidrs: allow.iter().map(|s| s.to_string()).collect(),
            deny_cidrs: deny.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn cidrs_and_single_addresses_parse() {
        let compiled =
            Outbound::compile(&outbound(&["127.0.0.2/32", "10.1.2.3", "::1"], &[])).expect("valid");
        let nets: Vec<String> = compiled.guard.allow.iter().map(|n| n.to_string()).collect();
        assert_eq!(nets, ["127.0.0.2/32", "10.1.2.3/32", "::1/128"]);
    }

    #[test]
    fn host_bits_are_dropped() {
        let compiled = Outbound::compile(&outbound(&[], &["10.1.2.3/8"])).expect("valid");
        assert_eq!(compiled.guard.deny[0].to_string(), "10.0.0.0/8");
    }

    #[test]
    fn a_bad_cidr_names_the_key_and_index() {
        let e = Outbound::compile(&outbound(&["10.0.0.0/8", "ten"], &[])).expect_err("bad");
        assert_eq!(e.key, "outbound.allow_cidrs[1]");
        let e = Outbound::compile(&outbound(&[], &["10.0.0.0/33"])).expect_err("bad");
        assert_eq!(e.key, "outbound.deny_cidrs[0]");
    }
}
