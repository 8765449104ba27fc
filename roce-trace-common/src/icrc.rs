//! The RoCEv2 invariant CRC (ICRC): what makes a packet's identity the same at every
//! point of the fabric, whatever DSCP, ECN or TTL it was given on the way. One
//! definition for the pcap reader, the records' checks and the generator.

use crate::wire::*;

/// CRC-32 (IEEE) of the invariant fields; see `shared/ROCE_WIRE.md` § ICRC.
///
/// `l3` runs from the IP header to the end of the UDP datagram, the 4 ICRC bytes
/// included (they are not covered). Returns the wire bytes (`crc.to_le_bytes()`); `None`
/// when `l3` is not such a packet (an IPv4 IHL below 5, lengths past the bytes given).
pub fn icrc(l3: &[u8]) -> Option<[u8; 4]> {
    let udp_off = match l3.first()? >> 4 {
        // An IHL below 5 is no IPv4 header: the masked fields would lie past it.
        4 => match ((l3[0] & 0x0f) as usize) * 4 {
            ihl if ihl < Ipv4Hdr::LEN => return None,
            ihl => ihl,
        },
        6 => Ipv6Hdr::LEN,
        _ => return None,
    };
    let udp_len = u16::from_be_bytes([*l3.get(udp_off + 4)?, *l3.get(udp_off + 5)?]) as usize;
    let end = udp_off + udp_len;
    if udp_len < UdpHdr::LEN + Bth::LEN + ICRC_LEN || l3.len() < end {
        return None;
    }
    let hdrs = udp_off + UdpHdr::LEN;
    Some(icrc_finish(icrc_prefix(&l3[..hdrs]), &l3[hdrs..end - ICRC_LEN]))
}

/// Verifies a parsed packet's ICRC (`stored`, as read by the parser) against the frame's
/// bytes from its IP header at `l3_off`: `None` when the frame does not hold the whole
/// packet (a short capture, a sample's header copy of a big packet).
pub fn check_icrc(frame: &[u8], l3_off: usize, stored: Option<[u8; 4]>) -> Option<bool> {
    let computed = icrc(frame.get(l3_off..)?)?;
    Some(stored == Some(computed))
}

/// The ICRC's running CRC over the 8 0xFF bytes and the IP and UDP headers (`headers`,
/// IPv4 with its options), their variant fields masked. Packets of one flow and one
/// length share it, so a sender computes it once per length.
///
/// # Panics
/// When `headers` is shorter than an IP header (20 or 40 bytes) and a UDP header: the
/// callers build them ([`icrc`] checks what it is given first).
pub fn icrc_prefix(headers: &[u8]) -> crc32fast::Hasher {
    // At most an IPv4 header with 40 bytes of options, and UDP.
    let mut store = [0u8; 60 + UdpHdr::LEN];
    let buf = &mut store[..headers.len()];
    buf.copy_from_slice(headers);
    let udp_off = buf.len() - UdpHdr::LEN;
    if buf[0] >> 4 == 6 {
        // Traffic class and flow label, hop limit.
        buf[0] |= 0x0f;
        buf[1] = 0xff;
        buf[2] = 0xff;
        buf[3] = 0xff;
        buf[7] = 0xff;
    } else {
        buf[1] = 0xff; // TOS
        buf[8] = 0xff; // TTL
        buf[10] = 0xff; // header checksum
        buf[11] = 0xff;
    }
    buf[udp_off + 6] = 0xff; // UDP checksum
    buf[udp_off + 7] = 0xff;
    let mut h = crc32fast::Hasher::new();
    h.update(&[0xff; 8]);
    h.update(buf);
    h
}

/// Completes an [`icrc_prefix`] over the UDP payload up to the ICRC (`bth_on`: the BTH,
/// extended headers, payload and pad), masking the BTH's FECN/BECN byte.
pub fn icrc_finish(mut h: crc32fast::Hasher, bth_on: &[u8]) -> [u8; 4] {
    let mut bth = [0u8; Bth::LEN];
    bth.copy_from_slice(&bth_on[..Bth::LEN]);
    bth[4] = 0xff;
    h.update(&bth);
    h.update(&bth_on[Bth::LEN..]);
    h.finalize().to_le_bytes()
}
