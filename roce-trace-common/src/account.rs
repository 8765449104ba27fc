//! What one parsed RoCEv2 packet does to its flow: shared state (PSN sequence, first
//! DSCP), exact counters, and why it must be reported. One definition, run by the eBPF
//! programs on map values and by userspace (pcap input) on its own tables.

use crate::{
    datapath::*,
    parse::{Facts, Parsed, PlainV4Key},
    roce::{self, AckKind, OP_CNP},
    sampling::{identity_finish, identity_flow_state, identity_flow_state_v4},
};

/// The flow key of a parsed packet at an observation point.
#[inline(always)]
pub fn flow_key(p: &Parsed, ifindex: u32, direction: u8) -> FlowKey {
    let mut k = FlowKey::default();
    set_flow_key(&mut k, p, ifindex, direction);
    k
}

/// [`flow_key`] written in place (the kernel's scratch slot), as the six words
/// [`FlowKey::slot_of`] hashes and [`FlowKey::same_words`] compares, which it returns:
/// each word is one store, so reading it back right away is forwarded from that store
/// (a load spanning several narrower stores just made waits for them to reach the cache).
#[inline(always)]
pub fn set_flow_key(k: &mut FlowKey, p: &Parsed, ifindex: u32, direction: u8) -> [u64; 6] {
    let w = key_words(
        p.src_dwords(),
        p.dst_dwords(),
        ifindex,
        p.bth.dest_qp(),
        p.mirror_id,
        p.udp_sport,
        direction,
        p.ip_version,
    );
    *k.words_mut() = w;
    w
}

/// The flow key's words of a plain IPv4 packet read by the kernel's fast path: the same
/// words [`set_flow_key`] makes of the packet's [`Parsed`].
#[inline(always)]
pub fn plain_v4_key_words(k: &PlainV4Key, ifindex: u32, direction: u8) -> [u64; 6] {
    key_words(k.src, k.dst, ifindex, k.dest_qp, 0, k.udp_sport, direction, 4)
}

/// The six words of a flow key ([`FlowKey::words`]), from the addresses as two words each
/// in memory order.
#[inline(always)]
#[expect(clippy::too_many_arguments, reason = "the key's fields, in registers")]
fn key_words(
    src: [u64; 2],
    dst: [u64; 2],
    ifindex: u32,
    dest_qp: u32,
    mirror_id: u32,
    udp_sport: u16,
    direction: u8,
    ip_version: u8,
) -> [u64; 6] {
    [
        src[0],
        src[1],
        dst[0],
        dst[1],
        FlowKey::word(ifindex, dest_qp),
        // `mirror_id` is zero unless mirrored (the parser clears it), so one key per
        // mirror session.
        FlowKey::word(mirror_id, {
            let [a, b] = udp_sport.to_ne_bytes();
            u32::from_ne_bytes([a, b, direction, ip_version])
        }),
    ]
}

#[inline(always)]
fn request_flags(opcode: u8) -> u8 {
    STATE_PSN_VALID
        | if roce::is_read_request(opcode) {
            STATE_AFTER_READ
        } else {
            0
        }
}

/// The state of a flow first seen with `p`, under `cfg`'s sampling.
#[inline(always)]
pub fn new_state(p: &Parsed, cfg: &DatapathConfig) -> FlowState {
    let opcode = p.bth.opcode;
    FlowState {
        next_psn: (p.bth.psn() + 1) & roce::PSN_MASK,
        sample_state: sample_state(p, cfg),
        first_dscp: p.dscp,
        flags: STATE_INIT
            | if roce::is_request(opcode) {
                request_flags(opcode)
            } else {
                0
            },
        repeat: [0; 2],
        repeat_lens: 0,
    }
}

/// `f` changes nothing but the expected PSN of a flow in state `st`: the state has seen
/// the flow, and `f` is a response, or the request it expects next. The kernel's fast
/// path; anything else may need what another CPU knows of the flow.
#[inline(always)]
pub fn in_sequence(st: &FlowState, f: &Facts) -> bool {
    st.flags & STATE_INIT != 0
        && (!roce::is_request(f.opcode) || (st.flags & STATE_PSN_VALID != 0 && st.next_psn == f.psn))
}

/// What a packet revealed about its flow's sequence and class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateUpdate {
    /// A request PSN skipped ahead (not after a READ REQUEST, whose responses use PSNs).
    pub psn_gap: bool,
    /// A request PSN went back: a retransmission or reordering.
    pub psn_regression: bool,
    pub dscp_changed: bool,
}

/// Advances a known flow's state with `f`.
#[inline(always)]
pub fn update_state(st: &mut FlowState, f: &Facts) -> StateUpdate {
    let opcode = f.opcode;
    let psn = f.psn;
    let mut u = StateUpdate {
        dscp_changed: st.first_dscp != f.dscp,
        ..StateUpdate::default()
    };
    if roce::is_request(opcode) {
        if st.flags & STATE_PSN_VALID != 0 {
            match roce::psn_ahead(st.next_psn, psn) {
                Some(0) => {}
                Some(_) => u.psn_gap = st.flags & STATE_AFTER_READ == 0,
                None => u.psn_regression = true,
            }
        }
        // Track the newest PSN; a retransmission (behind) does not move it back.
        if st.flags & STATE_PSN_VALID == 0 || roce::psn_ahead(st.next_psn, psn).is_some() {
            st.next_psn = (psn + 1) & roce::PSN_MASK;
        }
        st.flags = (st.flags & STATE_INIT) | request_flags(opcode);
    }
    u
}

/// What `f` tells its flow in state `st` (0: nothing): not 0 unless `f` is in sequence
/// ([`in_sequence`]), [`update_state`] reports nothing and the flags stay (a request is
/// the one the flow expects, a READ REQUEST after one or another request after no READ;
/// a response of a flow seen; the flow's first DSCP). A packet with no news and no
/// [`reasons`] to report is *plain*, nearly every packet: [`update_state`] moves only its
/// expected PSN and [`count`] adds what [`count_plain`] adds (`roce-trace/tests/account.rs`
/// checks all of it on every opcode).
///
/// Branch-free, as [`reasons`]: each test is arithmetic OR-ed into one word, so the
/// kernel's fast path tells the plain packet with one branch. At light load each packet
/// meets a cold branch predictor, and every branch it has to take costs a misprediction:
/// the tests one by one (as [`in_sequence`], [`update_state`] and [`count`] make them)
/// cost every packet a dozen.
#[inline(always)]
pub fn news(st: &FlowState, f: &Facts) -> u64 {
    let facts = roce::facts(f.opcode);
    let request = ((facts >> roce::FACT_REQUEST_BIT) & 1).wrapping_neg();
    // A READ REQUEST leaves STATE_AFTER_READ (2) behind it.
    let after = (facts >> (roce::FACT_READ_REQUEST_BIT - 1)) & STATE_AFTER_READ as u64;
    // STATE_REMEMBERED is what the fast path remembers, not what the flow is.
    let flags = (st.flags & !STATE_REMEMBERED) as u64;
    const SEEN: u64 = STATE_INIT as u64;
    const EXPECTING: u64 = (STATE_INIT | STATE_PSN_VALID) as u64;
    let mut r = (flags & SEEN) ^ SEEN;
    r |= request & ((flags ^ (EXPECTING | after)) | (st.next_psn ^ f.psn) as u64);
    r | (st.first_dscp ^ f.dscp) as u64
}

/// The state's word from its first DSCP on, in memory order: the first DSCP, the flags,
/// the repeated request's TOS and opcode ([`STATE_REPEAT`]); one load.
#[inline(always)]
fn repeat_word(st: &FlowState) -> u32 {
    u32::from_ne_bytes([st.first_dscp, st.flags, st.repeat[0], st.repeat[1]])
}

/// [`repeat_word`] of a flow whose first DSCP and flags are these and that remembers `f`'s
/// TOS and opcode.
#[inline(always)]
fn repeat_word_with(first_dscp: u8, flags: u8, f: &Facts) -> u32 {
    let tos = (f.dscp << 2) | (f.ecn & 3);
    u32::from_ne_bytes([first_dscp, flags, tos, f.opcode])
}

/// [`repeat_word`] of a flow whose last plain request was like `f` (its DSCP the flow's
/// first).
#[inline(always)]
fn repeat_word_of(f: &Facts) -> u32 {
    repeat_word_with(f.dscp, STATE_INIT | STATE_PSN_VALID | STATE_REPEAT, f)
}

/// Whether `f` repeats its flow's last plain request (0: it does): the flow remembers
/// one ([`STATE_REPEAT`], set by [`note_repeat`]), `f` has its TOS and opcode, `lens`
/// are its lengths (`PlainV4::lens`), and `f`'s PSN is the one the flow expects. Such a
/// packet is plain but for its sampling: no news ([`news`]: the flow has seen a request,
/// expects this PSN, its flags stay, its first DSCP is this one's) and no reason to
/// report but the hash ([`reasons`]: a request is no CNP and carries no syndrome, and this
/// TOS was neither CE nor an unexpected DSCP in the packet before). Its frame, read by
/// `parse::plain_v4_fields`, passes `parse::plain_v4_checks` as the remembered one did
/// when it holds `parse::PLAIN_V4_REQUEST_LEN` bytes (the caller's one test): the same
/// lengths and opcode. Two words compared and one PSN, where the checks, [`news`] and
/// [`reasons`] test a dozen facts: the kernel's most common packet
/// (`roce-trace/tests/account.rs` checks it against `news` and `reasons` on every opcode
/// and state, `roce-trace/tests/parse.rs` the checks).
#[inline(always)]
pub fn repeats(st: &FlowState, f: &Facts, lens: u32) -> u64 {
    u64::from((repeat_word(st) ^ repeat_word_of(f)) | (st.next_psn ^ f.psn) | (st.repeat_lens ^ lens))
}

/// Whether `f`, a response whose syndrome has been read (`parse::plain_v4_syndrome`),
/// repeats its flow's last plain response (0: it does): the flow remembers one
/// ([`STATE_REPEAT`] | [`STATE_REPEAT_RESPONSE`], set by [`note_repeat`]), `f` has its
/// TOS, opcode and lengths, its DSCP is the flow's first, and it is not a NAK. Its PSN
/// is not tested: a response's is not the sequence the flow follows ([`in_sequence`]). Such a
/// packet is plain but for its sampling: no news (the flow has seen a packet, its first
/// DSCP is this one's; a response leaves the flags as they are) and no reason to report
/// but the hash (it is not a CNP, not a NAK, and this TOS was neither CE nor an
/// unexpected DSCP in the packet before). Its frame, when it holds its opcode's extended
/// headers (what `plain_v4_syndrome` tests), passes `parse::plain_v4_checks` as the
/// remembered one did: the same lengths and opcode. A request never repeats a response:
/// the kernel's acknowledgements and READ responses are told by this test and the
/// syndrome's read, where the checks, [`news`] and [`reasons`] test a dozen facts.
#[inline(always)]
pub fn repeats_response(st: &FlowState, f: &Facts, lens: u32) -> u64 {
    const REMEMBERED: u8 = STATE_INIT | STATE_REPEAT | STATE_REPEAT_RESPONSE;
    const MASK: u32 = u32::from_ne_bytes([0xff, REMEMBERED, 0xff, 0xff]);
    let request = (roce::facts(f.opcode) >> roce::FACT_REQUEST_BIT) & 1;
    let want = repeat_word_with(f.dscp, REMEMBERED, f);
    let nak = u32::from(f.syndrome & roce::SYNDROME_NAK_BITS);
    u64::from(((repeat_word(st) & MASK) ^ want) | (st.repeat_lens ^ lens) | nak) | request
}

/// After a plain packet `f` of lengths `lens` (`PlainV4::lens` of a frame that passed
/// `parse::plain_v4_checks`), counted ([`count_plain`]): a request other than a READ
/// REQUEST is remembered ([`STATE_REPEAT`]: the flags were `STATE_INIT |
/// STATE_PSN_VALID` and the first DSCP `f`'s, or it would not be plain), so that the
/// next like it is told by [`repeats`]; a response too ([`STATE_REPEAT`] |
/// [`STATE_REPEAT_RESPONSE`] added to the flags, which a response leaves as they are),
/// for [`repeats_response`]. After a READ REQUEST the state stays as it was.
/// Branch-free.
#[inline(always)]
pub fn note_repeat(st: &mut FlowState, f: &Facts, lens: u32) {
    let facts = roce::facts(f.opcode);
    let request = (facts >> roce::FACT_REQUEST_BIT) & 1;
    let remembered = !(facts >> roce::FACT_READ_REQUEST_BIT) & 1;
    // All ones: keep the word (a READ REQUEST). Opaque: LLVM would make the masks a
    // select, a branch in BPF.
    let keep = (crate::opaque(remembered) as u32).wrapping_sub(1);
    // All ones for a request.
    let req = (crate::opaque(request) as u32).wrapping_neg();
    let response = repeat_word_with(st.first_dscp, st.flags | STATE_REPEAT | STATE_REPEAT_RESPONSE, f);
    let new = (repeat_word_of(f) & req) | (response & !req);
    let w = (repeat_word(st) & keep) | (new & !keep);
    let [first_dscp, flags, tos, opcode] = w.to_ne_bytes();
    st.first_dscp = first_dscp;
    st.flags = flags;
    st.repeat = [tos, opcode];
    st.repeat_lens = (st.repeat_lens & keep) | (lens & !keep);
}

/// [`count_plain`] of a response that [`repeats_response`] its flow's last plain one:
/// packets, bytes, the ECN codepoint, the last packet's time and class, and an ACK for
/// an acknowledgement opcode ([`plain_ack`]: the kernel adds it out of line, as this
/// does not). Straight-line code.
#[inline(always)]
pub fn count_response(fc: &mut FlowCounters, f: &Facts, frame_len: u32, now: u64) {
    count_response_but_ack(fc, f, frame_len, now);
    fc.counts.ack += plain_ack(f);
}

/// [`count_response`] but for the ACK (the kernel adds [`plain_ack`] out of line, so a
/// READ response leaves the slot's third line alone), as [`count_plain_but_ack`] is to
/// [`count_plain`].
#[inline(always)]
pub fn count_response_but_ack(fc: &mut FlowCounters, f: &Facts, frame_len: u32, now: u64) {
    count_packet(fc, f, frame_len, now);
}

/// [`count_plain`] of a packet that [`repeats`] its flow's last plain request: the
/// expected PSN after it, packets, bytes, the ECN codepoint, the last packet's time and
/// class (no ACK: it is a request). Straight-line code.
#[inline(always)]
pub fn count_repeat(fc: &mut FlowCounters, f: &Facts, frame_len: u32, now: u64) {
    fc.state.next_psn = f.psn.wrapping_add(1) & roce::PSN_MASK;
    count_packet(fc, f, frame_len, now);
}

/// What every plain packet adds, whatever its opcode: packets, bytes, its ECN
/// codepoint, the last packet's time and class.
#[inline(always)]
fn count_packet(fc: &mut FlowCounters, f: &Facts, frame_len: u32, now: u64) {
    let c = &mut fc.counts;
    c.packets += 1;
    c.bytes += frame_len as u64;
    c.ecn[(f.ecn & 3) as usize] += 1;
    fc.last_ns = now;
    fc.last_dscp = f.dscp;
    fc.last_pcp = f.pcp;
    fc.last_ttl = f.ttl;
}

/// [`update_state`] and [`count`] of a plain packet (see [`news`]): the expected
/// PSN after a request, packets, bytes, the ECN codepoint, an ACK, the last packet's time
/// and class. Straight-line code.
#[inline(always)]
pub fn count_plain(fc: &mut FlowCounters, f: &Facts, frame_len: u32, now: u64) {
    count_plain_but_ack(fc, f, frame_len, now);
    fc.counts.ack += plain_ack(f);
}

/// [`count_plain`] but its ACK, which the kernel adds apart ([`plain_ack`]): the counts
/// from `ack` on lie on a flow slot's third cache line, which a data packet then does not
/// touch. What it writes is on the slot's first two lines.
#[inline(always)]
pub fn count_plain_but_ack(fc: &mut FlowCounters, f: &Facts, frame_len: u32, now: u64) {
    let facts = roce::facts(f.opcode);
    // Opaque: LLVM would make the masks a select, a branch in BPF.
    let request = (crate::opaque((facts >> roce::FACT_REQUEST_BIT) & 1) as u32).wrapping_neg();
    let st = &mut fc.state;
    st.next_psn = ((f.psn.wrapping_add(1) & request) | (st.next_psn & !request)) & roce::PSN_MASK;
    count_packet(fc, f, frame_len, now);
}

/// The ACKs a plain packet adds: 1 for an acknowledgement opcode (a NAK is not plain),
/// else 0.
#[inline(always)]
pub fn plain_ack(f: &Facts) -> u64 {
    (roce::facts(f.opcode) >> roce::FACT_ACK_BIT) & 1
}

/// Adds `f` to its flow's exact counters.
#[inline(always)]
pub fn count(fc: &mut FlowCounters, f: &Facts, frame_len: u32, now: u64, u: &StateUpdate) {
    let c = &mut fc.counts;
    if c.packets == 0 {
        crate::cold_path();
        fc.first_ns = now;
    }
    c.packets += 1;
    c.bytes += frame_len as u64;
    c.ecn[(f.ecn & 3) as usize] += 1;
    if f.opcode == OP_CNP {
        c.cnp += 1;
    }
    match f.ack() {
        Some(AckKind::Ack) => c.ack += 1,
        Some(AckKind::NakPsnSeqErr) => {
            crate::cold_path();
            c.nak_psn_seq_err += 1
        }
        Some(AckKind::RnrNak) => {
            crate::cold_path();
            c.nak_rnr += 1
        }
        Some(AckKind::NakOther) => {
            crate::cold_path();
            c.nak_other += 1
        }
        None => {}
    }
    if u.psn_gap {
        crate::cold_path();
        c.psn_gaps += 1;
    }
    if u.dscp_changed {
        crate::cold_path();
        c.dscp_changed += 1;
    }
    fc.last_ns = now;
    fc.last_dscp = f.dscp;
    fc.last_pcp = f.pcp;
    fc.last_ttl = f.ttl;
}

/// The identity hash's state for `p`'s flow (`FlowState::sample_state`): the rounds of
/// the fields all its packets share. 0 when hash sampling is off.
#[inline(always)]
pub fn sample_state(p: &Parsed, cfg: &DatapathConfig) -> u32 {
    if cfg.sample_enabled == 0 {
        return 0;
    }
    let qp = p.bth.dest_qp();
    if p.ip_version == 4 {
        identity_flow_state_v4(
            cfg.v4_prefix_state,
            p.src_words()[3],
            p.dst_words()[3],
            p.udp_sport,
            p.udp_dport,
            qp,
        )
    } else {
        identity_flow_state(cfg.seed, &p.src, &p.dst, p.udp_sport, p.udp_dport, qp)
    }
}

/// Why `f` must be reported (`REASON_*` bits; 0: it need not be). `flow_state`: the
/// [`sample_state`] of `f`'s flow, as the flow's state keeps it. Branch-free but for the
/// sampling switch (see [`news`]).
#[inline(always)]
pub fn reasons(f: &Facts, cfg: &DatapathConfig, flow_state: u32) -> u32 {
    let facts = roce::facts(f.opcode);
    // Each test a 0 or 1 moved to its bit (multiplying by a power of two is a shift).
    let mut r = ((facts >> roce::FACT_CNP_BIT) & 1) as u32 * REASON_CNP;
    // CE (3): 3 + 1 has bit 2, 0 to 2 plus 1 do not.
    r |= ((((f.ecn & 3) + 1) >> 2) as u32) * REASON_CE;
    // A NAK: an acknowledgement whose syndrome's bits 6:5 are not 0 (`roce::ack_kind`).
    r |= crate::nonzero((f.syndrome & roce::SYNDROME_NAK_BITS) as u64) as u32 * REASON_NAK;
    let mask = cfg.expected_dscp_mask;
    r |= (crate::nonzero(mask) & !(mask >> (f.dscp & 63)) & 1) as u32 * REASON_UNEXPECTED_DSCP;
    r | sampled(f, cfg, flow_state)
}

/// [`REASON_HASH`] when `f` is sampled (its identity hash is at or below the threshold),
/// else 0. `flow_state`: as for [`reasons`].
#[inline(always)]
pub fn sampled(f: &Facts, cfg: &DatapathConfig, flow_state: u32) -> u32 {
    if cfg.sample_enabled == 0 {
        return 0;
    }
    let h = identity_finish(flow_state, f.psn, f.opcode) as u64;
    // Sampled when h <= threshold: h - (threshold + 1) wraps.
    (crate::opaque(h.wrapping_sub(cfg.sample_threshold as u64 + 1)) >> 63) as u32 * REASON_HASH
}
