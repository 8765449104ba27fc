//! The two hooks' views of a packet, behind `roce_trace_common::parse::Packet`.

use core::ffi::c_void;

use aya_ebpf::{
    helpers::generated::{bpf_skb_load_bytes, bpf_xdp_load_bytes},
    programs::{TcContext, XdpContext},
};
use roce_trace_common::{parse::Packet, wire::Header};

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

impl Packet for XdpPacket<'_> {
    #[inline(always)]
    fn header<T: Header>(&self, off: usize) -> Option<&T> {
        header_at(self.start, self.end, off)
    }

    #[inline(always)]
    fn load4(&self, off: usize) -> Option<[u8; 4]> {
        let mut buf = [0u8; 4];
        // SAFETY: the helper bounds-checks `off` against the frame and writes 4 bytes
        // into `buf`, which is 4 bytes long.
        let r = unsafe {
            bpf_xdp_load_bytes(
                self.ctx.ctx as *mut _,
                off as u32,
                buf.as_mut_ptr() as *mut c_void,
                4,
            )
        };
        if r == 0 { Some(buf) } else { None }
    }

    #[inline(always)]
    fn offload_vlan_tci(&self) -> Option<u16> {
        // XDP sees the tag in packet data unless the driver strips it; the rx-vlan kfunc
        // needs a device-bound program, which generic attachment cannot offer.
        None
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
    #[inline(always)]
    pub fn new(ctx: &'a TcContext) -> Self {
        let len = ctx.len();
        let want = if len < TC_PULL_LEN { len } else { TC_PULL_LEN };
        if ((ctx.data_end() - ctx.data()) as u32) < want {
            // Linearises the headers without changing a byte. Whether it succeeds or not,
            // it invalidates packet pointers, so they are read after it.
            let _ = ctx.pull_data(want);
        }
        Self {
            ctx,
            start: ctx.data(),
            end: ctx.data_end(),
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

impl Packet for TcPacket<'_> {
    #[inline(always)]
    fn header<T: Header>(&self, off: usize) -> Option<&T> {
        header_at(self.start, self.end, off)
    }

    #[inline(always)]
    fn load4(&self, off: usize) -> Option<[u8; 4]> {
        let mut buf = [0u8; 4];
        // SAFETY: the helper bounds-checks `off` against the skb (fragments included) and
        // writes 4 bytes into `buf`.
        let r = unsafe {
            bpf_skb_load_bytes(
                self.ctx.skb.skb as *const c_void,
                off as u32,
                buf.as_mut_ptr() as *mut c_void,
                4,
            )
        };
        if r == 0 { Some(buf) } else { None }
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
}
