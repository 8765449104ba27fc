//! A flow and a packet as the whole fabric knows them: what stays the same for one QP
//! direction at every point, and for one packet (retransmissions included). Their text
//! form is the flow label users see in reports and URLs (`src:sport>dst/0xqp`).

use core::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

use crate::datapath::FlowKey;

/// The destination QP of roce-trace's in-band probes (`trace`): no real QP has it, so
/// the collector keeps probes apart from traffic.
pub const PROBE_QP: u32 = 0xff_ffff;

/// An address as the datapath stores it (`version` 4: IPv4 mapped as `::ffff:a.b.c.d`).
pub fn ip_of(version: u8, a: &[u8; 16]) -> IpAddr {
    if version == 4 {
        IpAddr::V4(Ipv4Addr::new(a[12], a[13], a[14], a[15]))
    } else {
        IpAddr::V6(Ipv6Addr::from(*a))
    }
}

/// An address the datapath stored IPv4-mapped (`::ffff:a.b.c.d`), as written.
pub fn ip_of_mapped(a: &[u8; 16]) -> IpAddr {
    match Ipv6Addr::from(*a).to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(Ipv6Addr::from(*a)),
    }
}

/// The datapath's form of an address: its IP version and 16 bytes (IPv4 mapped).
pub fn addr_of_ip(ip: IpAddr) -> (u8, [u8; 16]) {
    match ip {
        IpAddr::V4(v4) => (4, v4.to_ipv6_mapped().octets()),
        IpAddr::V6(v6) => (6, v6.octets()),
    }
}

/// What stays the same for one RDMA QP direction everywhere in the fabric.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowId {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub ip_version: u8,
    pub udp_sport: u16,
    pub dest_qp: u32,
}

impl FlowId {
    pub fn of_key(k: &FlowKey) -> Self {
        Self {
            src: k.src,
            dst: k.dst,
            ip_version: k.ip_version,
            udp_sport: k.udp_sport,
            dest_qp: k.dest_qp,
        }
    }
    pub fn src_ip(&self) -> IpAddr {
        ip_of(self.ip_version, &self.src)
    }
    pub fn dst_ip(&self) -> IpAddr {
        ip_of(self.ip_version, &self.dst)
    }
}

/// The flow label: `src:sport>dst/0xqp`, stable across runs (URLs, reports).
impl fmt::Display for FlowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}>{}/{:#x}",
            self.src_ip(),
            self.udp_sport,
            self.dst_ip(),
            self.dest_qp
        )
    }
}

/// Why a flow label could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowLabelError {
    /// Not `src:sport>dst/0xqp`.
    Shape,
    Address,
    Port,
    Qp,
    /// Source and destination of different IP versions.
    MixedVersions,
}

impl fmt::Display for FlowLabelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Shape => "not a flow label (src:sport>dst/0xqp)",
            Self::Address => "bad address in the flow label",
            Self::Port => "bad UDP source port in the flow label",
            Self::Qp => "bad QP number in the flow label (0x…, 24 bits)",
            Self::MixedVersions => "the flow label mixes IPv4 and IPv6",
        })
    }
}

impl core::error::Error for FlowLabelError {}

impl FromStr for FlowId {
    type Err = FlowLabelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (from, to) = s.split_once('>').ok_or(FlowLabelError::Shape)?;
        let (src, sport) = from.rsplit_once(':').ok_or(FlowLabelError::Shape)?;
        let (dst, qp) = to.split_once('/').ok_or(FlowLabelError::Shape)?;
        let src: IpAddr = src.parse().map_err(|_| FlowLabelError::Address)?;
        let dst: IpAddr = dst.parse().map_err(|_| FlowLabelError::Address)?;
        let udp_sport = sport.parse().map_err(|_| FlowLabelError::Port)?;
        let dest_qp = qp
            .strip_prefix("0x")
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .filter(|q| *q <= 0xff_ffff)
            .ok_or(FlowLabelError::Qp)?;
        let ((v, src), (w, dst)) = (addr_of_ip(src), addr_of_ip(dst));
        if v != w {
            return Err(FlowLabelError::MixedVersions);
        }
        Ok(Self {
            src,
            dst,
            ip_version: v,
            udp_sport,
            dest_qp,
        })
    }
}

/// What stays the same for one packet everywhere: flow, PSN, opcode and the ICRC (over
/// exactly the fields the fabric may not change). Retransmissions share it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PacketId {
    pub flow: FlowId,
    pub psn: u32,
    pub opcode: u8,
    pub icrc: [u8; 4],
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::string::ToString;

    use super::*;

    #[test]
    fn a_label_reads_back_as_the_flow_it_names() {
        for (src, dst) in [
            ("10.0.0.1", "10.0.0.2"),
            ("fd00::1", "fd00::2"),
            ("::ffff:1.2.3.4", "::1"),
        ] {
            let (v, s) = addr_of_ip(src.parse().unwrap());
            let (_, d) = addr_of_ip(dst.parse().unwrap());
            if v == 4 && dst.contains(':') {
                continue;
            }
            let id = FlowId {
                src: s,
                dst: d,
                ip_version: v,
                udp_sport: 49152,
                dest_qp: 0xab_cdef,
            };
            let label = id.to_string();
            assert_eq!(label.parse::<FlowId>(), Ok(id), "{label}");
        }
        let v6 = "fd00::1:51000>fd00::2/0x400".parse::<FlowId>().unwrap();
        assert_eq!((v6.udp_sport, v6.dest_qp, v6.ip_version), (51000, 0x400, 6));
        assert_eq!(v6.to_string(), "fd00::1:51000>fd00::2/0x400");
    }

    #[test]
    fn bad_labels_say_what_is_wrong() {
        for (label, e) in [
            ("10.0.0.1:1>10.0.0.2", FlowLabelError::Shape),
            ("10.0.0.1>10.0.0.2/0x1", FlowLabelError::Shape),
            ("10.0.0.x:1>10.0.0.2/0x1", FlowLabelError::Address),
            ("10.0.0.1:70000>10.0.0.2/0x1", FlowLabelError::Port),
            ("10.0.0.1:1>10.0.0.2/12", FlowLabelError::Qp),
            ("10.0.0.1:1>10.0.0.2/0x1000000", FlowLabelError::Qp),
            ("10.0.0.1:1>fd00::2/0x1", FlowLabelError::MixedVersions),
        ] {
            assert_eq!(label.parse::<FlowId>(), Err(e), "{label}");
        }
    }
}
