//! The two hooks' views of a packet, behind `roce_trace_common::parse::Packet`.

use core::ffi::c_void;

use aya_ebpf::{
    helpers::generated::{bpf_skb_load_bytes, bpf_xdp_load_bytes},
    programs::{TcContext, XdpContext},
};
use roce_trace_common::{
    datapath::{PCP_NONE, SAMPLE_HEAD_LEN},
    parse::{INNER_HEAD_LEN, MAX_VLAN_DEPTH, Packet},
    wire::{
        ETH_P_8021AD, ETH_P_8021Q, ETH_P_IPV4, ETH_P_IPV6, EthHdr, Header, IPPROTO_GRE, IPPROTO_UDP,
        IPV6_EXT_AUTH, IPV6_EXT_DEST_OPTS, IPV6_EXT_HOP_BY_HOP, IPV6_EXT_ROUTING, Ipv4Hdr, Ipv6Hdr, UdpHdr,
        VlanHdr, pcp_of_tci,
    },
};

/// `min(len, MAX)`, at least 1, written so the verifier sees the bounds on the register
/// the helper gets: LLVM turns a plain clamp and zero test into arithmetic the verifier
/// cannot follow. Callers return early on a zero `len`.
#[inline(always)]
fn clamp<const MAX: u32>(len: u32) -> u32 {
    let mut n = len as u64;
    // SAFETY: register arithmetic only, no memory access.
    unsafe {
        core::arch::asm!(
            "if {n} <= {max} goto +1",
            "{n} = {max}",
            "if {n} != 0 goto +1",
            "{n} = 1",
            n = inout(reg) n,
            max = const MAX,
        );
    }
    n as u32
}

/// Bytes to copy for a frame of `len`: all of a short frame, else `SAMPLE_HEAD_LEN`.
#[inline(always)]
fn head_len(len: u32) -> u32 {
    clamp::<{ SAMPLE_HEAD_LEN as u32 }>(len)
}

/// Bytes to copy from `off` of a frame of `len` into an inner-frame buffer.
#[inline(always)]
fn inner_len(len: u32, off: usize) -> u32 {
    clamp::<{ INNER_HEAD_LEN as u32 }>(len.saturating_sub(off as u32))
}

/// The 4 packet bytes `b` (inside a header `header_at` bounds-checked) in one load. x86
/// and arm64 load unaligned words; the verifier allows it where the architecture does.
#[inline(always)]
fn word(b: &[u8; 4]) -> u32 {
    let w: u32;
    // SAFETY: `b` points at 4 readable packet bytes (a `Header` reference from
    // `header_at`); the load reads exactly those.
    unsafe {
        core::arch::asm!(
            "{w} = *(u32 *)({p} + 0)",
            w = lateout(reg) w,
            p = in(reg) b.as_ptr(),
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    w
}

#[inline(always)]
fn header_at<'a, T: Header>(start: usize, end: usize, off: usize) -> Option<&'a T> {
    let at = start + off;
    if at + T::LEN > end {
        return None;
    }
    // SAFETY: [at, at + LEN) lies inside packet data (checked against data_end above, the
    // check the verifier requires); `Header` types are alignment-1 byte structs.
    Some(unsafe { &*(at as *const T) })
}

/// Where a packet's data starts and ends, as the verifier tracks them (a packet pointer
/// and the end), for a bounds test written as one jump (`rare_if_short!`).
pub trait Span {
    fn start(&self) -> usize;
    fn end(&self) -> usize;
}

pub struct XdpPacket<'a> {
    ctx: &'a XdpContext,
    start: usize,
    end: usize,
}

impl<'a> XdpPacket<'a> {
    #[inline(always)]
    pub fn new(ctx: &'a XdpContext) -> Self {
        Self {
            ctx,
            start: ctx.data(),
            end: ctx.data_end(),
        }
    }
    #[inline(always)]
    pub fn ifindex(&self) -> u32 {
        self.ctx.ingress_ifindex() as u32
    }
    /// Linear part only; multi-buffer frames are rare for RoCE MTUs.
    #[inline(always)]
    pub fn frame_len(&self) -> u32 {
        (self.end - self.start) as u32
    }
}

impl Span for XdpPacket<'_> {
    #[inline(always)]
    fn start(&self) -> usize {
        self.start
    }
    #[inline(always)]
    fn end(&self) -> usize {
        self.end
    }
}

impl Packet for XdpPacket<'_> {
    #[inline(always)]
    fn header<T: Header>(&self, off: usize) -> Option<&T> {
        header_at(self.start, self.end, off)
    }

    #[inline(always)]
    fn load4(&self, off: usize) -> Option<[u8; 4]> {
        load4(self, off)
    }

    #[inline(always)]
    fn word(&self, b: &[u8; 4]) -> u32 {
        word(b)
    }

    #[inline(always)]
    fn holds(&self, len: usize) -> bool {
        self.start + len <= self.end
    }

    #[inline(always)]
    fn offload_vlan_tci(&self) -> Option<u16> {
        // XDP sees the tag in packet data unless the driver strips it; the rx-vlan kfunc
        // needs a device-bound program, which generic attachment cannot offer.
        None
    }

    #[inline(always)]
    fn load_head(&self, dst: &mut [u8; SAMPLE_HEAD_LEN]) -> u16 {
        load_head(self, dst)
    }

    #[inline(always)]
    fn copy_out(&self, off: usize, dst: &mut [u8; INNER_HEAD_LEN]) -> usize {
        copy_out(self, off, dst)
    }
}

pub struct TcPacket<'a> {
    ctx: &'a TcContext,
    start: usize,
    end: usize,
}

/// Headers the parser needs in the linear area: L2 + 4 tags + IPv6 + ext + UDP + BTH + ext.
const TC_PULL_LEN: u32 = 256;

impl<'a> TcPacket<'a> {
    /// The packet as TC sees it: its linear area, read as it is.
    #[inline(always)]
    pub fn new(ctx: &'a TcContext) -> Self {
        Self {
            ctx,
            start: ctx.data(),
            end: ctx.data_end(),
        }
    }

    /// Pulls the headers into the linear area (a write: `bpf_skb_pull_data` may copy the
    /// skb's head) only when they are not all there and the packet may be ours: UDP to
    /// `udp_port`, GRE, or headers the linear area does not hold far enough to tell. TCP
    /// and every other packet whose headers are linear (all a host sends) are read as
    /// they are. Whether it pulled.
    #[inline(always)]
    pub fn pull_if_candidate(&mut self, udp_port: u16) -> bool {
        let len = self.ctx.len();
        let linear = (self.end - self.start) as u32;
        // Headers short of min(len, TC_PULL_LEN): the linear area is not the whole packet
        // (`linear` <= `len`) and shorter than TC_PULL_LEN. The common packet, linear
        // whole, falls through.
        crate::rare_if_ne!(linear, len, {
            if linear < TC_PULL_LEN {
                return self.pull_candidate(udp_port, len);
            }
        });
        false
    }

    /// [`TcPacket::pull_if_candidate`] of a packet whose headers are not all linear.
    #[inline(always)]
    fn pull_candidate(&mut self, udp_port: u16, len: u32) -> bool {
        let want = if len < TC_PULL_LEN { len } else { TC_PULL_LEN };
        if self.may_be_ours(udp_port) {
            // Linearises the headers without changing a byte. Whether it succeeds or not,
            // it invalidates packet pointers, so they are read after it.
            let _ = self.ctx.pull_data(want);
            self.start = self.ctx.data();
            self.end = self.ctx.data_end();
            return true;
        }
        false
    }

    /// Whether the parser could take this packet for RoCEv2 or a mirrored copy, judged
    /// from the linear area alone: false only when the headers that decide it (L2, tags,
    /// IP, UDP) are all there and say "not ours" — exactly as the parser will read them,
    /// so what it concludes does not depend on the pull.
    #[inline(always)]
    fn may_be_ours(&self, udp_port: u16) -> bool {
        let Some(eth) = header_at::<EthHdr>(self.start, self.end, 0) else {
            return true;
        };
        let mut ether_type = eth.ether_type();
        let mut off = EthHdr::LEN;
        for _ in 0..MAX_VLAN_DEPTH {
            if ether_type != ETH_P_8021Q && ether_type != ETH_P_8021AD {
                break;
            }
            let Some(tag) = header_at::<VlanHdr>(self.start, self.end, off) else {
                return true;
            };
            ether_type = tag.ether_type();
            off += VlanHdr::LEN;
        }
        let proto = match ether_type {
            ETH_P_IPV4 => {
                let Some(ip) = header_at::<Ipv4Hdr>(self.start, self.end, off) else {
                    return true;
                };
                let ihl = ip.header_len();
                if ip.version() != 4
                    || ihl < Ipv4Hdr::LEN
                    || (ip.tot_len() as usize) < ihl
                    || ip.is_fragment()
                {
                    return false;
                }
                off += ihl;
                ip.protocol
            }
            ETH_P_IPV6 => {
                let Some(ip) = header_at::<Ipv6Hdr>(self.start, self.end, off) else {
                    return true;
                };
                if ip.version() != 6 {
                    return false;
                }
                off += Ipv6Hdr::LEN;
                match ip.next_hdr {
                    IPV6_EXT_HOP_BY_HOP | IPV6_EXT_ROUTING | IPV6_EXT_DEST_OPTS | IPV6_EXT_AUTH => {
                        return true;
                    }
                    n => n,
                }
            }
            // Not IP (ARP, RoCEv1, a tag too deep): the parser decides from L2 alone.
            _ => return false,
        };
        match proto {
            IPPROTO_GRE => true,
            IPPROTO_UDP => match header_at::<UdpHdr>(self.start, self.end, off) {
                Some(udp) => udp.dst_port() == udp_port,
                None => true,
            },
            _ => false,
        }
    }

    #[inline(always)]
    pub fn ifindex(&self) -> u32 {
        // SAFETY: the context pointer is valid for the program's lifetime.
        unsafe { (*self.ctx.skb.skb).ifindex }
    }
    #[inline(always)]
    pub fn frame_len(&self) -> u32 {
        self.ctx.len()
    }
}

impl Span for TcPacket<'_> {
    #[inline(always)]
    fn start(&self) -> usize {
        self.start
    }
    #[inline(always)]
    fn end(&self) -> usize {
        self.end
    }
}

impl Packet for TcPacket<'_> {
    #[inline(always)]
    fn header<T: Header>(&self, off: usize) -> Option<&T> {
        header_at(self.start, self.end, off)
    }

    #[inline(always)]
    fn load4(&self, off: usize) -> Option<[u8; 4]> {
        load4(self, off)
    }

    #[inline(always)]
    fn word(&self, b: &[u8; 4]) -> u32 {
        word(b)
    }

    #[inline(always)]
    fn holds(&self, len: usize) -> bool {
        self.start + len <= self.end
    }

    #[inline(always)]
    fn offload_vlan_tci(&self) -> Option<u16> {
        // SAFETY: the context pointer is valid for the program's lifetime.
        let skb = unsafe { &*self.ctx.skb.skb };
        if skb.vlan_present != 0 {
            Some(skb.vlan_tci as u16)
        } else {
            None
        }
    }

    /// Without a branch: the kernel makes `vlan_present` a test of `vlan_all` (the tag's
    /// protocol and TCI) against 0, and the test above another.
    #[inline(always)]
    fn offload_pcp(&self) -> u8 {
        // SAFETY: the context pointer is valid for the program's lifetime.
        let skb = unsafe { &*self.ctx.skb.skb };
        let tci = skb.vlan_tci;
        let all = u64::from(skb.vlan_proto) | u64::from(tci);
        // All ones without a tag, 0 with one.
        let none = roce_trace_common::nonzero(all).wrapping_sub(1);
        let pcp = u64::from(pcp_of_tci(tci as u16));
        ((pcp & !none) | (u64::from(PCP_NONE) & none)) as u8
    }

    #[inline(always)]
    fn load_head(&self, dst: &mut [u8; SAMPLE_HEAD_LEN]) -> u16 {
        load_head(self, dst)
    }

    #[inline(always)]
    fn copy_out(&self, off: usize, dst: &mut [u8; INNER_HEAD_LEN]) -> usize {
        copy_out(self, off, dst)
    }
}

/// A hook's bounds-checked copy out of the frame: `bpf_xdp_load_bytes` or
/// `bpf_skb_load_bytes` (which also reaches an skb's fragments).
trait LoadBytes {
    /// The frame's length as the helper bounds it.
    fn len(&self) -> u32;
    /// Copies `n` bytes at `off` into `dst`; whether the helper succeeded.
    ///
    /// # Safety
    /// `dst` must be valid for `n` bytes of writes.
    unsafe fn load(&self, off: u32, dst: *mut c_void, n: u32) -> bool;
}

impl LoadBytes for XdpPacket<'_> {
    #[inline(always)]
    fn len(&self) -> u32 {
        self.frame_len()
    }
    #[inline(always)]
    unsafe fn load(&self, off: u32, dst: *mut c_void, n: u32) -> bool {
        // SAFETY: the helper bounds-checks [off, off + n) against the frame; the caller
        // gives a `dst` valid for n bytes.
        unsafe { bpf_xdp_load_bytes(self.ctx.ctx as *mut _, off, dst, n) == 0 }
    }
}

impl LoadBytes for TcPacket<'_> {
    #[inline(always)]
    fn len(&self) -> u32 {
        self.frame_len()
    }
    #[inline(always)]
    unsafe fn load(&self, off: u32, dst: *mut c_void, n: u32) -> bool {
        // SAFETY: the helper bounds-checks [off, off + n) against the skb (fragments
        // included); the caller gives a `dst` valid for n bytes.
        unsafe { bpf_skb_load_bytes(self.ctx.skb.skb as *const c_void, off, dst, n) == 0 }
    }
}

/// The 4 bytes at `off`, which may lie past the linear part.
#[inline(always)]
fn load4<P: LoadBytes>(p: &P, off: usize) -> Option<[u8; 4]> {
    let mut buf = [0u8; 4];
    // SAFETY: `buf` holds the 4 bytes asked for.
    let ok = unsafe { p.load(off as u32, buf.as_mut_ptr() as *mut c_void, 4) };
    ok.then_some(buf)
}

/// The frame's first `min(len, SAMPLE_HEAD_LEN)` bytes into `dst`; how many.
#[inline(always)]
fn load_head<P: LoadBytes>(p: &P, dst: &mut [u8; SAMPLE_HEAD_LEN]) -> u16 {
    let len = p.len();
    if len == 0 {
        return 0;
    }
    let n = head_len(len);
    // SAFETY: `dst` holds SAMPLE_HEAD_LEN >= n bytes.
    let ok = unsafe { p.load(0, dst.as_mut_ptr() as *mut c_void, n) };
    if ok { n as u16 } else { 0 }
}

/// `min(len - off, INNER_HEAD_LEN)` bytes from `off` into `dst`; how many.
#[inline(always)]
fn copy_out<P: LoadBytes>(p: &P, off: usize, dst: &mut [u8; INNER_HEAD_LEN]) -> usize {
    if p.len() as usize <= off {
        return 0;
    }
    let n = inner_len(p.len(), off);
    // SAFETY: `dst` holds INNER_HEAD_LEN >= n bytes.
    let ok = unsafe { p.load(off as u32, dst.as_mut_ptr() as *mut c_void, n) };
    if ok { n as usize } else { 0 }
}
