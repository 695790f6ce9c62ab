//! Name resolution through the address guard: the bounded async resolver (`dns.rs`,
//! /etc/resolv.conf and /etc/hosts as the system resolver reads them) and then the
//! guard on every address it returns. reqwest connects only to what this returns, so
//! the address checked is the address used, and a name that resolves differently the
//! second time (DNS rebinding) is checked again.

use std::net::SocketAddr;
use std::sync::Arc;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

use crate::dns::Dns;
use crate::guard::{self, Denied, GuardPolicy};

/// A reqwest resolver that drops the addresses the guard denies.
#[derive(Debug, Clone)]
pub(crate) struct GuardedResolver {
    policy: Arc<GuardPolicy>,
    dns: Arc<Dns>,
}

impl GuardedResolver {
    pub(crate) fn new(policy: Arc<GuardPolicy>, dns: Dns) -> Self {
        GuardedResolver {
            policy,
            dns: Arc::new(dns),
        }
    }
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        let dns = self.dns.clone();
        let host = name.as_str().to_string();
        Box::pin(async move {
            // Port 0: reqwest puts the URL's port in afterwards.
            let resolved: Vec<SocketAddr> = dns
                .lookup(&host)
                .await?
                .into_iter()
                .map(|ip| SocketAddr::new(ip, 0))
                .collect();
            let allowed = filter(&resolved, &policy)?;
            let addrs: Addrs = Box::new(allowed.into_iter());
            Ok(addrs)
        })
    }
}

/// The resolved addresses the guard allows, in resolver order; when it allows none,
/// the denial of the first. A name with both public and denied addresses is only ever
/// connected to on its public ones.
pub(crate) fn filter(
    resolved: &[SocketAddr],
    policy: &GuardPolicy,
) -> Result<Vec<SocketAddr>, Denied> {
    let mut first_denial = None;
    let mut allowed = Vec::with_capacity(resolved.len());
    for addr in resolved {
        match guard::check(addr.ip(), policy) {
            Ok(()) => allowed.push(*addr),
            Err(denied) => {
                first_denial.get_or_insert(denied);
            }
        }
    }
    match first_denial {
        Some(denied) if allowed.is_empty() => Err(denied),
        _ => Ok(allowed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter()
            .map(|a| a.parse().unwrap_or_else(|e| panic!("{a}: {e}")))
            .collect()
    }

    #[test]
    fn denied_addresses_are_dropped() {
        let resolved = addrs(&["127.0.0.1:0", "8.8.8.8:0", "[::1]:0", "[2606:4700::1]:0"]);
        let allowed = filter(&resolved, &GuardPolicy::default()).expect("some allowed");
        assert_eq!(allowed, addrs(&["8.8.8.8:0", "[2606:4700::1]:0"]));
    }

    #[test]
    fn all_denied_names_the_first() {
        let resolved = addrs(&["[::1]:0", "127.0.0.1:0"]);
        let denied = filter(&resolved, &GuardPolicy::default()).expect_err("all denied");
        assert_eq!(denied.address.to_string(), "::1");
        assert!(denied.range.contains("loopback"), "{denied}");
    }

    #[test]
    fn nothing_resolved_is_not_a_denial() {
        assert_eq!(filter(&[], &GuardPolicy::default()), Ok(Vec::new()));
    }
}
