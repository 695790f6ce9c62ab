//! The address guard: whether webproxy may connect to an IP address. Pure code, no I/O;
//! the worker applies it to IP-literal URLs before sending and to every address its
//! resolver returns, so the address checked is the address connected to.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use url::{Host, Url};

/// Which addresses may be connected to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GuardPolicy {
    /// Lifts the ranges of the private class: loopback, RFC 1918, CGNAT and
    /// unique-local. Link-local, cloud metadata and the rest stay denied.
    pub allow_private_networks: bool,
    /// Opened whatever default range they fall in, except cloud metadata addresses;
    /// `deny` still wins. Compared with the IPv4 address an IPv6 address embeds, never
    /// with the IPv6 form, so an allow on an embedding prefix opens nothing denied.
    pub allow: Vec<IpNet>,
    /// Denied whatever else is configured.
    pub deny: Vec<IpNet>,
}

/// A destination the guard refuses. What the caller is told ([`fmt::Display`]) names
/// only the kind of range; the address and the exact range are for the log, since telling a caller what an internal name resolves to
/// would map the internal network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    /// The address as it would have been connected to.
    pub address: IpAddr,
    /// The range it fell in, e.g. `the loopback range 127.0.0.0/8`, or for an embedded
    /// IPv4 address `the loopback range 127.0.0.0/8 (as 127.0.0.1 embedded in
    /// IPv4-mapped ::ffff:0:0/96)`.
    pub(crate) range: String,
    /// The kind of range, which is all the caller is told.
    pub(crate) kind: Kind,
    /// Whether the address was judged as the IPv4 address it embeds.
    pub(crate) embedded: bool,
}

impl Denied {
    /// The address and the range that refused it, for the log only.
    #[cfg(test)]
    pub(crate) fn detail(&self) -> String {
        format!("address {} is in {}", self.address, self.range)
    }
}

impl fmt::Display for Denied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "destination not allowed ({}", self.kind)?;
        if self.embedded {
            f.write_str(", as the IPv4 address embedded in an IPv6 one")?;
        }
        f.write_str(")")
    }
}

impl std::error::Error for Denied {}

/// What lifts a default range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// Lifted by `allow_private_networks` (and `allow_cidrs`).
    Private,
    /// Lifted only by `allow_cidrs`.
    Always,
    /// Lifted by nothing: cloud metadata addresses.
    Never,
}

/// The kind of range a denied address is in: what a denial tells the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Unspecified,
    Private,
    SharedAddressSpace,
    Loopback,
    LinkLocal,
    Metadata,
    UniqueLocal,
    Multicast,
    Broadcast,
    Reserved,
    Documentation,
    Benchmarking,
    /// Protocol assignments, relays, discard-only, local-use NAT64, site-local.
    Special,
    /// `[outbound] deny_cidrs`.
    Configured,
}

impl Kind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Unspecified => "unspecified",
            Kind::Private => "private",
            Kind::SharedAddressSpace => "shared address space",
            Kind::Loopback => "loopback",
            Kind::LinkLocal => "link-local",
            Kind::Metadata => "cloud metadata",
            Kind::UniqueLocal => "unique-local",
            Kind::Multicast => "multicast",
            Kind::Broadcast => "broadcast",
            Kind::Reserved => "reserved",
            Kind::Documentation => "documentation",
            Kind::Benchmarking => "benchmarking",
            Kind::Special => "special-purpose",
            Kind::Configured => "[outbound] deny_cidrs",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A default-denied range.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Range {
    pub(crate) net: IpNet,
    pub(crate) name: &'static str,
    pub(crate) kind: Kind,
    pub(crate) class: Class,
}

const fn v4([a, b, c, d]: [u8; 4], len: u8, name: &'static str, kind: Kind, class: Class) -> Range {
    Range {
        net: IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), len)),
        name,
        kind,
        class,
    }
}

const fn v6(segments: [u16; 8], len: u8, name: &'static str, kind: Kind, class: Class) -> Range {
    let [a, b, c, d, e, f, g, h] = segments;
    Range {
        net: IpNet::V6(Ipv6Net::new_assert(
            Ipv6Addr::new(a, b, c, d, e, f, g, h),
            len,
        )),
        name,
        kind,
        class,
    }
}

/// A cloud metadata address: denied whatever is configured.
const fn metadata4(address: [u8; 4], name: &'static str) -> Range {
    v4(address, 32, name, Kind::Metadata, Class::Never)
}

const fn metadata6(segments: [u16; 8], name: &'static str) -> Range {
    v6(segments, 128, name, Kind::Metadata, Class::Never)
}

use Class::{Always, Private};

/// The IPv4 ranges denied by default. More specific entries come first, so an address
/// is named by its most specific range (broadcast before reserved, a metadata address
/// before the range it sits in).
pub(crate) const IPV4_RANGES: &[Range] = &[
    // Cloud metadata services, which hand out credentials.
    metadata4(
        [169, 254, 169, 254],
        "cloud metadata (AWS, GCP, Azure, OpenStack and others)",
    ),
    metadata4([169, 254, 170, 2], "cloud metadata (AWS ECS task)"),
    metadata4([169, 254, 170, 23], "cloud metadata (AWS EKS pod identity)"),
    metadata4([169, 254, 0, 23], "cloud metadata (Tencent Cloud)"),
    metadata4([168, 63, 129, 16], "cloud metadata (Azure WireServer)"),
    metadata4([100, 100, 100, 200], "cloud metadata (Alibaba Cloud)"),
    metadata4([192, 0, 0, 192], "cloud metadata (Oracle Cloud)"),
    v4(
        [0, 0, 0, 0],
        8,
        "\"this network\" (unspecified)",
        Kind::Unspecified,
        Always,
    ),
    v4(
        [10, 0, 0, 0],
        8,
        "private (RFC 1918)",
        Kind::Private,
        Private,
    ),
    v4(
        [100, 64, 0, 0],
        10,
        "shared address space (CGNAT)",
        Kind::SharedAddressSpace,
        Private,
    ),
    v4([127, 0, 0, 0], 8, "loopback", Kind::Loopback, Private),
    v4([169, 254, 0, 0], 16, "link-local", Kind::LinkLocal, Always),
    v4(
        [172, 16, 0, 0],
        12,
        "private (RFC 1918)",
        Kind::Private,
        Private,
    ),
    v4(
        [192, 0, 0, 0],
        24,
        "IETF protocol assignments",
        Kind::Special,
        Always,
    ),
    v4(
        [192, 0, 2, 0],
        24,
        "documentation (TEST-NET-1)",
        Kind::Documentation,
        Always,
    ),
    v4(
        [192, 88, 99, 0],
        24,
        "6to4 relay anycast",
        Kind::Special,
        Always,
    ),
    v4(
        [192, 168, 0, 0],
        16,
        "private (RFC 1918)",
        Kind::Private,
        Private,
    ),
    v4(
        [198, 18, 0, 0],
        15,
        "benchmarking",
        Kind::Benchmarking,
        Always,
    ),
    v4(
        [198, 51, 100, 0],
        24,
        "documentation (TEST-NET-2)",
        Kind::Documentation,
        Always,
    ),
    v4(
        [203, 0, 113, 0],
        24,
        "documentation (TEST-NET-3)",
        Kind::Documentation,
        Always,
    ),
    v4([224, 0, 0, 0], 4, "multicast", Kind::Multicast, Always),
    v4(
        [255, 255, 255, 255],
        32,
        "broadcast",
        Kind::Broadcast,
        Always,
    ),
    v4([240, 0, 0, 0], 4, "reserved", Kind::Reserved, Always),
];

/// The IPv6 ranges denied by default. The forms that embed an IPv4 address are not
/// here: they are unwrapped and judged as that address (see [`embedded_ipv4`]).
pub(crate) const IPV6_RANGES: &[Range] = &[
    // Metadata services inside unique-local: they stay denied when private networks
    // are allowed.
    metadata6(
        [0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254],
        "cloud metadata (AWS)",
    ),
    metadata6(
        [0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x23],
        "cloud metadata (AWS EKS pod identity)",
    ),
    metadata6([0xfd20, 0xce, 0, 0, 0, 0, 0, 0x254], "cloud metadata (GCP)"),
    v6(
        [0, 0, 0, 0, 0, 0, 0, 0],
        128,
        "unspecified",
        Kind::Unspecified,
        Always,
    ),
    v6(
        [0, 0, 0, 0, 0, 0, 0, 1],
        128,
        "loopback",
        Kind::Loopback,
        Private,
    ),
    v6(
        [0x64, 0xff9b, 1, 0, 0, 0, 0, 0],
        48,
        "local-use NAT64",
        Kind::Special,
        Always,
    ),
    v6(
        [0x100, 0, 0, 0, 0, 0, 0, 0],
        64,
        "discard-only",
        Kind::Special,
        Always,
    ),
    v6(
        [0x2001, 2, 0, 0, 0, 0, 0, 0],
        48,
        "benchmarking",
        Kind::Benchmarking,
        Always,
    ),
    v6(
        [0x2001, 0xdb8, 0, 0, 0, 0, 0, 0],
        32,
        "documentation",
        Kind::Documentation,
        Always,
    ),
    v6(
        [0x3fff, 0, 0, 0, 0, 0, 0, 0],
        20,
        "documentation",
        Kind::Documentation,
        Always,
    ),
    v6(
        [0xfc00, 0, 0, 0, 0, 0, 0, 0],
        7,
        "unique-local",
        Kind::UniqueLocal,
        Private,
    ),
    v6(
        [0xfe80, 0, 0, 0, 0, 0, 0, 0],
        10,
        "link-local",
        Kind::LinkLocal,
        Always,
    ),
    v6(
        [0xfec0, 0, 0, 0, 0, 0, 0, 0],
        10,
        "site-local (deprecated)",
        Kind::Special,
        Always,
    ),
    v6(
        [0xff00, 0, 0, 0, 0, 0, 0, 0],
        8,
        "multicast",
        Kind::Multicast,
        Always,
    ),
];

/// An IPv4 address carried inside an IPv6 one, and the form that carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Embedded {
    pub ipv4: Ipv4Addr,
    pub(crate) form: &'static str,
}

/// The IPv4 address an IPv6 address stands for, if it is one of the forms that embed
/// one: IPv4-mapped, IPv4-translated, IPv4-compatible (not `::` or `::1`), NAT64 `64:ff9b::/96`, 6to4
/// `2002::/16` and Teredo `2001::/32` (its client address, stored inverted).
pub fn embedded_ipv4(ip: Ipv6Addr) -> Option<Embedded> {
    let s = ip.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if s[..5] == [0; 5] && s[5] == 0xffff {
        return Some(Embedded {
            ipv4: low,
            form: "IPv4-mapped ::ffff:0:0/96",
        });
    }
    if s[..4] == [0; 4] && s[4] == 0xffff && s[5] == 0 {
        return Some(Embedded {
            ipv4: low,
            form: "IPv4-translated ::ffff:0:0:0/96",
        });
    }
    // `Ipv6Addr::to_ipv4` would turn ::1 into 0.0.0.1; :: and ::1 are IPv6's own
    // unspecified and loopback addresses and are judged as such.
    if s[..6] == [0; 6] && u32::from(low) > 1 {
        return Some(Embedded {
            ipv4: low,
            form: "IPv4-compatible ::/96",
        });
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(Embedded {
            ipv4: low,
            form: "NAT64 64:ff9b::/96",
        });
    }
    if s[0] == 0x2002 {
        return Some(Embedded {
            ipv4: Ipv4Addr::new((s[1] >> 8) as u8, s[1] as u8, (s[2] >> 8) as u8, s[2] as u8),
            form: "6to4 2002::/16",
        });
    }
    if s[..2] == [0x2001, 0] {
        return Some(Embedded {
            ipv4: Ipv4Addr::from(!u32::from(low)),
            form: "Teredo 2001::/32",
        });
    }
    None
}

/// Whether the guard lets webproxy connect to `ip`. In order: `deny` wins (on the
/// address and on the IPv4 address it embeds); an IPv6 address embedding an IPv4 one
/// is judged as that IPv4 address, `allow` included; cloud metadata addresses are
/// denied whatever is configured; then `allow`; then the default ranges, the private
/// ones lifted by `allow_private_networks`.
pub fn check(ip: IpAddr, policy: &GuardPolicy) -> Result<(), Denied> {
    if let Some(net) = policy.deny.iter().find(|n| n.contains(&ip)) {
        return Err(Denied {
            address: ip,
            range: format!("{net} ([outbound] deny_cidrs)"),
            kind: Kind::Configured,
            embedded: false,
        });
    }
    let ranges = match ip {
        IpAddr::V4(_) => IPV4_RANGES,
        IpAddr::V6(v6) => {
            if let Some(embedded) = embedded_ipv4(v6) {
                return check(IpAddr::V4(embedded.ipv4), policy).map_err(|inner| Denied {
                    address: ip,
                    range: format!(
                        "{} (as {} embedded in {})",
                        inner.range, embedded.ipv4, embedded.form
                    ),
                    kind: inner.kind,
                    embedded: true,
                });
            }
            IPV6_RANGES
        }
    };
    let range = ranges.iter().find(|r| r.net.contains(&ip));
    let lifted = match range {
        None => true,
        Some(range) => match range.class {
            Class::Never => false,
            Class::Always => policy.allow.iter().any(|n| n.contains(&ip)),
            Class::Private => {
                policy.allow_private_networks || policy.allow.iter().any(|n| n.contains(&ip))
            }
        },
    };
    match range {
        Some(range) if !lifted => Err(Denied {
            address: ip,
            range: format!("the {} range {}", range.name, range.net),
            kind: range.kind,
            embedded: false,
        }),
        _ => Ok(()),
    }
}

/// The guard's decision on a URL whose host is an IP literal (which no resolver
/// sees); `Ok` for a host name, which is checked when it is resolved. The URL is
/// already normalised, so decimal, octal, hex and short IPv4 spellings are literals.
pub fn check_url(url: &Url, policy: &GuardPolicy) -> Result<(), Denied> {
    match url.host() {
        Some(Host::Ipv4(ip)) => check(IpAddr::V4(ip), policy),
        Some(Host::Ipv6(ip)) => check(IpAddr::V6(ip), policy),
        Some(Host::Domain(_)) | None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> GuardPolicy {
        GuardPolicy::default()
    }

    fn private() -> GuardPolicy {
        GuardPolicy {
            allow_private_networks: true,
            ..GuardPolicy::default()
        }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn net(text: &str) -> IpNet {
        text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[track_caller]
    fn denied(text: &str, policy: &GuardPolicy, range: &str) {
        match check(ip(text), policy) {
            Err(d) => {
                assert_eq!(d.address, ip(text));
                assert!(
                    d.range.contains(range),
                    "{text}: range {:?} does not name {range:?}",
                    d.range
                );
            }
            Ok(()) => panic!("{text} was allowed, expected denied in {range}"),
        }
    }

    #[track_caller]
    fn allowed(text: &str, policy: &GuardPolicy) {
        if let Err(d) = check(ip(text), policy) {
            panic!("{text} was denied: {d}");
        }
    }

    /// Each default range: its first and last address, and the addresses just
    /// outside it, which are public unless a neighbouring range claims them.
    #[test]
    fn ipv4_ranges_at_both_edges() {
        let cases: &[(&str, &str, &str, &str)] = &[
            // (first, last, range named, class)
            ("0.0.0.0", "0.255.255.255", "0.0.0.0/8", "always"),
            ("10.0.0.0", "10.255.255.255", "10.0.0.0/8", "private"),
            ("100.64.0.0", "100.127.255.255", "100.64.0.0/10", "private"),
            ("127.0.0.0", "127.255.255.255", "127.0.0.0/8", "private"),
            ("169.254.0.0", "169.254.255.255", "169.254.0.0/16", "always"),
            ("172.16.0.0", "172.31.255.255", "172.16.0.0/12", "private"),
            ("192.0.0.0", "192.0.0.255", "192.0.0.0/24", "always"),
            ("192.0.2.0", "192.0.2.255", "192.0.2.0/24", "always"),
            ("192.88.99.0", "192.88.99.255", "192.88.99.0/24", "always"),
            (
                "192.168.0.0",
                "192.168.255.255",
                "192.168.0.0/16",
                "private",
            ),
            ("198.18.0.0", "198.19.255.255", "198.18.0.0/15", "always"),
            (
                "198.51.100.0",
                "198.51.100.255",
                "198.51.100.0/24",
                "always",
            ),
            ("203.0.113.0", "203.0.113.255", "203.0.113.0/24", "always"),
            ("224.0.0.0", "239.255.255.255", "224.0.0.0/4", "always"),
            ("240.0.0.0", "255.255.255.254", "240.0.0.0/4", "always"),
            (
                "255.255.255.255",
                "255.255.255.255",
                "255.255.255.255/32",
                "always",
            ),
        ];
        for (first, last, range, class) in cases {
            for address in [first, last] {
                denied(address, &policy(), range);
                if *class == "private" {
                    allowed(address, &private());
                } else {
                    denied(address, &private(), range);
                }
            }
        }
        let outside = [
            "1.0.0.0",
            "9.255.255.255",
            "11.0.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "169.253.255.255",
            "169.255.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "191.255.255.255",
            "192.0.1.0",
            "192.0.3.0",
            "192.88.98.255",
            "192.88.100.0",
            "192.167.255.255",
            "192.169.0.0",
            "198.17.255.255",
            "198.20.0.0",
            "198.51.99.255",
            "198.51.101.0",
            "203.0.112.255",
            "203.0.114.0",
            "223.255.255.255",
            "8.8.8.8",
        ];
        for address in outside {
            allowed(address, &policy());
        }
    }

    #[test]
    fn ipv6_ranges_at_both_edges() {
        let cases: &[(&str, &str, &str, &str)] = &[
            ("::", "::", "unspecified", "always"),
            ("::1", "::1", "loopback", "private"),
            (
                "64:ff9b:1::",
                "64:ff9b:1:ffff:ffff:ffff:ffff:ffff",
                "64:ff9b:1::/48",
                "always",
            ),
            ("100::", "100::ffff:ffff:ffff:ffff", "100::/64", "always"),
            (
                "2001:2::",
                "2001:2:0:ffff:ffff:ffff:ffff:ffff",
                "2001:2::/48",
                "always",
            ),
            (
                "2001:db8::",
                "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff",
                "2001:db8::/32",
                "always",
            ),
            (
                "3fff::",
                "3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff",
                "3fff::/20",
                "always",
            ),
            (
                "fc00::",
                "fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "fc00::/7",
                "private",
            ),
            (
                "fe80::",
                "febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "fe80::/10",
                "always",
            ),
            (
                "fec0::",
                "feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "fec0::/10",
                "always",
            ),
            (
                "ff00::",
                "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "ff00::/8",
                "always",
            ),
        ];
        for (first, last, range, class) in cases {
            for address in [first, last] {
                denied(address, &policy(), range);
                if *class == "private" {
                    allowed(address, &private());
                } else {
                    denied(address, &private(), range);
                }
            }
        }
        let outside = [
            "::2:0:0",
            "64:ff9a:ffff:ffff:ffff:ffff:ffff:ffff",
            "64:ff9b:2::",
            "64:ff9b:0:ffff:ffff:ffff:ffff:ffff",
            "ff::",
            "100:0:0:1::",
            "2001:1:ffff:ffff:ffff:ffff:ffff:ffff",
            "2001:2:1::",
            "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff",
            "2001:db9::",
            "3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "3fff:1000::",
            "fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "fe00::",
            "2606:4700::1111",
        ];
        for address in outside {
            allowed(address, &policy());
        }
    }

    /// Every cloud metadata address, IPv4 and IPv6, in every embedding: denied with
    /// private networks allowed and with `allow_cidrs` covering everything.
    #[test]
    fn cloud_metadata_is_denied_whatever_is_configured() {
        let open_everything = GuardPolicy {
            allow_private_networks: true,
            allow: vec![net("0.0.0.0/0"), net("::/0")],
            deny: Vec::new(),
        };
        let exact = GuardPolicy {
            allow: vec![net("168.63.129.16/32"), net("fd20:ce::254/128")],
            ..GuardPolicy::default()
        };
        for address in [
            "169.254.169.254",
            "169.254.170.2",
            "169.254.170.23",
            "169.254.0.23",
            "168.63.129.16",
            "100.100.100.200",
            "192.0.0.192",
            "fd00:ec2::254",
            "fd00:ec2::23",
            "fd20:ce::254",
            "::ffff:169.254.169.254",
            "::ffff:168.63.129.16",
            "::ffff:0:168.63.129.16",
            "64:ff9b::a83f:8110",
            "2002:a83f:8110::",
        ] {
            for policy in [policy(), private(), open_everything.clone(), exact.clone()] {
                denied(address, &policy, "cloud metadata");
                let d = check(ip(address), &policy).expect_err("denied");
                assert_eq!(d.kind, Kind::Metadata, "{address}");
            }
        }
        // Its neighbours are only link-local, public, CGNAT and unique-local.
        allowed("168.63.129.15", &policy());
        allowed("168.63.129.17", &policy());
        allowed("169.254.169.253", &open_everything);
        allowed("100.100.100.199", &private());
        allowed("100.100.100.201", &private());
        allowed("fd00:ec2::253", &private());
        allowed("fd00:ec2::255", &private());
        allowed("fd20:ce::253", &private());
        allowed("fd20:ce::255", &private());
    }

    #[test]
    fn ipv4_mapped_is_judged_as_ipv4() {
        denied("::ffff:127.0.0.1", &policy(), "127.0.0.0/8");
        denied("::ffff:127.0.0.1", &policy(), "IPv4-mapped");
        denied("::ffff:0.0.0.0", &policy(), "0.0.0.0/8");
        denied("::ffff:10.0.0.1", &policy(), "10.0.0.0/8");
        denied("::ffff:169.254.1.1", &policy(), "169.254.0.0/16");
        denied("::ffff:255.255.255.255", &policy(), "broadcast");
        allowed("::ffff:8.8.8.8", &policy());
        allowed("::ffff:127.0.0.1", &private());
        // Just outside ::ffff:0:0/96 on both sides: no longer IPv4-mapped.
        allowed("::fffe:ffff:ffff", &policy());
        allowed("::1:0:0:0", &policy());
    }

    #[test]
    fn ipv4_translated_is_judged_as_ipv4() {
        denied("::ffff:0:127.0.0.1", &policy(), "IPv4-translated");
        denied("::ffff:0:127.0.0.1", &policy(), "127.0.0.0/8");
        denied("::ffff:0:10.0.0.1", &policy(), "10.0.0.0/8");
        denied("::ffff:0:169.254.1.1", &private(), "169.254.0.0/16");
        allowed("::ffff:0:8.8.8.8", &policy());
        allowed("::ffff:0:127.0.0.1", &private());
        // Just outside ::ffff:0:0:0/96: ::ffff:1:0:0 and ::fffe:ffff:ffff:ffff.
        allowed("::ffff:1:0:0", &policy());
        allowed("::fffe:ffff:ffff:ffff", &policy());
    }

    #[test]
    fn ipv4_compatible_is_judged_as_ipv4_except_unspecified_and_loopback() {
        denied("::127.0.0.1", &policy(), "IPv4-compatible");
        denied("::127.0.0.1", &policy(), "127.0.0.0/8");
        denied("::10.1.2.3", &policy(), "10.0.0.0/8");
        allowed("::8.8.8.8", &policy());
        // :: and ::1 are IPv6's unspecified and loopback, not 0.0.0.0 and 0.0.0.1.
        denied("::", &policy(), "the unspecified range ::/128");
        denied("::1", &policy(), "the loopback range ::1/128");
        allowed("::1", &private());
        denied("::", &private(), "unspecified");
        // ::2 is 0.0.0.2, in 0.0.0.0/8, which stays denied as a whole.
        denied("::2", &private(), "0.0.0.0/8");
        denied("::0.255.255.255", &private(), "0.0.0.0/8");
        allowed("::1.0.0.0", &policy());
        // The last IPv4-compatible address and the first one outside.
        denied("::255.255.255.255", &policy(), "broadcast");
        allowed("::1:0:0", &policy());
    }

    #[test]
    fn nat64_is_judged_as_ipv4() {
        denied("64:ff9b::127.0.0.1", &policy(), "NAT64");
        denied("64:ff9b::127.0.0.1", &policy(), "127.0.0.0/8");
        denied("64:ff9b::a9fe:101", &private(), "169.254.0.0/16");
        denied("64:ff9b::", &policy(), "0.0.0.0/8");
        denied("64:ff9b::ffff:ffff", &policy(), "broadcast");
        allowed("64:ff9b::8.8.8.8", &policy());
        // Just past the /96: neither NAT64 nor any other range.
        allowed("64:ff9b::1:0:0", &policy());
    }

    #[test]
    fn sixtofour_is_judged_as_ipv4() {
        // 2002:7f00:1:: carries 127.0.0.1.
        denied("2002:7f00:1::", &policy(), "6to4");
        denied("2002:7f00:1::", &policy(), "127.0.0.0/8");
        denied("2002:a9fe:101::1", &private(), "169.254.0.0/16");
        denied("2002::", &policy(), "0.0.0.0/8");
        denied(
            "2002:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            &policy(),
            "broadcast",
        );
        allowed("2002:808:808::1", &policy());
        allowed("2001:ffff:ffff:ffff:ffff:ffff:ffff:ffff", &policy());
        allowed("2003::", &policy());
    }

    #[test]
    fn teredo_is_judged_as_its_client_ipv4() {
        // The client address is stored inverted: !127.0.0.1 = 80ff:fffe.
        denied("2001:0:4136:e378:8000:63bf:80ff:fffe", &policy(), "Teredo");
        denied(
            "2001:0:4136:e378:8000:63bf:80ff:fffe",
            &policy(),
            "127.0.0.0/8",
        );
        // !0.0.0.0 and !255.255.255.255 at the edges of the client field.
        denied("2001::ffff:ffff", &policy(), "0.0.0.0/8");
        denied("2001:0:ffff:ffff:ffff:ffff::", &policy(), "broadcast");
        // !8.8.8.8 = f7f7:f7f7
        allowed("2001:0:4136:e378:8000:63bf:f7f7:f7f7", &policy());
        // Just outside 2001::/32.
        allowed("2000:ffff:ffff:ffff:ffff:ffff:ffff:ffff", &policy());
        allowed("2001:1::", &policy());
    }

    #[test]
    fn allow_cidrs_open_exactly_what_they_name() {
        let policy = GuardPolicy {
            allow: vec![net("127.0.0.2/32"), net("169.254.10.0/24")],
            ..GuardPolicy::default()
        };
        allowed("127.0.0.2", &policy);
        allowed("::ffff:127.0.0.2", &policy);
        allowed("64:ff9b::127.0.0.2", &policy);
        allowed("169.254.10.1", &policy);
        denied("127.0.0.1", &policy, "127.0.0.0/8");
        denied("127.0.0.3", &policy, "127.0.0.0/8");
        denied("169.254.11.1", &policy, "169.254.0.0/16");
        denied("::1", &policy, "loopback");
    }

    /// An allow on a prefix that embeds IPv4 addresses is compared only after
    /// unwrapping, so it never opens the private, loopback or metadata addresses
    /// embedded in it; it opens nothing the IPv4 address alone would not.
    #[test]
    fn allow_cidrs_apply_after_unwrapping_embedded_ipv4() {
        for prefix in [
            "::ffff:0:0/96",
            "::ffff:0:0:0/96",
            "::/96",
            "64:ff9b::/96",
            "2002::/16",
            "2001::/32",
            "::/0",
        ] {
            let policy = GuardPolicy {
                allow: vec![net(prefix)],
                ..GuardPolicy::default()
            };
            for address in [
                "::ffff:127.0.0.1",
                "::ffff:0:127.0.0.1",
                "::127.0.0.1",
                "64:ff9b::10.0.0.1",
                "2002:c0a8:101::",
                "2001:0:4136:e378:8000:63bf:80ff:fffe",
                "::ffff:169.254.169.254",
            ] {
                let d = check(ip(address), &policy)
                    .expect_err(&format!("{address} opened by {prefix}"));
                assert!(d.embedded, "{address}");
            }
            allowed("::ffff:8.8.8.8", &policy);
        }
    }

    #[test]
    fn deny_cidrs_win_over_allow_cidrs_and_public_ranges() {
        let policy = GuardPolicy {
            allow_private_networks: true,
            allow: vec![net("127.0.0.0/8"), net("8.8.0.0/16")],
            deny: vec![net("127.0.0.2/32"), net("8.8.8.0/24")],
        };
        allowed("127.0.0.1", &policy);
        denied("127.0.0.2", &policy, "127.0.0.2/32 ([outbound] deny_cidrs)");
        denied("::ffff:127.0.0.2", &policy, "127.0.0.2/32");
        denied("8.8.8.8", &policy, "8.8.8.0/24");
        allowed("8.8.9.9", &policy);
        allowed("8.8.7.255", &policy);
    }

    /// What the caller is told names the kind of range and never the address; the
    /// address and the range are in the detail, for the log.
    #[test]
    fn denial_tells_the_kind_and_keeps_the_address_for_the_log() {
        let d = check(ip("10.20.30.40"), &policy()).expect_err("denied");
        assert_eq!(d.to_string(), "destination not allowed (private)");
        assert_eq!(
            d.detail(),
            "address 10.20.30.40 is in the private (RFC 1918) range 10.0.0.0/8"
        );
        let d = check(ip("::ffff:127.0.0.1"), &policy()).expect_err("denied");
        assert_eq!(
            d.to_string(),
            "destination not allowed (loopback, as the IPv4 address embedded in an IPv6 one)"
        );
        assert_eq!(
            d.detail(),
            "address ::ffff:127.0.0.1 is in the loopback range 127.0.0.0/8 (as 127.0.0.1 embedded in IPv4-mapped ::ffff:0:0/96)"
        );
        let deny = GuardPolicy {
            deny: vec![net("8.8.8.0/24")],
            ..GuardPolicy::default()
        };
        let d = check(ip("8.8.8.8"), &deny).expect_err("denied");
        assert_eq!(
            d.to_string(),
            "destination not allowed ([outbound] deny_cidrs)"
        );
        for (address, kind) in [
            ("127.0.0.1", "loopback"),
            ("::1", "loopback"),
            ("169.254.169.254", "cloud metadata"),
            ("169.254.1.1", "link-local"),
            ("100.64.0.1", "shared address space"),
            ("fd12::1", "unique-local"),
            ("0.0.0.0", "unspecified"),
            ("224.0.0.1", "multicast"),
        ] {
            let shown = check(ip(address), &policy())
                .expect_err("denied")
                .to_string();
            assert_eq!(shown, format!("destination not allowed ({kind})"));
            assert!(!shown.contains(address), "{shown}");
        }
    }

    #[test]
    fn urls_with_ip_literals_in_any_spelling_are_checked() {
        for text in [
            "http://127.0.0.1/",
            "http://2130706433/",
            "http://0177.0.0.1/",
            "http://0x7f.0.0.1/",
            "http://0x7f000001/",
            "http://127.1/",
            "http://127.0.1/",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:7f00:1]/",
            "http://0.0.0.0/",
            "http://0/",
            "https://169.254.169.254/latest/meta-data/",
        ] {
            let url = Url::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(check_url(&url, &policy()).is_err(), "{text} -> {url}");
        }
        for text in [
            "http://example.com/",
            "http://localhost/",
            "http://8.8.8.8/",
        ] {
            let url = Url::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(check_url(&url, &policy()).is_ok(), "{text}");
        }
    }
}
