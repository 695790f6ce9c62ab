//! Host name lookups, bounded: an async resolver (hickory) whose lookups a timeout
//! cancels, where the system resolver (getaddrinfo) ran each on a blocking thread that
//! no timeout could stop, so slow authoritative DNS under a wildcard rule could take
//! every blocking thread. Each lookup, a wait for a free slot included, ends within
//! `[outbound] dns_timeout`, and at most `dns_max_concurrent` run at once. It reads
//! /etc/resolv.conf (nameservers, search list, ndots) as the system resolver does,
//! unless `dns_servers` names the servers. A name in /etc/hosts is answered from there
//! alone, as glibc's `hosts: files dns` does (hickory would still ask DNS for the
//! family the file lacks, and wait on a silent server for it); `localhost` is loopback
//! without either.
//! The address guard is applied to what this returns, by `resolve.rs`.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::NetError;
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::op::Query;
use hickory_resolver::proto::rr::{Name, RecordType};
use hickory_resolver::{Hosts, TokioResolver};
use thiserror::Error;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// How lookups are made and bounded (`[outbound]`'s `dns_*` keys).
#[derive(Clone)]
pub struct DnsConfig {
    /// The longest one lookup may take, a wait for a free slot included.
    pub timeout: Duration,
    /// The most lookups under way at once; more wait for a slot within `timeout`.
    pub max_concurrent: usize,
    /// The servers asked (UDP, and TCP for a truncated answer); empty: those of
    /// /etc/resolv.conf.
    pub servers: Vec<SocketAddr>,
    /// Told of every lookup that failed, and why (for a metric).
    pub on_failure: Option<Arc<dyn Fn(DnsFailure) + Send + Sync>>,
}

impl fmt::Debug for DnsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DnsConfig")
            .field("timeout", &self.timeout)
            .field("max_concurrent", &self.max_concurrent)
            .field("servers", &self.servers)
            .field("on_failure", &self.on_failure.is_some())
            .finish()
    }
}

impl Default for DnsConfig {
    /// The shipped defaults: 5 s, 256 at once, the system's servers.
    fn default() -> Self {
        DnsConfig {
            timeout: Duration::from_secs(5),
            max_concurrent: 256,
            servers: Vec::new(),
            on_failure: None,
        }
    }
}

/// Why a lookup failed, as the metric counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DnsFailure {
    /// No answer within `dns_timeout`, with a slot free at once.
    Timeout,
    /// Every slot under `dns_max_concurrent` was taken when the lookup began, and the
    /// wait for one and the lookup together did not end within `dns_timeout`.
    Busy,
    /// The servers answered with an error (no such name, refused, ...) or could not
    /// be reached.
    Error,
}

impl DnsFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            DnsFailure::Timeout => "timeout",
            DnsFailure::Busy => "busy",
            DnsFailure::Error => "error",
        }
    }
}

/// A failed lookup, as the caller reads it. It has no `source()`: an I/O timeout
/// inside the resolver would otherwise make the HTTP client call it a timeout of the
/// upstream.
#[derive(Debug, Error)]
pub(crate) enum DnsError {
    #[error("DNS lookup of {host} got no answer within {timeout:?} ([outbound] dns_timeout)")]
    Timeout { host: String, timeout: Duration },
    #[error(
        "DNS lookup of {host} found all {max} lookup slots taken and got no answer \
         within {timeout:?} ([outbound] dns_max_concurrent, dns_timeout)"
    )]
    Busy {
        host: String,
        max: usize,
        timeout: Duration,
    },
    #[error("DNS lookup of {host} failed: {message}")]
    Failed { host: String, message: String },
}

/// The bounded resolver one worker (one revision of the configuration) uses.
#[derive(Clone)]
pub(crate) struct Dns {
    resolver: TokioResolver,
    /// /etc/hosts as read when this worker (this revision) was built.
    hosts: Arc<Hosts>,
    slots: Arc<Semaphore>,
    config: DnsConfig,
}

impl fmt::Debug for Dns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dns").field("config", &self.config).finish()
    }
}

impl Dns {
    /// The resolver; an error only for a setup hickory cannot build (one needing TLS,
    /// which this build leaves out), said in words.
    pub(crate) fn new(config: &DnsConfig) -> Result<Dns, String> {
        let (system, mut options) = system_conf(config.servers.is_empty());
        let resolver_config = if config.servers.is_empty() {
            system
        } else {
            let (domain, search, _) = system.into_parts();
            ResolverConfig::from_parts(domain, search, name_servers(&config.servers))
        };
        // A query lost on UDP is asked again within the lookup's time: each try gets
        // its share of it (resolv.conf's `attempts`), or resolv.conf's own timeout if
        // shorter. Both address families are asked at once, IPv4 first (as getaddrinfo
        // orders them on most hosts). TCP connections to a server carry at most
        // `max_active_requests` queries: enough for every lookup's two.
        let tries = u32::try_from(options.attempts.max(1)).unwrap_or(u32::MAX);
        options.timeout = options.timeout.min(config.timeout / tries);
        options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        options.max_active_requests = options
            .max_active_requests
            .max(config.max_concurrent.saturating_mul(2));
        let mut builder =
            TokioResolver::builder_with_config(resolver_config, TokioRuntimeProvider::default());
        *builder.options_mut() = options;
        Ok(Dns {
            resolver: builder.build().map_err(|error| error.to_string())?,
            hosts: Arc::new(Hosts::from_system().unwrap_or_default()),
            slots: Arc::new(Semaphore::new(config.max_concurrent.max(1))),
            config: config.clone(),
        })
    }

    /// The addresses of `host` (a domain name: IP literals never get here), within
    /// `dns_timeout`, a wait for a slot included; `localhost` and names in /etc/hosts
    /// without a query or a slot.
    pub(crate) async fn lookup(&self, host: &str) -> Result<Vec<IpAddr>, DnsError> {
        if is_localhost(host) {
            return Ok(vec![Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()]);
        }
        if let Some(found) = in_hosts(&self.hosts, host) {
            return Ok(found);
        }
        let deadline = Instant::now() + self.config.timeout;
        let result = self.bounded(host, deadline).await;
        if let (Err(error), Some(observe)) = (&result, &self.config.on_failure) {
            observe(error.failure());
        }
        result
    }

    async fn bounded(&self, host: &str, deadline: Instant) -> Result<Vec<IpAddr>, DnsError> {
        let timed_out = |waited: bool| {
            let host = host.to_string();
            let timeout = self.config.timeout;
            if waited {
                DnsError::Busy {
                    host,
                    max: self.config.max_concurrent,
                    timeout,
                }
            } else {
                DnsError::Timeout { host, timeout }
            }
        };
        let (_slot, waited) = match self.slots.try_acquire() {
            Ok(slot) => (slot, false),
            // Closed never happens: nothing closes the semaphore.
            Err(_) => match tokio::time::timeout_at(deadline, self.slots.acquire()).await {
                Ok(Ok(slot)) => (slot, true),
                Ok(Err(_)) | Err(_) => return Err(timed_out(true)),
            },
        };
        match tokio::time::timeout_at(deadline, self.resolver.lookup_ip(host)).await {
            Ok(Ok(found)) => Ok(found.iter().collect()),
            // The resolver's own timeout of its last try, at about the same time.
            Ok(Err(NetError::Timeout)) | Err(_) => Err(timed_out(waited)),
            Ok(Err(error)) => Err(DnsError::Failed {
                host: host.to_string(),
                message: error.to_string(),
            }),
        }
    }
}

impl DnsError {
    fn failure(&self) -> DnsFailure {
        match self {
            DnsError::Timeout { .. } => DnsFailure::Timeout,
            DnsError::Busy { .. } => DnsFailure::Busy,
            DnsError::Failed { .. } => DnsFailure::Error,
        }
    }
}

/// `localhost` and names under it, which always mean this host (RFC 6761) and are
/// answered without asking anything.
fn is_localhost(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    host == "localhost" || host.ends_with(".localhost")
}

/// `host`'s addresses in a hosts file, both families, if it names any.
fn in_hosts(hosts: &Hosts, host: &str) -> Option<Vec<IpAddr>> {
    let name = Name::from_str_relaxed(host).ok()?;
    let found: Vec<IpAddr> = [RecordType::A, RecordType::AAAA]
        .into_iter()
        .filter_map(|kind| hosts.lookup_static_host(&Query::query(name.clone(), kind)))
        .flat_map(|lookup| {
            lookup
                .answers()
                .iter()
                .filter_map(|record| record.data.ip_addr())
                .collect::<Vec<_>>()
        })
        .collect();
    (!found.is_empty()).then_some(found)
}

/// /etc/resolv.conf's servers, search list and options; without a usable file, the
/// system resolver's own default (a server on this host) and the default options,
/// said in the log when its servers are the ones asked (`warn`).
fn system_conf(warn: bool) -> (ResolverConfig, ResolverOpts) {
    hickory_resolver::system_conf::read_system_conf().unwrap_or_else(|error| {
        if warn {
            tracing::warn!(%error, "cannot read /etc/resolv.conf; asking a DNS server on this host, as the system resolver would");
        }
        (
            ResolverConfig::from_name_servers(name_servers(&fallback_servers())),
            ResolverOpts::default(),
        )
    })
}

/// Where glibc's resolver asks when /etc/resolv.conf names no server.
fn fallback_servers() -> Vec<SocketAddr> {
    vec![
        SocketAddr::from((Ipv4Addr::LOCALHOST, 53)),
        SocketAddr::from((Ipv6Addr::LOCALHOST, 53)),
    ]
}

/// UDP and TCP on each server's port.
fn name_servers(servers: &[SocketAddr]) -> Vec<NameServerConfig> {
    servers
        .iter()
        .map(|server| {
            let connections = [ConnectionConfig::udp(), ConnectionConfig::tcp()]
                .into_iter()
                .map(|mut connection| {
                    connection.port = server.port();
                    connection
                })
                .collect();
            NameServerConfig::new(server.ip(), true, connections)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn localhost_is_known_without_a_lookup() {
        for host in ["localhost", "LocalHost", "localhost.", "api.localhost"] {
            assert!(is_localhost(host), "{host}");
        }
        for host in ["localhost.example.com", "notlocalhost", "localhostx"] {
            assert!(!is_localhost(host), "{host}");
        }
    }

    #[test]
    fn a_name_in_the_hosts_file_is_answered_from_it_alone() {
        let mut hosts = Hosts::default();
        hosts
            .read_hosts_conf(
                "127.0.0.2 partner.internal\n# a comment\n::2 partner.internal both\n10.0.0.9 both\n"
                    .as_bytes(),
            )
            .expect("hosts");
        let ip = |text: &str| text.parse::<IpAddr>().expect("ip");
        assert_eq!(
            in_hosts(&hosts, "partner.internal"),
            Some(vec![ip("127.0.0.2"), ip("::2")])
        );
        assert_eq!(
            in_hosts(&hosts, "Partner.Internal."),
            in_hosts(&hosts, "partner.internal")
        );
        assert_eq!(
            in_hosts(&hosts, "both"),
            Some(vec![ip("10.0.0.9"), ip("::2")])
        );
        assert_eq!(in_hosts(&hosts, "elsewhere.test"), None);
    }

    #[test]
    fn servers_are_asked_on_their_own_port_over_udp_and_tcp() {
        let servers = name_servers(&["127.0.0.1:5353".parse().expect("addr")]);
        assert_eq!(servers.len(), 1);
        assert_eq!(servers[0].ip, IpAddr::from(Ipv4Addr::LOCALHOST));
        let ports: Vec<u16> = servers[0].connections.iter().map(|c| c.port).collect();
        assert_eq!(ports, [5353, 5353]);
    }

    #[test]
    fn errors_name_the_key_and_have_no_source() {
        let timeout = DnsError::Timeout {
            host: "slow.test".into(),
            timeout: Duration::from_millis(500),
        };
        assert!(timeout.to_string().contains("dns_timeout"), "{timeout}");
        assert!(timeout.to_string().contains("DNS"), "{timeout}");
        assert!(std::error::Error::source(&timeout).is_none());
        let busy = DnsError::Busy {
            host: "slow.test".into(),
            max: 4,
            timeout: Duration::from_secs(1),
        };
        assert!(busy.to_string().contains("dns_max_concurrent"), "{busy}");
        assert_eq!(busy.failure(), DnsFailure::Busy);
        assert_eq!(timeout.failure(), DnsFailure::Timeout);
    }

    /// A server that reads every query and never answers: the lookup ends at the
    /// timeout, and with the one slot taken a second lookup ends `Busy` in the same
    /// time. Both are counted; `localhost` is answered meanwhile.
    #[tokio::test]
    async fn a_silent_server_times_out_and_a_full_cap_is_busy() {
        let silent = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = failures.clone();
        let dns = Dns::new(&DnsConfig {
            timeout: Duration::from_millis(300),
            max_concurrent: 1,
            servers: vec![silent.local_addr().expect("addr")],
            on_failure: Some(Arc::new(move |failure| {
                seen.lock().expect("lock").push(failure);
            })),
        })
        .expect("resolver");
        let started = Instant::now();
        let (first, second, local) = tokio::join!(
            dns.lookup("slow.test"),
            async {
                // Asked once the first holds the one slot.
                tokio::task::yield_now().await;
                dns.lookup("other.test").await
            },
            dns.lookup("localhost"),
        );
        let elapsed = started.elapsed();
        assert!(matches!(first, Err(DnsError::Timeout { .. })), "{first:?}");
        assert!(matches!(second, Err(DnsError::Busy { .. })), "{second:?}");
        assert!(local.is_ok_and(|found| found.contains(&IpAddr::from(Ipv4Addr::LOCALHOST))));
        assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
        let mut counted = failures.lock().expect("lock").clone();
        counted.sort_by_key(|failure| failure.as_str());
        assert_eq!(counted, [DnsFailure::Busy, DnsFailure::Timeout]);
    }
}
