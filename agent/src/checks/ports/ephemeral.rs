//! The node's ephemeral port range and reserved ports, and the planned fixed ports an outgoing
//! connection could take from under their owner.

use std::collections::BTreeMap;
use std::path::Path;

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::PortExpectation;

use super::{join, NAME};

/// The node's ephemeral port range (`net.ipv4.ip_local_port_range`, which IPv6 uses too) and
/// the ports excluded from it (`net.ipv4.ip_local_reserved_ports`): the source ports the kernel
/// picks for outgoing connections. A fixed port inside the range and not reserved can be taken
/// by any outgoing connection, and its owner's `bind` then fails with `EADDRINUSE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EphemeralRange {
    /// Lowest port of the range (inclusive).
    pub low: u16,
    /// Highest port of the range (inclusive).
    pub high: u16,
    /// Reserved ranges, inclusive (a single port is `(p, p)`).
    pub reserved: Vec<(u16, u16)>,
}

impl EphemeralRange {
    /// True when `port` lies in `low..=high`.
    pub fn contains(&self, port: u16) -> bool {
        (self.low..=self.high).contains(&port)
    }

    /// True when `port` is in `ip_local_reserved_ports`.
    pub fn is_reserved(&self, port: u16) -> bool {
        self.reserved.iter().any(|(a, b)| (*a..=*b).contains(&port))
    }

    /// True when an outgoing connection can take `port` as its source port.
    pub fn at_risk(&self, port: u16) -> bool {
        self.contains(port) && !self.is_reserved(port)
    }

    /// `low-high`, e.g. `32768-60999`.
    pub fn range_text(&self) -> String {
        format!("{}-{}", self.low, self.high)
    }
}

/// Parses `ip_local_port_range` (`"32768\t60999\n"`). `None` unless two ports, low ≤ high.
pub fn parse_port_range(text: &str) -> Option<(u16, u16)> {
    let mut it = text.split_whitespace().map(|w| w.parse::<u16>());
    match (it.next(), it.next(), it.next()) {
        (Some(Ok(low)), Some(Ok(high)), None) if low <= high => Some((low, high)),
        _ => None,
    }
}

/// Parses `ip_local_reserved_ports` (`"8000-8010,50051\n"`, empty when none). `None` on an
/// entry that is not a port or an ascending `a-b` range.
pub fn parse_reserved_ports(text: &str) -> Option<Vec<(u16, u16)>> {
    let text = text.trim();
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(',')
        .map(|entry| {
            let entry = entry.trim();
            match entry.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                    (a <= b).then_some((a, b))
                }
                None => entry.parse().ok().map(|p| (p, p)),
            }
        })
        .collect()
}

/// Reads `<proc_root>/sys/net/ipv4/ip_local_port_range` and `ip_local_reserved_ports` (both
/// per network namespace: the reading process's, the host's for a hostNetwork agent). Errors:
/// the file and cause, when either cannot be read or parsed.
pub fn read_ephemeral_range(proc_root: &Path) -> Result<EphemeralRange, String> {
    let dir = proc_root.join("sys").join("net").join("ipv4");
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))
    };
    let range = read("ip_local_port_range")?;
    let (low, high) = parse_port_range(&range).ok_or_else(|| {
        format!(
            "{}: unreadable value {:?}",
            dir.join("ip_local_port_range").display(),
            range.trim()
        )
    })?;
    let reserved = read("ip_local_reserved_ports")?;
    let reserved = parse_reserved_ports(&reserved).ok_or_else(|| {
        format!(
            "{}: unreadable value {:?}",
            dir.join("ip_local_reserved_ports").display(),
            reserved.trim()
        )
    })?;
    Ok(EphemeralRange {
        low,
        high,
        reserved,
    })
}

/// Subject of the [`evaluate_ephemeral_range`] result.
pub const EPHEMERAL_SUBJECT: &str = "ephemeral-range";

/// The `ephemeral-range` result for the plan's expectations (one per distinct port):
/// `PortsInEphemeralRange` (Warning) naming each planned port an outgoing connection can take
/// and the range, `EphemeralRangeClear` (Ok) when none (reserved ones named), or
/// `EphemeralRangeUnknown` (Unknown) with the cause when the range cannot be read.
pub fn evaluate_ephemeral_range(
    ports: &[PortExpectation],
    range: Result<&EphemeralRange, &str>,
) -> CheckResult {
    let mut planned: BTreeMap<u16, Vec<&str>> = BTreeMap::new();
    for p in ports {
        let purposes = planned.entry(p.port).or_default();
        if !p.purpose.is_empty() && !purposes.contains(&p.purpose.as_str()) {
            purposes.push(&p.purpose);
        }
    }
    let range = match range {
        Ok(r) => r,
        Err(e) => {
            return CheckResult::new(
                NAME,
                EPHEMERAL_SUBJECT,
                CheckStatus::Unknown,
                "EphemeralRangeUnknown",
                format!(
                    "cannot read the node's ephemeral port range ({e}); whether an outgoing \
                     connection can take a planned port is unknown."
                ),
            )
        }
    };
    let label = |port: &u16| {
        let purposes = &planned[port];
        if purposes.is_empty() {
            port.to_string()
        } else {
            format!("{port} ({})", purposes.join(", "))
        }
    };
    let at_risk: Vec<u16> = planned
        .keys()
        .copied()
        .filter(|p| range.at_risk(*p))
        .collect();
    let reserved: Vec<u16> = planned
        .keys()
        .copied()
        .filter(|p| range.contains(*p) && range.is_reserved(*p))
        .collect();
    let text = range.range_text();
    let result = if at_risk.is_empty() {
        CheckResult::new(
            NAME,
            EPHEMERAL_SUBJECT,
            CheckStatus::Ok,
            "EphemeralRangeClear",
            format!(
                "no planned port can be taken as an outgoing connection's source port: none lies \
                 in the ephemeral range {text} (net.ipv4.ip_local_port_range){}.",
                if reserved.is_empty() {
                    String::new()
                } else {
                    format!(
                        " unreserved; {} reserved in net.ipv4.ip_local_reserved_ports",
                        reserved.iter().map(label).collect::<Vec<_>>().join(", ")
                    )
                }
            ),
        )
    } else {
        CheckResult::new(
            NAME,
            EPHEMERAL_SUBJECT,
            CheckStatus::Warning,
            "PortsInEphemeralRange",
            format!(
                "planned port{} {} lie{} in the node's ephemeral port range {text} \
                 (net.ipv4.ip_local_port_range): any outgoing connection may take {} as its \
                 source port, and the owner's bind then fails with EADDRINUSE until that \
                 connection closes. Reserve {} (sysctl net.ipv4.ip_local_reserved_ports={}) or \
                 move {} out of the range.",
                if at_risk.len() == 1 { "" } else { "s" },
                at_risk.iter().map(label).collect::<Vec<_>>().join(", "),
                if at_risk.len() == 1 { "s" } else { "" },
                if at_risk.len() == 1 { "it" } else { "one" },
                if at_risk.len() == 1 { "it" } else { "them" },
                join(&at_risk),
                if at_risk.len() == 1 { "it" } else { "them" },
            ),
        )
        .with("atRiskPorts", join(&at_risk))
    };
    let mut result = result.with("ephemeralRange", text);
    if !reserved.is_empty() {
        result = result.with("reservedPorts", join(&reserved));
    }
    result
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use ic_shared::plan::PortExpect;

    #[test]
    fn ephemeral_range_and_reserved_ports() {
        assert_eq!(parse_port_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_port_range("50051 50051"), Some((50051, 50051)));
        assert_eq!(parse_port_range("60999 32768"), None);
        assert_eq!(parse_port_range("1 2 3"), None);
        assert_eq!(parse_reserved_ports("\n"), Some(vec![]));
        assert_eq!(
            parse_reserved_ports("8000-8010,50051\n"),
            Some(vec![(8000, 8010), (50051, 50051)])
        );
        assert_eq!(parse_reserved_ports("9-1"), None);
        assert_eq!(parse_reserved_ports("x"), None);

        let range = EphemeralRange {
            low: 32768,
            high: 60999,
            reserved: vec![(50051, 50051)],
        };
        let exp = |port, purpose: &str| PortExpectation {
            port,
            expect: PortExpect::Free,
            owner: None,
            purpose: purpose.into(),
        };
        // 50051 is reserved: clear, and says so.
        let r = evaluate_ephemeral_range(&[exp(50051, "rpc"), exp(8080, "http")], Ok(&range));
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Ok, "EphemeralRangeClear")
        );
        assert_eq!(r.observed["reservedPorts"], "50051");
        // Unreserved: a Warning naming the port, its purpose and the range.
        let open = EphemeralRange {
            reserved: vec![],
            ..range.clone()
        };
        let r = evaluate_ephemeral_range(
            &[exp(50051, "rpc"), exp(50051, "rpc"), exp(8080, "http")],
            Ok(&open),
        );
        assert_eq!(
            (r.status, r.reason.as_str()),
            (CheckStatus::Warning, "PortsInEphemeralRange")
        );
        assert!(r.message.contains("50051 (rpc)"), "{}", r.message);
        assert!(r.message.contains("32768-60999"), "{}", r.message);
        assert!(!r.message.contains("8080"), "{}", r.message);
        assert_eq!(r.observed["atRiskPorts"], "50051");
        let r = evaluate_ephemeral_range(&[exp(1, "")], Err("no file"));
        assert_eq!(r.reason, "EphemeralRangeUnknown");
    }
}
