//! UDP sockets as a RoCE NIC's wire behaviour needs them: DF set and unconnected (so
//! IPv4 ID is 0 and the ICRC is computable), the class in TOS / traffic class, ECN of
//! arriving packets reported, and batched send/receive (sendmmsg / recvmmsg).

use std::{
    io,
    mem::{size_of, zeroed},
    net::{IpAddr, SocketAddr, UdpSocket},
    os::fd::AsRawFd,
};

fn setsockopt_int(sock: &UdpSocket, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: a valid int option on an open socket.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            name,
            &value as *const i32 as *const libc::c_void,
            size_of::<i32>() as u32,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A UDP socket bound to `addr` with SO_REUSEADDR, so a flow's sender and a trace of
/// that flow (`roce-trace trace`, which must use the flow's own port) can share it; only
/// senders use it — a socket that receives binds alone.
pub fn bind_shared(addr: SocketAddr) -> io::Result<UdpSocket> {
    use std::os::fd::FromRawFd;
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket creation; ownership passes to the UdpSocket below.
    let fd = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket nobody else owns.
    let sock = unsafe { UdpSocket::from_raw_fd(fd) };
    setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    let sa = sockaddr(&addr);
    let (p, len) = storage_ptr(&sa);
    // SAFETY: p points at a sockaddr of `len` bytes.
    if unsafe { libc::bind(fd, p as *const libc::sockaddr, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

/// A socket bound to `addr`, DF set, TOS (v4) / traffic class (v6) = `tos`.
pub fn bind(addr: SocketAddr, tos: u8) -> io::Result<UdpSocket> {
    configure(UdpSocket::bind(addr)?, addr, tos)
}

/// [`bind`] for a sender's port: shared with traces of the same flow.
pub fn bind_sender(addr: SocketAddr, tos: u8) -> io::Result<UdpSocket> {
    configure(bind_shared(addr)?, addr, tos)
}

fn configure(sock: UdpSocket, addr: SocketAddr, tos: u8) -> io::Result<UdpSocket> {
    if addr.is_ipv4() {
        // PROBE: DF set, as NICs send, but the path-MTU cache ignored, so a too-small link
        // drops the packet in the fabric rather than the local stack refusing it.
        setsockopt_int(
            &sock,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_PROBE,
        )?;
        setsockopt_int(&sock, libc::IPPROTO_IP, libc::IP_TOS, tos as i32)?;
        setsockopt_int(&sock, libc::IPPROTO_IP, libc::IP_RECVTOS, 1)?;
    } else {
        setsockopt_int(&sock, libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 1)?;
        setsockopt_int(
            &sock,
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_PROBE,
        )?;
        setsockopt_int(&sock, libc::IPPROTO_IPV6, libc::IPV6_TCLASS, tos as i32)?;
        setsockopt_int(&sock, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 1)?;
    }
    // Room for bursts: a few MiB, as a NIC's receive ring would have (FORCE needs
    // CAP_NET_ADMIN; without it the kernel's rmem_max caps the plain request).
    let size = 8 << 20;
    if setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, size).is_err() {
        setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_RCVBUF, size)?;
    }
    if setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, size).is_err() {
        setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_SNDBUF, size)?;
    }
    sock.set_nonblocking(true)?;
    Ok(sock)
}

/// The source address the kernel would use to reach `dst`.
pub fn source_for(dst: IpAddr) -> io::Result<IpAddr> {
    let any: SocketAddr = if dst.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    let s = UdpSocket::bind(any)?;
    s.connect((dst, 4791))?;
    Ok(s.local_addr()?.ip())
}

enum Storage {
    V4(libc::sockaddr_in),
    V6(libc::sockaddr_in6),
}

fn sockaddr(a: &SocketAddr) -> Storage {
    // SAFETY: zeroed sockaddr structs are valid; fields are filled below.
    unsafe {
        match a {
            SocketAddr::V4(a) => {
                let mut s: libc::sockaddr_in = zeroed();
                s.sin_family = libc::AF_INET as u16;
                s.sin_port = a.port().to_be();
                s.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
                Storage::V4(s)
            }
            SocketAddr::V6(a) => {
                let mut s: libc::sockaddr_in6 = zeroed();
                s.sin6_family = libc::AF_INET6 as u16;
                s.sin6_port = a.port().to_be();
                s.sin6_addr.s6_addr = a.ip().octets();
                Storage::V6(s)
            }
        }
    }
}

fn storage_ptr(s: &Storage) -> (*const libc::c_void, u32) {
    match s {
        Storage::V4(a) => (
            a as *const _ as *const libc::c_void,
            size_of::<libc::sockaddr_in>() as u32,
        ),
        Storage::V6(a) => (
            a as *const _ as *const libc::c_void,
            size_of::<libc::sockaddr_in6>() as u32,
        ),
    }
}

/// Sends every buffer to `dst` with as few sendmmsg calls as the kernel allows. Returns
/// how many were sent (fewer when the socket buffer is full).
pub fn send_batch(sock: &UdpSocket, dst: &SocketAddr, bufs: &[Vec<u8>]) -> io::Result<usize> {
    let addr = sockaddr(dst);
    let (name, namelen) = storage_ptr(&addr);
    send_to_all(sock.as_raw_fd(), bufs, name, namelen)
}

/// Sends every buffer to the address at `name` (kept alive by the caller) with sendmmsg.
fn send_to_all(fd: i32, bufs: &[Vec<u8>], name: *const libc::c_void, namelen: u32) -> io::Result<usize> {
    let mut iovs: Vec<libc::iovec> = bufs
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    let mut msgs: Vec<libc::mmsghdr> = iovs
        .iter_mut()
        .map(|iov| {
            // SAFETY: a zeroed mmsghdr is valid; the pointers set below outlive the call.
            let mut m: libc::mmsghdr = unsafe { zeroed() };
            m.msg_hdr.msg_name = name as *mut libc::c_void;
            m.msg_hdr.msg_namelen = namelen;
            m.msg_hdr.msg_iov = iov as *mut libc::iovec;
            m.msg_hdr.msg_iovlen = 1;
            m
        })
        .collect();
    sendmmsg_all(fd, &mut msgs)
}

/// Sends every message with as few sendmmsg calls as the kernel allows; returns how many
/// it took. A full buffer stops early (the rest count as dropped); a datagram larger than
/// the interface MTU is skipped, lost here as on a NIC with a bad MTU.
fn sendmmsg_all(fd: i32, msgs: &mut Vec<libc::mmsghdr>) -> io::Result<usize> {
    let mut sent = 0;
    while sent < msgs.len() {
        // SAFETY: msgs[sent..] are valid mmsghdrs pointing at live buffers and addresses.
        let n = unsafe { libc::sendmmsg(fd, msgs[sent..].as_mut_ptr(), (msgs.len() - sent) as u32, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock || e.raw_os_error() == Some(libc::ENOBUFS) {
                break;
            }
            if e.raw_os_error() == Some(libc::EMSGSIZE) {
                msgs.remove(sent);
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    Ok(sent)
}

/// Sends one datagram with its own TOS / traffic class (replies: ACKs in the data class,
/// CNPs in the CNP class).
pub fn send_with_tos(sock: &UdpSocket, dst: &SocketAddr, tos: u8, buf: &[u8]) -> io::Result<()> {
    let addr = sockaddr(dst);
    let (name, namelen) = storage_ptr(&addr);
    let mut iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE of an int is a small constant.
    let space = unsafe { libc::CMSG_SPACE(size_of::<i32>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr and cmsg set up per cmsg(3); all pointers are live for the call.
    unsafe {
        let mut msg: libc::msghdr = zeroed();
        msg.msg_name = name as *mut libc::c_void;
        msg.msg_namelen = namelen;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space;
        let c = libc::CMSG_FIRSTHDR(&msg);
        let (level, ty) = if dst.is_ipv4() {
            (libc::IPPROTO_IP, libc::IP_TOS)
        } else {
            (libc::IPPROTO_IPV6, libc::IPV6_TCLASS)
        };
        (*c).cmsg_level = level;
        (*c).cmsg_type = ty;
        (*c).cmsg_len = libc::CMSG_LEN(size_of::<i32>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut i32, tos as i32);
        if libc::sendmsg(sock.as_raw_fd(), &msg, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// One received datagram.
pub struct Datagram {
    pub from: SocketAddr,
    /// TOS / traffic class as it arrived (ECN in the low two bits).
    pub tos: u8,
    pub len: usize,
}

pub const MAX_DATAGRAM: usize = 9216;

/// Receives up to `bufs.len()` datagrams without blocking.
pub fn recv_batch(sock: &UdpSocket, bufs: &mut [Vec<u8>], out: &mut Vec<Datagram>) -> io::Result<usize> {
    out.clear();
    let n = bufs.len();
    // SAFETY: CMSG_SPACE of an int is a small constant.
    let space = unsafe { libc::CMSG_SPACE(size_of::<i32>() as u32) } as usize * 2;
    let mut cbufs = vec![0u8; space * n];
    // SAFETY: zeroed sockaddr_storage is valid.
    let mut names: Vec<libc::sockaddr_storage> = (0..n).map(|_| unsafe { zeroed() }).collect();
    let mut iovs: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| {
            b.resize(MAX_DATAGRAM, 0);
            libc::iovec {
                iov_base: b.as_mut_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            }
        })
        .collect();
    let mut msgs: Vec<libc::mmsghdr> = (0..n)
        .map(|i| {
            // SAFETY: a zeroed mmsghdr is valid; pointers set below outlive the call.
            let mut m: libc::mmsghdr = unsafe { zeroed() };
            m.msg_hdr.msg_name = &mut names[i] as *mut _ as *mut libc::c_void;
            m.msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as u32;
            m.msg_hdr.msg_iov = &mut iovs[i];
            m.msg_hdr.msg_iovlen = 1;
            m.msg_hdr.msg_control = cbufs[i * space..].as_mut_ptr() as *mut libc::c_void;
            m.msg_hdr.msg_controllen = space;
            m
        })
        .collect();
    // SAFETY: msgs point at live buffers sized as declared.
    let got = unsafe {
        libc::recvmmsg(
            sock.as_raw_fd(),
            msgs.as_mut_ptr(),
            n as u32,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if got < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock {
            Ok(0)
        } else {
            Err(e)
        };
    }
    for (i, m) in msgs.iter().enumerate().take(got as usize) {
        let mut tos = 0u8;
        // SAFETY: walking the control buffer the kernel filled, per cmsg(3).
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&m.msg_hdr);
            while !c.is_null() {
                let (l, t) = ((*c).cmsg_level, (*c).cmsg_type);
                if l == libc::IPPROTO_IP && t == libc::IP_TOS {
                    tos = *libc::CMSG_DATA(c);
                } else if l == libc::IPPROTO_IPV6 && t == libc::IPV6_TCLASS {
                    tos = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const i32) as u8;
                }
                c = libc::CMSG_NXTHDR(&m.msg_hdr, c);
            }
        }
        let from = match names[i].ss_family as i32 {
            libc::AF_INET => {
                // SAFETY: the family says it is a sockaddr_in.
                let a = unsafe { &*(&names[i] as *const _ as *const libc::sockaddr_in) };
                SocketAddr::from((a.sin_addr.s_addr.to_ne_bytes(), u16::from_be(a.sin_port)))
            }
            _ => {
                // SAFETY: the family says it is a sockaddr_in6.
                let a = unsafe { &*(&names[i] as *const _ as *const libc::sockaddr_in6) };
                SocketAddr::from((a.sin6_addr.s6_addr, u16::from_be(a.sin6_port)))
            }
        };
        out.push(Datagram {
            from,
            tos,
            len: m.msg_len as usize,
        });
    }
    Ok(got as usize)
}

/// Raw Ethernet frames out of one interface (AF_PACKET, qdisc bypassed): for exact
/// framing (VLAN tag and PCP) and for rates the UDP stack cannot reach.
pub struct PacketTx {
    fd: std::os::fd::OwnedFd,
    ifindex: u32,
}

const PACKET_QDISC_BYPASS: i32 = 20;

impl PacketTx {
    pub fn open(ifindex: u32) -> io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain socket creation; the fd is owned below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_NONBLOCK, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh socket we own.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let one = 1i32;
        // SAFETY: a valid int option on an open socket.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_QDISC_BYPASS,
                &one as *const i32 as *const _,
                4,
            )
        };
        Ok(Self { fd, ifindex })
    }

    /// Sends every frame; returns how many the device took.
    pub fn send_batch(&self, frames: &[Vec<u8>]) -> io::Result<usize> {
        // SAFETY: a zeroed sockaddr_ll is valid; family and ifindex are set.
        let mut addr: libc::sockaddr_ll = unsafe { zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = self.ifindex as i32;
        addr.sll_halen = 6;
        let name = &addr as *const libc::sockaddr_ll as *const libc::c_void;
        send_to_all(
            self.fd.as_raw_fd(),
            frames,
            name,
            size_of::<libc::sockaddr_ll>() as u32,
        )
    }
}

/// The MAC address of a local interface.
pub fn mac_of(ifname: &str) -> io::Result<[u8; 6]> {
    let s = std::fs::read_to_string(format!("/sys/class/net/{ifname}/address"))?;
    parse_mac(s.trim())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("bad MAC `{}`", s.trim())))
}

pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let v: Vec<u8> = s
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).ok())
        .collect::<Option<_>>()?;
    v.try_into().ok()
}

/// An interface's index (`if_nametoindex`); `None` when there is no such interface.
pub fn ifindex(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: `c` is a valid NUL-terminated string.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => None,
        i => Some(i),
    }
}
