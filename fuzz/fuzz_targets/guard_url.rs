//! Fuzzes the address guard from a URL to a decision: whatever the spelling, a URL
//! whose host the parser turns into a loopback, unspecified or link-local address is
//! denied by the default policy, and nothing panics.
#![no_main]

use std::net::IpAddr;

use libfuzzer_sys::fuzz_target;
use url::{Host, Url};
use webproxy_worker::guard::{GuardPolicy, check, check_url, embedded_ipv4};

fuzz_target!(|text: &str| {
    let Ok(url) = Url::parse(text) else {
        return;
    };
    let strict = GuardPolicy::default();
    let private = GuardPolicy {
        allow_private_networks: true,
        ..GuardPolicy::default()
    };
    let decision = check_url(&url, &strict);
    let _ = check_url(&url, &private);
    let ip = match url.host() {
        Some(Host::Ipv4(v4)) => IpAddr::V4(v4),
        Some(Host::Ipv6(v6)) => IpAddr::V6(v6),
        _ => {
            assert!(decision.is_ok(), "a name is judged when it is resolved");
            return;
        }
    };
    let v4 = match ip {
        IpAddr::V4(v4) => Some(v4),
        IpAddr::V6(v6) => embedded_ipv4(v6).map(|e| e.ipv4),
    };
    let must_deny = ip.is_loopback()
        || ip.is_unspecified()
        || v4.is_some_and(|v4| v4.is_loopback() || v4.is_link_local() || v4.octets()[0] == 0);
    if must_deny {
        assert!(decision.is_err(), "{url} was allowed");
    }
    if let Err(denied) = &decision {
        assert_eq!(denied.address, ip);
        assert_eq!(check(ip, &strict).as_ref(), Err(denied));
    }
});
