//! The policy: what the fabric must do, as TOML. Every section is optional; a check whose
//! section (or key) is absent is not run. Unknown keys and out-of-range values are refused
//! with the file, line and column (the value types below check their own ranges, so the
//! TOML parser reports where).

use std::{fmt, net::IpAddr};

use serde::{Deserialize, Deserializer, Serialize, de};

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    #[serde(default)]
    pub class: Option<ClassPolicy>,
    #[serde(default)]
    pub ecn: Option<EcnPolicy>,
    #[serde(default)]
    pub hops: Vec<HopRule>,
    #[serde(default)]
    pub ecmp: Option<EcmpPolicy>,
    #[serde(default)]
    pub reliability: Option<ReliabilityPolicy>,
    #[serde(default)]
    pub mtu: Option<MtuPolicy>,
    #[serde(default)]
    pub stability: Option<StabilityPolicy>,
    #[serde(default)]
    pub drill: Option<DrillPolicy>,
    #[serde(default)]
    pub baseline: Option<BaselinePolicy>,
    #[serde(default)]
    pub pfc: Option<PfcPolicy>,
    #[serde(default)]
    pub nic: Option<NicPolicy>,
}

/// PFC, from the NICs' per-priority pause counters.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PfcPolicy {
    /// The priorities PFC should pause (the RDMA class): pause on any other fails.
    pub lossless_priorities: Option<Vec<Pcp>>,
    /// Largest share of an interval a port may spend paused, per priority and direction.
    pub max_pause_ratio: Option<Fraction>,
    /// No pause storm (the NIC's storm events, or a priority paused 95% of two intervals
    /// in a row).
    #[serde(default)]
    pub no_storm: bool,
}

/// The RDMA NICs' own counters.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NicPolicy {
    /// PSN sequence errors per million RDMA packets, per port and side.
    pub max_seq_err_ppm: Option<u64>,
    /// Local ACK timeouts per second, per port.
    pub max_timeout_per_s: Option<Rate>,
    /// The CNPs a NIC sent and handled against those on the wire: the tolerance.
    pub cnp_consistency: Option<Fraction>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClassPolicy {
    /// DSCP of RDMA data (requests) at every point.
    pub data_dscp: Option<Dscp>,
    /// PCP of RDMA data where frames carry a tag.
    pub data_pcp: Option<Pcp>,
    /// DSCP of CNPs at every point.
    pub cnp_dscp: Option<Dscp>,
    /// No DSCP change along any path, either direction.
    #[serde(default)]
    pub no_change: bool,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EcnPolicy {
    /// Data leaves ECN-capable: no Not-ECT data packet at a flow's first point.
    #[serde(default)]
    pub data_ect: bool,
    /// Largest CE fraction of a data flow (at its last point) on an idle fabric.
    pub ce_max_idle: Option<Fraction>,
    /// Smallest CE fraction over all data flows under congestion (`--load congested`).
    pub ce_min_congested: Option<Fraction>,
    /// Every data flow with CE marks gets CNPs back.
    #[serde(default)]
    pub cnp_answers_ce: bool,
    /// … at least this many per CE mark (a notification point rate-limits CNPs per QP,
    /// so fewer than one per mark is normal).
    pub min_cnps_per_ce: Option<Fraction>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HopRule {
    pub from: Prefix,
    pub to: Prefix,
    /// Routed hops (TTL decrements) between the two groups, either direction.
    pub count: u8,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EcmpPolicy {
    /// The nodes flows spread over (agent node names, or hop addresses from probes).
    #[serde(deserialize_with = "at_least_two")]
    pub via: Vec<String>,
    /// No one of them carries more than this share of the data flows.
    pub max_share: Fraction,
    /// With fewer data flows than this the spread is not judged (could not check).
    #[serde(default = "default_min_flows")]
    pub min_flows: u32,
}

fn at_least_two<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let v = Vec::<String>::deserialize(d)?;
    if v.len() < 2 {
        return Err(de::Error::custom(
            "`via` needs the two or more nodes traffic spreads over",
        ));
    }
    Ok(v)
}

fn default_min_flows() -> u32 {
    4
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReliabilityPolicy {
    /// NAKs per million packets of the flow they answer.
    pub max_nak_ppm: Option<u64>,
    /// PSN gaps seen by any point, per million packets of the flow.
    pub max_psn_gap_ppm: Option<u64>,
    /// Sampled packets lost between observation points, per million trajectories.
    pub max_loss_ppm: Option<u64>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MtuPolicy {
    /// RoCE path MTU (256, 512, 1024, 2048 or 4096): data frames must fit it, and the
    /// largest data frames a flow sends must cross every point of its path.
    pub roce_mtu: RoceMtu,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StabilityPolicy {
    /// (max − min) / mean of per-flow bytes among the data flows of one host pair.
    pub max_throughput_spread: Option<Fraction>,
    /// Flows with fewer packets are not judged.
    #[serde(default = "default_min_packets")]
    pub min_packets: u64,
    /// Over time: the coefficient of variation (standard deviation / mean) of each data
    /// flow's delivered rate across counter intervals.
    pub max_rate_cv: Option<Fraction>,
    /// Complete intervals a flow needs before its rate over time is judged.
    #[serde(default = "default_min_intervals")]
    pub min_intervals: usize,
}

fn default_min_intervals() -> usize {
    3
}

fn default_min_packets() -> u64 {
    100
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DrillPolicy {
    /// Sampled packets lost during the failure, at most.
    pub max_lost: Option<u64>,
    /// Time from the failure until every affected flow is back on a remaining path.
    pub max_recovery_ms: Option<u64>,
    /// After the link comes back, every flow is on its path from before the failure.
    #[serde(default)]
    pub must_return: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BaselinePolicy {
    /// How much the throughput spread may grow over the baseline's.
    pub max_spread_growth: Fraction,
}

/// Why policy text is not a policy.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Not TOML, an unknown key, or a value out of its range; the message names the line
    /// and column.
    #[error("{}", .0.to_string().trim_end())]
    Toml(#[from] toml::de::Error),
    #[error("the policy states no rule")]
    NoRule,
}

impl Policy {
    /// Parses policy text; the error names the line and column.
    pub fn parse(text: &str) -> Result<Self, PolicyError> {
        let p: Policy = toml::from_str(text)?;
        if p == Policy::default() {
            return Err(PolicyError::NoRule);
        }
        Ok(p)
    }
}

macro_rules! ranged {
    ($name:ident, $t:ty, $ok:expr, $what:literal) => {
        #[derive(Clone, Copy, Debug, Serialize, PartialEq, PartialOrd)]
        #[serde(transparent)]
        pub struct $name(pub $t);
        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let v = <$t>::deserialize(d)?;
                let ok: fn($t) -> bool = $ok;
                if ok(v) {
                    Ok(Self(v))
                } else {
                    Err(de::Error::custom(format!("{v} is not {}", $what)))
                }
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

ranged!(Dscp, u8, |v| v < 64, "a DSCP (0..=63)");
ranged!(Pcp, u8, |v| v < 8, "a PCP (0..=7)");
ranged!(
    Fraction,
    f64,
    |v| (0.0..=1.0).contains(&v),
    "a fraction (0.0..=1.0)"
);
ranged!(
    Rate,
    f64,
    |v| v.is_finite() && v >= 0.0,
    "a rate (0 or more per second)"
);
ranged!(
    RoceMtu,
    u16,
    |v| matches!(v, 256 | 512 | 1024 | 2048 | 4096),
    "a RoCE MTU (256, 512, 1024, 2048 or 4096)"
);

/// An address prefix, `10.0.1.0/24` or `fd00::/64` (a bare address is a /32 or /128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    pub addr: IpAddr,
    pub len: u8,
}

impl Prefix {
    pub fn contains(&self, a: IpAddr) -> bool {
        match (self.addr, a) {
            (IpAddr::V4(p), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - self.len as u32).unwrap_or(0);
                u32::from(p) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(p), IpAddr::V6(a)) => {
                let mask = u128::MAX.checked_shl(128 - self.len as u32).unwrap_or(0);
                u128::from(p) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

impl std::str::FromStr for Prefix {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, l) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = a.parse().map_err(|_| format!("`{s}` is not an address prefix"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = if l.is_empty() {
            max
        } else {
            l.parse::<u8>()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(|| format!("`{s}`: prefix length must be 0..={max}"))?
        };
        Ok(Self { addr, len })
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl<'de> Deserialize<'de> for Prefix {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(de::Error::custom)
    }
}

impl Serialize for Prefix {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_example_policy_parses() {
        let text = include_str!("../../dist/fabric-policy.toml");
        let p = Policy::parse(text).unwrap();
        assert_eq!(p.class.unwrap().data_dscp, Some(Dscp(26)));
        assert_eq!(p.hops.len(), 2);
    }

    #[test]
    fn unknown_keys_are_refused_with_their_line() {
        let e = Policy::parse("[class]\ndata_dscp = 26\ndata_dcsp = 3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 3"), "{e}");
        assert!(e.contains("data_dcsp"), "{e}");
        let e = Policy::parse("[clas]\ndata_dscp = 26\n").unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("clas"), "{e}");
    }

    #[test]
    fn out_of_range_values_are_refused_with_their_line_and_reason() {
        for (text, line, why) in [
            ("[class]\n\ndata_dscp = 70\n", "line 3", "DSCP"),
            ("[class]\ndata_pcp = 9\n", "line 2", "PCP"),
            ("[ecn]\nce_max_idle = 1.5\n", "line 2", "fraction"),
            ("[mtu]\nroce_mtu = 1500\n", "line 2", "RoCE MTU"),
            (
                "[[hops]]\nfrom = \"10.0.0.0/33\"\nto = \"10.0.1.0/24\"\ncount = 3\n",
                "line 2",
                "prefix length",
            ),
            ("[class]\ndata_dscp = \"af31\"\n", "line 2", "expected u8"),
            (
                "[ecmp]\nvia = [\"s1\"]\nmax_share = 0.5\n",
                "line 2",
                "two or more",
            ),
        ] {
            let e = Policy::parse(text).unwrap_err().to_string();
            assert!(e.contains(line) && e.contains(why), "{text:?}: {e}");
        }
        assert!(matches!(Policy::parse(""), Err(PolicyError::NoRule)));
    }

    #[test]
    fn prefixes_match_their_family_and_length() {
        let p: Prefix = "10.10.1.0/24".parse().unwrap();
        assert!(p.contains("10.10.1.2".parse().unwrap()));
        assert!(!p.contains("10.10.2.2".parse().unwrap()));
        assert!(!p.contains("fd00::1".parse().unwrap()));
        let all: Prefix = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("192.0.2.1".parse().unwrap()));
        let v6: Prefix = "fd00:10:3::/64".parse().unwrap();
        assert!(v6.contains("fd00:10:3::2".parse().unwrap()));
        assert!(!v6.contains("fd00:10:4::2".parse().unwrap()));
        let host: Prefix = "10.0.0.1".parse().unwrap();
        assert_eq!(host.len, 32);
    }
}
