//! RoCE opcode semantics: which extended headers follow the BTH, which packets are
//! requests, what an AETH syndrome means.

pub const OP_CNP: u8 = 0x81;
pub const OP_UD_SEND_ONLY: u8 = 0x64;
pub const OP_UD_SEND_ONLY_IMM: u8 = 0x65;

/// Transport (opcode bits 7:5).
pub const TRANSPORT_RC: u8 = 0;
pub const TRANSPORT_UC: u8 = 1;
pub const TRANSPORT_RD: u8 = 2;
pub const TRANSPORT_UD: u8 = 3;
pub const TRANSPORT_CNP: u8 = 4;
pub const TRANSPORT_XRC: u8 = 5;

/// Operation (opcode bits 4:0), shared by RC, UC and XRC.
pub mod op {
    pub const SEND_FIRST: u8 = 0x00;
    pub const SEND_MIDDLE: u8 = 0x01;
    pub const SEND_LAST: u8 = 0x02;
    pub const SEND_LAST_IMM: u8 = 0x03;
    pub const SEND_ONLY: u8 = 0x04;
    pub const SEND_ONLY_IMM: u8 = 0x05;
    pub const WRITE_FIRST: u8 = 0x06;
    pub const WRITE_MIDDLE: u8 = 0x07;
    pub const WRITE_LAST: u8 = 0x08;
    pub const WRITE_LAST_IMM: u8 = 0x09;
    pub const WRITE_ONLY: u8 = 0x0A;
    pub const WRITE_ONLY_IMM: u8 = 0x0B;
    pub const READ_REQUEST: u8 = 0x0C;
    pub const READ_RESPONSE_FIRST: u8 = 0x0D;
    pub const READ_RESPONSE_MIDDLE: u8 = 0x0E;
    pub const READ_RESPONSE_LAST: u8 = 0x0F;
    pub const READ_RESPONSE_ONLY: u8 = 0x10;
    pub const ACKNOWLEDGE: u8 = 0x11;
    pub const ATOMIC_ACKNOWLEDGE: u8 = 0x12;
    pub const CMP_SWAP: u8 = 0x13;
    pub const FETCH_ADD: u8 = 0x14;
    pub const SEND_LAST_INV: u8 = 0x16;
    pub const SEND_ONLY_INV: u8 = 0x17;
}

#[inline(always)]
pub const fn transport(opcode: u8) -> u8 {
    opcode >> 5
}

#[inline(always)]
pub const fn operation(opcode: u8) -> u8 {
    opcode & 0x1f
}

/// Where the extended headers we read sit, as offsets from the end of the BTH.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtLayout {
    pub reth: Option<u8>,
    pub aeth: Option<u8>,
    pub deth: Option<u8>,
    /// Bytes of fixed extended headers (the CNP's 16 reserved bytes included) that must be
    /// present for the packet to be well formed.
    pub min_len: u8,
}

/// The extended headers that follow the BTH for `opcode`: the rule, as the
/// specification gives it ([`ext_layout`] reads it from [`OPCODES`]).
const fn layout_rule(opcode: u8) -> ExtLayout {
    let t = transport(opcode);
    let o = operation(opcode);
    let none = ExtLayout {
        reth: None,
        aeth: None,
        deth: None,
        min_len: 0,
    };
    match t {
        TRANSPORT_CNP => {
            if opcode == OP_CNP {
                ExtLayout { min_len: 16, ..none }
            } else {
                none
            }
        }
        TRANSPORT_UD => {
            if o == op::SEND_ONLY || o == op::SEND_ONLY_IMM {
                ExtLayout {
                    deth: Some(0),
                    min_len: 8,
                    ..none
                }
            } else {
                none
            }
        }
        TRANSPORT_RC | TRANSPORT_UC | TRANSPORT_XRC => {
            // XRC requests carry a 4-byte XRCETH ahead of everything else.
            let base: u8 = if t == TRANSPORT_XRC && is_request_op(o) {
                4
            } else {
                0
            };
            match o {
                op::WRITE_FIRST | op::WRITE_ONLY | op::WRITE_ONLY_IMM | op::READ_REQUEST => ExtLayout {
                    reth: Some(base),
                    min_len: base + 16,
                    ..none
                },
                op::READ_RESPONSE_FIRST
                | op::READ_RESPONSE_LAST
                | op::READ_RESPONSE_ONLY
                | op::ACKNOWLEDGE
                | op::ATOMIC_ACKNOWLEDGE => ExtLayout {
                    aeth: Some(0),
                    min_len: 4,
                    ..none
                },
                _ => ExtLayout {
                    min_len: base,
                    ..none
                },
            }
        }
        _ => none,
    }
}

/// The extended headers that follow the BTH for `opcode`.
#[inline(always)]
pub const fn ext_layout(opcode: u8) -> ExtLayout {
    let f = facts(opcode);
    ExtLayout {
        reth: unpack_offset(f),
        aeth: unpack_offset(f >> 8),
        deth: unpack_offset(f >> 16),
        min_len: (f >> 24) as u8,
    }
}

/// What the datapath asks of each opcode — its extended headers' offsets (each plus one,
/// 0 for none) and their length in the low four bytes, whether it is a request, a READ
/// REQUEST, an acknowledgement above — computed at compile time from the rules: one load
/// where every packet walked chains of compares.
pub static OPCODES: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = pack(i as u8);
        i += 1;
    }
    t
};
/// [`OPCODES`] bit: [`is_request`].
pub const FACT_REQUEST_BIT: u32 = 32;
/// [`OPCODES`] bit: [`is_read_request`].
pub const FACT_READ_REQUEST_BIT: u32 = 33;
/// [`OPCODES`] bit: [`is_ack_opcode`].
pub const FACT_ACK_BIT: u32 = 34;
/// [`OPCODES`] bit: the opcode is [`OP_CNP`].
pub const FACT_CNP_BIT: u32 = 35;
const FACT_REQUEST: u64 = 1 << FACT_REQUEST_BIT;
const FACT_READ_REQUEST: u64 = 1 << FACT_READ_REQUEST_BIT;
const FACT_ACK: u64 = 1 << FACT_ACK_BIT;
const FACT_CNP: u64 = 1 << FACT_CNP_BIT;

/// The opcode's word of [`OPCODES`]: its `FACT_*_BIT` bits, for arithmetic on several
/// facts at once (the kernel's plain packet, `account::news`).
#[inline(always)]
pub const fn facts(opcode: u8) -> u64 {
    OPCODES[opcode as usize]
}

const fn pack(opcode: u8) -> u64 {
    let l = layout_rule(opcode);
    pack_offset(l.reth)
        | pack_offset(l.aeth) << 8
        | pack_offset(l.deth) << 16
        | (l.min_len as u64) << 24
        | (ext_end_rule(l) as u64) << EXT_END_SHIFT
        | if request_rule(opcode) { FACT_REQUEST } else { 0 }
        | if read_request_rule(opcode) {
            FACT_READ_REQUEST
        } else {
            0
        }
        | if ack_rule(opcode) { FACT_ACK } else { 0 }
        | if opcode == OP_CNP { FACT_CNP } else { 0 }
}

/// Where [`ext_end`] sits in an [`OPCODES`] word.
const EXT_END_SHIFT: u32 = 40;

/// The end of the last extended header the parser reads (RETH, AETH, DETH), counted
/// from the end of the BTH; 0 when it reads none.
const fn ext_end_rule(l: ExtLayout) -> u8 {
    const fn end(at: Option<u8>, len: usize) -> u8 {
        match at {
            Some(at) => at + len as u8,
            None => 0,
        }
    }
    let reth = end(l.reth, core::mem::size_of::<crate::wire::Reth>());
    let aeth = end(l.aeth, core::mem::size_of::<crate::wire::Aeth>());
    let deth = end(l.deth, core::mem::size_of::<crate::wire::Deth>());
    let end = if reth > aeth { reth } else { aeth };
    if end > deth { end } else { deth }
}

/// The bytes after the BTH that hold every extended header the parser reads of
/// `opcode` (its RETH, AETH and DETH, [`ext_layout`]): a packet holds them all exactly
/// when it holds this many, one test where there were three.
#[inline(always)]
pub const fn ext_end(opcode: u8) -> usize {
    ((facts(opcode) >> EXT_END_SHIFT) & 0xff) as usize
}

/// An acknowledgement opcode's AETH follows the BTH at once (asserted for every opcode
/// below): the fast path reads it at a constant offset.
pub const ACK_AETH_AT: u8 = 0;
const _: () = {
    let mut o = 0;
    while o < 256 {
        let l = layout_rule(o as u8);
        assert!(!ack_rule(o as u8) || matches!(l.aeth, Some(ACK_AETH_AT)));
        o += 1;
    }
};

const fn pack_offset(o: Option<u8>) -> u64 {
    match o {
        Some(v) => v as u64 + 1,
        None => 0,
    }
}

#[inline(always)]
const fn unpack_offset(f: u64) -> Option<u8> {
    match (f & 0xff) as u8 {
        0 => None,
        v => Some(v - 1),
    }
}

#[inline(always)]
const fn is_request_op(o: u8) -> bool {
    o <= op::READ_REQUEST
        || o == op::CMP_SWAP
        || o == op::FETCH_ADD
        || o == 0x15
        || o == op::SEND_LAST_INV
        || o == op::SEND_ONLY_INV
}

/// A request packet: consumes requester PSNs (SEND, WRITE, READ REQUEST, atomics, UD SEND).
#[inline(always)]
pub const fn is_request(opcode: u8) -> bool {
    facts(opcode) & FACT_REQUEST != 0
}

/// The rule behind [`is_request`].
const fn request_rule(opcode: u8) -> bool {
    match transport(opcode) {
        TRANSPORT_RC | TRANSPORT_UC | TRANSPORT_XRC => is_request_op(operation(opcode)),
        TRANSPORT_UD => {
            let o = operation(opcode);
            o == op::SEND_ONLY || o == op::SEND_ONLY_IMM
        }
        _ => false,
    }
}

/// A READ REQUEST consumes one PSN per response packet, which the requester knows and
/// the wire does not say (the path MTU is not in the packet).
#[inline(always)]
pub const fn is_read_request(opcode: u8) -> bool {
    facts(opcode) & FACT_READ_REQUEST != 0
}

const fn read_request_rule(opcode: u8) -> bool {
    let t = transport(opcode);
    (t == TRANSPORT_RC || t == TRANSPORT_XRC) && operation(opcode) == op::READ_REQUEST
}

/// An acknowledgement carrying an AETH that answers requests (not a read response).
#[inline(always)]
pub const fn is_ack_opcode(opcode: u8) -> bool {
    facts(opcode) & FACT_ACK != 0
}

const fn ack_rule(opcode: u8) -> bool {
    let t = transport(opcode);
    (t == TRANSPORT_RC || t == TRANSPORT_XRC)
        && (operation(opcode) == op::ACKNOWLEDGE || operation(opcode) == op::ATOMIC_ACKNOWLEDGE)
}

/// What an AETH syndrome says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum AckKind {
    Ack = 0,
    RnrNak = 1,
    NakPsnSeqErr = 2,
    NakOther = 3,
}

pub const SYNDROME_NAK_PSN_SEQ_ERR: u8 = 0x60;
/// The syndrome bits (6:5) that are 0 in an ACK and not in a NAK ([`ack_kind`]).
pub const SYNDROME_NAK_BITS: u8 = 0x60;

#[inline(always)]
pub const fn ack_kind(syndrome: u8) -> AckKind {
    match (syndrome >> 5) & 0x3 {
        0 => AckKind::Ack,
        1 => AckKind::RnrNak,
        3 => {
            if syndrome == SYNDROME_NAK_PSN_SEQ_ERR {
                AckKind::NakPsnSeqErr
            } else {
                AckKind::NakOther
            }
        }
        _ => AckKind::NakOther,
    }
}

/// PSN arithmetic is modulo 2^24.
pub const PSN_MASK: u32 = 0x00ff_ffff;
/// A QP number is 24 bits too.
pub const QPN_MASK: u32 = 0x00ff_ffff;

/// How far `psn` is ahead of `expected` (0 = in order); `None` when it is behind
/// (a retransmission or reordering), judged over half the PSN space.
#[inline(always)]
pub const fn psn_ahead(expected: u32, psn: u32) -> Option<u32> {
    let d = psn.wrapping_sub(expected) & PSN_MASK;
    if d < 0x0080_0000 { Some(d) } else { None }
}

/// Human name of an opcode, as the IBTA names it.
pub fn opcode_name(opcode: u8) -> &'static str {
    if opcode == OP_CNP {
        return "CNP";
    }
    let t = transport(opcode);
    let o = operation(opcode);
    if t == TRANSPORT_UD {
        return match o {
            op::SEND_ONLY => "UD SEND ONLY",
            op::SEND_ONLY_IMM => "UD SEND ONLY IMM",
            _ => "UD reserved",
        };
    }
    if !(t == TRANSPORT_RC || t == TRANSPORT_UC || t == TRANSPORT_XRC) {
        return "reserved";
    }
    match o {
        op::SEND_FIRST => "SEND FIRST",
        op::SEND_MIDDLE => "SEND MIDDLE",
        op::SEND_LAST => "SEND LAST",
        op::SEND_LAST_IMM => "SEND LAST IMM",
        op::SEND_ONLY => "SEND ONLY",
        op::SEND_ONLY_IMM => "SEND ONLY IMM",
        op::WRITE_FIRST => "WRITE FIRST",
        op::WRITE_MIDDLE => "WRITE MIDDLE",
        op::WRITE_LAST => "WRITE LAST",
        op::WRITE_LAST_IMM => "WRITE LAST IMM",
        op::WRITE_ONLY => "WRITE ONLY",
        op::WRITE_ONLY_IMM => "WRITE ONLY IMM",
        op::READ_REQUEST => "READ REQUEST",
        op::READ_RESPONSE_FIRST => "READ RESPONSE FIRST",
        op::READ_RESPONSE_MIDDLE => "READ RESPONSE MIDDLE",
        op::READ_RESPONSE_LAST => "READ RESPONSE LAST",
        op::READ_RESPONSE_ONLY => "READ RESPONSE ONLY",
        op::ACKNOWLEDGE => "ACK",
        op::ATOMIC_ACKNOWLEDGE => "ATOMIC ACK",
        op::CMP_SWAP => "CMP SWAP",
        op::FETCH_ADD => "FETCH ADD",
        op::SEND_LAST_INV => "SEND LAST INV",
        op::SEND_ONLY_INV => "SEND ONLY INV",
        _ => "reserved",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aeth_syndromes() {
        assert_eq!(ack_kind(0x1f), AckKind::Ack);
        assert_eq!(ack_kind(0x05), AckKind::Ack);
        assert_eq!(ack_kind(0x2e), AckKind::RnrNak);
        assert_eq!(ack_kind(0x60), AckKind::NakPsnSeqErr);
        assert_eq!(ack_kind(0x61), AckKind::NakOther);
        assert_eq!(ack_kind(0x63), AckKind::NakOther);
        assert_eq!(ack_kind(0x40), AckKind::NakOther, "reserved type 10");
    }

    #[test]
    fn psn_arithmetic_wraps_at_24_bits() {
        assert_eq!(psn_ahead(5, 5), Some(0));
        assert_eq!(psn_ahead(5, 7), Some(2));
        assert_eq!(psn_ahead(0xff_ffff, 1), Some(2));
        assert_eq!(psn_ahead(7, 5), None);
        assert_eq!(psn_ahead(1, 0xff_ffff), None);
    }

    #[test]
    fn extended_header_layouts() {
        assert_eq!(ext_layout(0x06).reth, Some(0)); // RC WRITE FIRST
        assert_eq!(ext_layout(0x0c).reth, Some(0)); // READ REQUEST
        assert_eq!(ext_layout(0x07), ExtLayout::default()); // WRITE MIDDLE
        assert_eq!(ext_layout(0x11).aeth, Some(0)); // ACK
        assert_eq!(ext_layout(0x0e).aeth, None); // READ RESPONSE MIDDLE
        assert_eq!(ext_layout(0x10).aeth, Some(0)); // READ RESPONSE ONLY
        assert_eq!(ext_layout(0x64).deth, Some(0)); // UD SEND ONLY
        assert_eq!(ext_layout(OP_CNP).min_len, 16);
        // XRC WRITE FIRST: XRCETH, then RETH.
        assert_eq!(ext_layout(0xa6).reth, Some(4));
        assert_eq!(ext_layout(0xa6).min_len, 20);
        assert_eq!(ext_layout(0x2a).reth, Some(0)); // UC WRITE ONLY
    }

    #[test]
    fn requests_and_acks() {
        assert!(is_request(0x04) && is_request(0x0a) && is_request(0x0c) && is_request(0x14));
        assert!(is_request(0x64));
        assert!(!is_request(0x11) && !is_request(0x0d) && !is_request(OP_CNP));
        assert!(is_ack_opcode(0x11) && is_ack_opcode(0x12) && !is_ack_opcode(0x10));
        assert!(is_read_request(0x0c) && !is_read_request(0x2c));
        assert_eq!(opcode_name(0x81), "CNP");
        assert_eq!(opcode_name(0x0a), "WRITE ONLY");
        assert_eq!(opcode_name(0x64), "UD SEND ONLY");
    }
}

#[cfg(test)]
mod opcode_table_tests {
    use super::*;

    /// The table says what the rules say, for every opcode (the packing and unpacking
    /// lose nothing).
    #[test]
    fn the_table_is_the_rules() {
        for op in 0..=255u8 {
            assert_eq!(ext_layout(op), layout_rule(op), "opcode {op:#04x}");
            assert_eq!(is_request(op), request_rule(op), "opcode {op:#04x}");
            assert_eq!(is_read_request(op), read_request_rule(op), "opcode {op:#04x}");
            assert_eq!(is_ack_opcode(op), ack_rule(op), "opcode {op:#04x}");
        }
        // And the rules themselves on a few opcodes, so a rule broken in both is caught.
        assert_eq!(ext_layout(op::ACKNOWLEDGE).aeth, Some(0));
        assert_eq!(ext_layout(op::WRITE_FIRST).reth, Some(0));
        assert_eq!(ext_layout(0x64).deth, Some(0)); // UD SEND ONLY
        assert_eq!(ext_layout(0xa6).reth, Some(4)); // XRC WRITE FIRST: after the XRCETH
        assert_eq!(ext_layout(OP_CNP).min_len, 16);
        assert!(is_request(op::WRITE_MIDDLE) && !is_request(op::ACKNOWLEDGE));
        assert!(is_read_request(op::READ_REQUEST) && is_ack_opcode(op::ACKNOWLEDGE));
    }
}
