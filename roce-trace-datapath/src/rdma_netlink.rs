//! RDMA netlink (`NETLINK_RDMA`, the nldev client `rdma statistic` uses): a port's
//! hardware counters including the optional ones once enabled (`rdma statistic set link
//! DEV/PORT optional-counters …`; sysfs never shows those), and the per-QP counters of
//! the counters QPs are bound to (`rdma statistic qp set link DEV/PORT auto type on`,
//! before the QPs are created). Attribute numbers from `include/uapi/rdma/rdma_netlink.h`.
//!
//! The parser takes any bytes: lengths are checked before they are used, and a message it
//! cannot read is an error naming why, never a panic or a wrong number.

use std::io;

/// `NETLINK_RDMA`.
const NETLINK_RDMA: i32 = 20;
/// The nldev client, and its STAT_GET command: `RDMA_NL_GET_TYPE(5, 17)`.
const RDMA_NL_NLDEV: u16 = 5;
const RDMA_NLDEV_CMD_STAT_GET: u16 = 17;
pub const STAT_GET: u16 = (RDMA_NL_NLDEV << 10) + RDMA_NLDEV_CMD_STAT_GET;

pub mod attr {
    pub const PAD: u16 = 0;
    pub const DEV_INDEX: u16 = 1;
    pub const DEV_NAME: u16 = 2;
    pub const PORT_INDEX: u16 = 3;
    pub const RES_QP: u16 = 19;
    pub const RES_QP_ENTRY: u16 = 20;
    pub const RES_LQPN: u16 = 21;
    pub const STAT_MODE: u16 = 74;
    pub const STAT_RES: u16 = 75;
    pub const STAT_COUNTER: u16 = 77;
    pub const STAT_COUNTER_ENTRY: u16 = 78;
    pub const STAT_COUNTER_ID: u16 = 79;
    pub const STAT_HWCOUNTERS: u16 = 80;
    pub const STAT_HWCOUNTER_ENTRY: u16 = 81;
    pub const STAT_HWCOUNTER_ENTRY_NAME: u16 = 82;
    pub const STAT_HWCOUNTER_ENTRY_VALUE: u16 = 83;
}

const NLA_TYPE_MASK: u16 = !(1 << 15 | 1 << 14);
const NLMSG_HDR: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;

/// Why a reply could not be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum NlError {
    #[error("RDMA netlink message truncated: {0}")]
    Truncated(&'static str),
    #[error("RDMA netlink attribute {0}: {1}")]
    Bad(u16, &'static str),
}

/// One attribute: its type (flags masked) and payload.
#[derive(Clone, Copy, Debug)]
pub struct Attr<'a> {
    pub kind: u16,
    pub data: &'a [u8],
}

/// The attributes in `b` (a message's payload after its header, or a nested table).
pub fn attrs(mut b: &[u8]) -> Result<Vec<Attr<'_>>, NlError> {
    let mut out = Vec::new();
    while !b.is_empty() {
        if b.len() < 4 {
            return Err(NlError::Truncated("attribute header"));
        }
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let kind = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > b.len() {
            return Err(NlError::Truncated("attribute length"));
        }
        out.push(Attr {
            kind,
            data: &b[4..len],
        });
        let next = len.div_ceil(4) * 4;
        b = &b[next.min(b.len())..];
    }
    Ok(out)
}

impl<'a> Attr<'a> {
    pub fn u32(&self) -> Result<u32, NlError> {
        Ok(u32::from_ne_bytes(
            self.data
                .try_into()
                .map_err(|_| NlError::Bad(self.kind, "not a u32"))?,
        ))
    }

    pub fn u64(&self) -> Result<u64, NlError> {
        Ok(u64::from_ne_bytes(
            self.data
                .try_into()
                .map_err(|_| NlError::Bad(self.kind, "not a u64"))?,
        ))
    }

    pub fn string(&self) -> Result<String, NlError> {
        let s = self.data.split(|&c| c == 0).next().unwrap_or_default();
        String::from_utf8(s.to_vec()).map_err(|_| NlError::Bad(self.kind, "not UTF-8"))
    }

    pub fn nested(&self) -> Result<Vec<Attr<'a>>, NlError> {
        attrs(self.data)
    }
}

fn find<'a>(v: &[Attr<'a>], kind: u16) -> Option<Attr<'a>> {
    v.iter().find(|a| a.kind == kind).copied()
}

/// A STAT_HWCOUNTERS table: (name, value) per entry.
fn hwcounters(a: &Attr<'_>) -> Result<Vec<(String, u64)>, NlError> {
    let mut out = Vec::new();
    for e in a
        .nested()?
        .iter()
        .filter(|e| e.kind == attr::STAT_HWCOUNTER_ENTRY)
    {
        let f = e.nested()?;
        let name = find(&f, attr::STAT_HWCOUNTER_ENTRY_NAME)
            .ok_or(NlError::Bad(e.kind, "counter without a name"))?
            .string()?;
        let value = find(&f, attr::STAT_HWCOUNTER_ENTRY_VALUE)
            .ok_or(NlError::Bad(e.kind, "counter without a value"))?
            .u64()?;
        out.push((name, value));
    }
    Ok(out)
}

/// A port's hardware counters from a STAT_GET reply's attributes (the optional ones that
/// are enabled among them).
pub fn port_counters(msg: &[Attr<'_>]) -> Result<Vec<(String, u64)>, NlError> {
    match find(msg, attr::STAT_HWCOUNTERS) {
        Some(a) => hwcounters(&a),
        None => Ok(Vec::new()),
    }
}

/// One counter QPs are bound to: its id, port, QPs (local QPNs) and values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpCounter {
    pub id: u32,
    pub port: u32,
    pub qps: Vec<u32>,
    pub counters: Vec<(String, u64)>,
}

/// The bound counters in a STAT_GET (QP resource) dump message.
pub fn qp_counters(msg: &[Attr<'_>]) -> Result<Vec<QpCounter>, NlError> {
    let Some(table) = find(msg, attr::STAT_COUNTER) else {
        return Ok(Vec::new());
    };
    let port_of_msg = find(msg, attr::PORT_INDEX).map(|a| a.u32()).transpose()?;
    let mut out = Vec::new();
    for e in table
        .nested()?
        .iter()
        .filter(|e| e.kind == attr::STAT_COUNTER_ENTRY)
    {
        let f = e.nested()?;
        let id = find(&f, attr::STAT_COUNTER_ID)
            .ok_or(NlError::Bad(e.kind, "counter without an id"))?
            .u32()?;
        let port = match find(&f, attr::PORT_INDEX) {
            Some(a) => a.u32()?,
            None => port_of_msg.unwrap_or(0),
        };
        let mut qps = Vec::new();
        if let Some(t) = find(&f, attr::RES_QP) {
            for q in t.nested()?.iter().filter(|q| q.kind == attr::RES_QP_ENTRY) {
                if let Some(n) = find(&q.nested()?, attr::RES_LQPN) {
                    qps.push(n.u32()?);
                }
            }
        }
        let counters = match find(&f, attr::STAT_HWCOUNTERS) {
            Some(a) => hwcounters(&a)?,
            None => Vec::new(),
        };
        out.push(QpCounter {
            id,
            port,
            qps,
            counters,
        });
    }
    Ok(out)
}

/// The messages in one `recv` buffer: (type, payload after the header); an NLMSG_ERROR's
/// errno as an error (0 is an acknowledgement, skipped); `done` set at NLMSG_DONE.
pub fn messages<'a>(mut b: &'a [u8], done: &mut bool) -> io::Result<Vec<(u16, &'a [u8])>> {
    let mut out = Vec::new();
    while b.len() >= NLMSG_HDR {
        let len = u32::from_ne_bytes(b[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes([b[4], b[5]]);
        if len < NLMSG_HDR || len > b.len() {
            return Err(io::Error::other("RDMA netlink: message length past the buffer"));
        }
        let payload = &b[NLMSG_HDR..len];
        match kind {
            NLMSG_DONE => {
                *done = true;
                return Ok(out);
            }
            NLMSG_ERROR => {
                let e = payload
                    .get(0..4)
                    .map(|x| i32::from_ne_bytes(x.try_into().expect("4 bytes")))
                    .ok_or_else(|| io::Error::other("RDMA netlink: short error message"))?;
                if e != 0 {
                    return Err(io::Error::from_raw_os_error(-e));
                }
            }
            _ => out.push((kind, payload)),
        }
        // The last message need not be padded to 4.
        b = &b[(len.div_ceil(4) * 4).min(b.len())..];
        if b.len() < NLMSG_HDR {
            break;
        }
    }
    Ok(out)
}

/// A request: header, then u32 attributes.
pub fn request(flags: u16, seq: u32, u32_attrs: &[(u16, u32)]) -> Vec<u8> {
    let mut b = vec![0u8; NLMSG_HDR];
    for (k, v) in u32_attrs {
        b.extend_from_slice(&8u16.to_ne_bytes());
        b.extend_from_slice(&k.to_ne_bytes());
        b.extend_from_slice(&v.to_ne_bytes());
    }
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&len.to_ne_bytes());
    b[4..6].copy_from_slice(&STAT_GET.to_ne_bytes());
    b[6..8].copy_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b
}

/// A netlink socket of the RDMA family.
pub struct Socket(std::os::fd::OwnedFd);

impl Socket {
    /// `Err` with `EPROTONOSUPPORT` where the kernel has no RDMA core (no `ib_core`).
    pub fn open() -> io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain socket(2).
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_RDMA,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned by socket(2), owned by nothing else.
        Ok(Self(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    /// Sends `req` and calls `each` with every reply message's attributes until the
    /// reply ends (one message, or a dump's NLMSG_DONE).
    fn exchange(
        &self,
        req: &[u8],
        dump: bool,
        mut each: impl FnMut(&[Attr<'_>]) -> Result<(), NlError>,
    ) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let fd = self.0.as_raw_fd();
        // SAFETY: sending a buffer we own to the kernel (netlink address 0).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: `req` and `addr` outlive the call.
        let n = unsafe {
            libc::sendto(
                fd,
                req.as_ptr().cast(),
                req.len(),
                0,
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 1 << 16];
        let mut done = false;
        while !done {
            // SAFETY: receiving into a buffer we own.
            let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if n == 0 {
                break;
            }
            for (_, payload) in messages(&buf[..n as usize], &mut done)? {
                let a = attrs(payload).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                each(&a).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            }
            if !dump {
                break;
            }
        }
        Ok(())
    }

    /// The RDMA device index of `name`, from a STAT_GET dump's DEV_NAME/DEV_INDEX.
    fn dev_index(&self, name: &str) -> io::Result<Option<u32>> {
        let mut found = None;
        self.exchange(&request(NLM_F_DUMP, 1, &[]), true, |m| {
            if let (Some(n), Some(i)) = (find(m, attr::DEV_NAME), find(m, attr::DEV_INDEX))
                && n.string()? == name
            {
                found = Some(i.u32()?);
            }
            Ok(())
        })?;
        Ok(found)
    }

    /// `device`/`port`'s hardware counters, optional ones included when enabled.
    pub fn port_counters(&self, device: &str, port: u32) -> io::Result<Vec<(String, u64)>> {
        let idx = self
            .dev_index(device)?
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no RDMA device {device}")))?;
        let mut out = Vec::new();
        self.exchange(
            &request(0, 2, &[(attr::DEV_INDEX, idx), (attr::PORT_INDEX, port)]),
            false,
            |m| {
                out = port_counters(m)?;
                Ok(())
            },
        )?;
        Ok(out)
    }

    /// The per-QP counters bound on `device`/`port` (empty when none are bound).
    pub fn qp_counters(&self, device: &str, port: u32) -> io::Result<Vec<QpCounter>> {
        let idx = self
            .dev_index(device)?
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no RDMA device {device}")))?;
        let mut out = Vec::new();
        self.exchange(
            &request(
                NLM_F_DUMP,
                3,
                &[
                    (attr::DEV_INDEX, idx),
                    (attr::PORT_INDEX, port),
                    (attr::STAT_RES, attr::RES_QP as u32),
                ],
            ),
            true,
            |m| {
                out.extend(qp_counters(m)?);
                Ok(())
            },
        )?;
        Ok(out)
    }
}

/// Why RDMA netlink cannot be read here, in words, from the error opening or using it.
pub fn unavailable(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EPROTONOSUPPORT) => "RDMA netlink is not in this kernel (no RDMA core loaded)".into(),
        Some(libc::EOPNOTSUPP) => "the driver does not offer these counters through RDMA netlink".into(),
        Some(libc::EPERM) | Some(libc::EACCES) => format!("RDMA netlink refused: {e}"),
        _ => format!("RDMA netlink: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An attribute as the kernel writes it: length, type, payload, padded to 4.
    fn nla(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        b.extend_from_slice(&kind.to_ne_bytes());
        b.extend_from_slice(payload);
        while b.len() % 4 != 0 {
            b.push(0);
        }
        b
    }

    fn nest(kind: u16, parts: &[Vec<u8>]) -> Vec<u8> {
        nla(kind | 1 << 15, &parts.concat())
    }

    /// A counter entry as `rdma_nl_stat_hwcounter_entry` writes it: the name, a PAD
    /// attribute aligning the u64 (nla_put_u64_64bit), the value.
    fn entry(name: &str, v: u64) -> Vec<u8> {
        let mut n = name.as_bytes().to_vec();
        n.push(0);
        nest(
            attr::STAT_HWCOUNTER_ENTRY,
            &[
                nla(attr::STAT_HWCOUNTER_ENTRY_NAME, &n),
                nla(attr::PAD, &[]),
                nla(attr::STAT_HWCOUNTER_ENTRY_VALUE, &v.to_ne_bytes()),
            ],
        )
    }

    #[test]
    fn a_ports_counters_and_its_optional_ones_parse() {
        let msg = [
            nla(attr::DEV_INDEX, &1u32.to_ne_bytes()),
            nla(attr::DEV_NAME, b"mlx5_0\0"),
            nla(attr::PORT_INDEX, &1u32.to_ne_bytes()),
            nest(
                attr::STAT_HWCOUNTERS,
                &[entry("np_cnp_sent", 7), entry("cc_rx_ce_pkts", u64::MAX)],
            ),
        ]
        .concat();
        let a = attrs(&msg).unwrap();
        assert_eq!(
            port_counters(&a).unwrap(),
            [
                ("np_cnp_sent".to_string(), 7),
                ("cc_rx_ce_pkts".to_string(), u64::MAX)
            ]
        );
    }

    #[test]
    fn per_qp_counters_parse_with_their_qps() {
        let qp = |n: u32| nest(attr::RES_QP_ENTRY, &[nla(attr::RES_LQPN, &n.to_ne_bytes())]);
        let counter = |id: u32, qps: &[u32], v: u64| {
            nest(
                attr::STAT_COUNTER_ENTRY,
                &[
                    nla(attr::STAT_COUNTER_ID, &id.to_ne_bytes()),
                    nla(attr::PORT_INDEX, &1u32.to_ne_bytes()),
                    nest(attr::RES_QP, &qps.iter().map(|&q| qp(q)).collect::<Vec<_>>()),
                    nest(attr::STAT_HWCOUNTERS, &[entry("out_of_sequence", v)]),
                ],
            )
        };
        let msg = [
            nla(attr::DEV_INDEX, &1u32.to_ne_bytes()),
            nest(
                attr::STAT_COUNTER,
                &[counter(3, &[0x107, 0x109], 5), counter(4, &[], 0)],
            ),
        ]
        .concat();
        let got = qp_counters(&attrs(&msg).unwrap()).unwrap();
        assert_eq!(
            got,
            [
                QpCounter {
                    id: 3,
                    port: 1,
                    qps: vec![0x107, 0x109],
                    counters: vec![("out_of_sequence".into(), 5)],
                },
                QpCounter {
                    id: 4,
                    port: 1,
                    qps: vec![],
                    counters: vec![("out_of_sequence".into(), 0)],
                },
            ]
        );
    }

    #[test]
    fn broken_messages_are_errors_not_numbers() {
        // A length past the buffer, a length under the header, a value that is not a u64.
        assert!(attrs(&[8, 0, 1, 0, 1]).is_err());
        assert!(attrs(&[2, 0, 1, 0]).is_err());
        let bad = nest(
            attr::STAT_HWCOUNTERS,
            &[nest(
                attr::STAT_HWCOUNTER_ENTRY,
                &[
                    nla(attr::STAT_HWCOUNTER_ENTRY_NAME, b"x\0"),
                    nla(attr::STAT_HWCOUNTER_ENTRY_VALUE, &[1, 2, 3]),
                ],
            )],
        );
        assert!(port_counters(&attrs(&bad).unwrap()).is_err());
        let nameless = nest(
            attr::STAT_HWCOUNTERS,
            &[nest(
                attr::STAT_HWCOUNTER_ENTRY,
                &[nla(attr::STAT_HWCOUNTER_ENTRY_VALUE, &1u64.to_ne_bytes())],
            )],
        );
        assert!(port_counters(&attrs(&nameless).unwrap()).is_err());
        // Netlink framing: an error message is the errno; DONE ends a dump.
        let mut err = vec![0u8; 20];
        err[0..4].copy_from_slice(&20u32.to_ne_bytes());
        err[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        err[16..20].copy_from_slice(&(-libc::EOPNOTSUPP).to_ne_bytes());
        let mut done = false;
        let e = messages(&err, &mut done).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP));
        assert!(unavailable(&e).contains("driver does not offer"));
        let mut d = vec![0u8; 16];
        d[0..4].copy_from_slice(&16u32.to_ne_bytes());
        d[4..6].copy_from_slice(&NLMSG_DONE.to_ne_bytes());
        assert!(messages(&d, &mut done).unwrap().is_empty() && done);
        // A last message of a length that is not a multiple of 4, unpadded (found by the
        // fuzzer: the padding must not be skipped past the buffer).
        let mut odd = vec![0u8; 18];
        odd[0..4].copy_from_slice(&18u32.to_ne_bytes());
        odd[4..6].copy_from_slice(&STAT_GET.to_ne_bytes());
        assert_eq!(messages(&odd, &mut false).unwrap().len(), 1);
        let mut long = d.clone();
        long[0..4].copy_from_slice(&64u32.to_ne_bytes());
        assert!(messages(&long, &mut false).is_err());
    }

    #[test]
    fn requests_carry_the_nldev_stat_get_type_and_u32_attributes() {
        let r = request(NLM_F_DUMP, 9, &[(attr::DEV_INDEX, 1), (attr::PORT_INDEX, 2)]);
        assert_eq!(r.len(), 16 + 16);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), (5 << 10) + 17);
        assert_eq!(u16::from_ne_bytes([r[6], r[7]]), NLM_F_REQUEST | NLM_F_DUMP);
        let a = attrs(&r[16..]).unwrap();
        assert_eq!((a[1].kind, a[1].u32().unwrap()), (attr::PORT_INDEX, 2));
    }
}
