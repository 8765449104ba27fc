//! The kernel's plain packet (`account::news`, `account::reasons`, `account::count_plain`):
//! one branch-free test and straight-line counting in place of the sequence test, the
//! state update, the counters one by one and the reasons. They must count exactly what the full
//! accounting counts, and take exactly the packets it would leave without news.

use roce_trace_common::{
    account::{self, StateUpdate},
    datapath::{
        Counts, DatapathConfig, FlowCounters, FlowState, REASON_CE, REASON_CNP, REASON_HASH, REASON_NAK,
        REASON_UNEXPECTED_DSCP, STATE_REMEMBERED, STATE_REPEAT, STATE_REPEAT_RESPONSE,
    },
    parse::Facts,
    roce::{self, AckKind, OP_CNP, PSN_MASK, op},
    sampling::{identity_finish, threshold_for_rate},
};

/// A packet's facts as the parsers give them: an acknowledgement opcode carries its
/// syndrome's meaning, no other opcode does.
fn facts(opcode: u8, psn: u32, dscp: u8, ecn: u8, syndrome: u8) -> Facts {
    Facts {
        opcode,
        psn,
        dscp,
        ecn,
        ttl: 63,
        pcp: 3,
        syndrome: if roce::is_ack_opcode(opcode) { syndrome } else { 0 },
    }
}

/// Why a packet must be reported, test by test: what `account::reasons` computes without
/// branches.
fn reasons_spec(f: &Facts, cfg: &DatapathConfig, flow_state: u32) -> u32 {
    let mut r = 0;
    if f.opcode == OP_CNP {
        r |= REASON_CNP;
    }
    if f.ecn == 3 {
        r |= REASON_CE;
    }
    if matches!(
        f.ack(),
        Some(AckKind::RnrNak | AckKind::NakPsnSeqErr | AckKind::NakOther)
    ) {
        r |= REASON_NAK;
    }
    if cfg.expected_dscp_mask != 0 && (cfg.expected_dscp_mask >> (f.dscp & 63)) & 1 == 0 {
        r |= REASON_UNEXPECTED_DSCP;
    }
    if cfg.sample_enabled != 0 && identity_finish(flow_state, f.psn, f.opcode) <= cfg.sample_threshold {
        r |= REASON_HASH;
    }
    r
}

/// The lengths (`PlainV4::lens`) of the frame a state remembers: IPv4 total length 1064,
/// UDP length 1044.
const LENS: u32 = 1064 | 1044 << 16;
/// Other lengths, for the packet a test has the state remember.
const OTHER_LENS: u32 = 96 | 76 << 16;

fn counters(st: FlowState, seed: u64) -> FlowCounters {
    let mut c = FlowCounters {
        state: st,
        last_dscp: 1,
        last_pcp: 2,
        last_ttl: 3,
        _pad: [0; 5],
        last_ns: 1_000,
        first_ns: 500,
        counts: Counts::default(),
    };
    // A flow already counted (the fast path reads only flows that hold their slot).
    for (i, v) in c.counts.values_mut().iter_mut().enumerate() {
        *v = seed.wrapping_mul(i as u64 + 7) % 1000 + 1;
    }
    c
}

/// After a plain packet of lengths `lens` is remembered in `st`, `next`, like it, is told
/// by `repeats` (`account::repeats` or `account::repeats_response`), and is plain but for
/// its sampling; of other lengths it is not told.
fn the_next_like_it_repeats(
    repeats: fn(&FlowState, &Facts, u32) -> u64,
    st: &FlowState,
    next: &Facts,
    lens: u32,
    cfg: &DatapathConfig,
) {
    let opcode = next.opcode;
    assert_eq!(repeats(st, next, lens), 0, "opcode {opcode:#x} psn {}", next.psn);
    assert_ne!(
        repeats(st, next, lens ^ 4 << 16),
        0,
        "opcode {opcode:#x}, another UDP length"
    );
    let r = account::reasons(next, cfg, st.sample_state);
    assert_eq!(
        (account::news(st, next), r & !REASON_HASH),
        (0, 0),
        "the repeat of opcode {opcode:#x} is not plain"
    );
}

/// Every opcode, every state flag combination, PSNs at, before and after the expected one
/// (and across the wrap), each ECN codepoint, the first DSCP and another, ACK and NAK
/// syndromes, under sampling off, on at 1 in 4 and on for every packet, with and without
/// a DSCP expectation.
#[test]
fn a_plain_packet_is_counted_as_the_full_accounting_counts_it_and_only_such_is_plain() {
    let configs = [
        DatapathConfig::with(7, 0, 0, 0),
        DatapathConfig::with(7, threshold_for_rate(4).unwrap(), 1, 0),
        DatapathConfig::with(9, u32::MAX, 1, 0),
        DatapathConfig::with(7, 0, 0, 1 << 26),
        DatapathConfig::with(7, threshold_for_rate(4).unwrap(), 1, 1 << 26 | 1 << 46),
    ];
    let (mut plain, mut others, mut sampled_out, mut repeats) = (0u64, 0u64, 0u64, 0u64);
    let mut response_repeats = 0u64;
    let mut by_opcode = [false; 256];
    for (ci, cfg) in configs.iter().enumerate() {
        for opcode in 0..=255u8 {
            // STATE_REPEAT (and STATE_REPEAT_RESPONSE) with the packet's own TOS and
            // opcode, another's, or none.
            for (flags, remembered) in (0..32u8).flat_map(|fl| [(fl, 0u8), (fl, 1), (fl, 2)]) {
                for next_psn in [5, PSN_MASK] {
                    for dpsn in [0u32, 1, 2, PSN_MASK] {
                        let psn = next_psn.wrapping_add(dpsn) & PSN_MASK;
                        for ecn in 0..4u8 {
                            for dscp in [26u8, 46] {
                                for syndrome in [0x1f, 0x20, 0x60, 0x61] {
                                    let tos = dscp << 2 | ecn;
                                    let st = FlowState {
                                        next_psn,
                                        sample_state: 0x9e37_79b9 ^ (psn << 3) ^ ci as u32,
                                        first_dscp: 26,
                                        flags,
                                        // Any packet but a READ REQUEST is remembered
                                        // (`note_repeat`, checked below): a request
                                        // without STATE_REPEAT_RESPONSE, a response
                                        // with it (a request clears it: checked below).
                                        repeat: match remembered {
                                            1 if !roce::is_read_request(opcode)
                                                && roce::is_request(opcode)
                                                    == (flags & STATE_REPEAT_RESPONSE == 0) =>
                                            {
                                                [tos, opcode]
                                            }
                                            2 => [26 << 2, op::WRITE_MIDDLE],
                                            _ => [0; 2],
                                        },
                                        repeat_lens: if remembered == 0 { 0 } else { LENS },
                                    };
                                    let f = facts(opcode, psn, dscp, ecn, syndrome);
                                    let reasons = account::reasons(&f, cfg, st.sample_state);
                                    assert_eq!(
                                        reasons,
                                        reasons_spec(&f, cfg, st.sample_state),
                                        "{f:?} config {ci}"
                                    );
                                    let np = account::news(&st, &f) | u64::from(reasons);

                                    // What the full accounting makes of the packet.
                                    let mut st_full = st;
                                    let in_sequence = account::in_sequence(&st, &f);
                                    let update = account::update_state(&mut st_full, &f);
                                    // A request leaves nothing remembered (the kernel's
                                    // fast path remembers it again when it is plain).
                                    if roce::is_request(opcode) {
                                        assert_eq!(st_full.flags & STATE_REMEMBERED, 0, "{opcode:#x}");
                                    }
                                    // The flags stay but for what the fast path remembers.
                                    let not_plain = !in_sequence
                                        || update != StateUpdate::default()
                                        || st_full.flags & !STATE_REMEMBERED != st.flags & !STATE_REMEMBERED
                                        || reasons != 0;
                                    // A packet that repeats the flow's last plain request
                                    // leaves its flow's state as a plain packet does, and is
                                    // counted alike. (Its reasons are the remembered
                                    // packet's but for the hash, none: a state remembers
                                    // only a plain packet, checked below.)
                                    // Another frame's lengths: never a repeat (its
                                    // headers' checks are not the remembered one's).
                                    for lens in [0, LENS ^ 1, LENS ^ 1 << 16, LENS ^ 0x8000_8000] {
                                        assert_ne!(
                                            account::repeats(&st, &f, lens),
                                            0,
                                            "a repeat with lengths {lens:#x}: opcode {opcode:#x}"
                                        );
                                        assert_ne!(
                                            account::repeats_response(&st, &f, lens),
                                            0,
                                            "a response's repeat with lengths {lens:#x}: opcode {opcode:#x}"
                                        );
                                    }
                                    // A packet that repeats the flow's last plain response
                                    // is a response, not a NAK, and leaves its flow's state
                                    // as a plain packet does, whatever its PSN; counted
                                    // alike. (Its other reasons are the remembered packet's
                                    // but for the hash: none.)
                                    if account::repeats_response(&st, &f, LENS) == 0 {
                                        assert!(
                                            !roce::is_request(opcode)
                                                && reasons & REASON_NAK == 0
                                                && in_sequence
                                                && update == StateUpdate::default()
                                                && st_full.flags & !STATE_REMEMBERED
                                                    == st.flags & !STATE_REMEMBERED
                                                && account::repeats(&st, &f, LENS) != 0,
                                            "repeats a response but is not plain: opcode {opcode:#x} \
                                             flags {flags} psn {psn} syndrome {syndrome:#x} ecn {ecn} \
                                             dscp {dscp} config {ci}: in sequence {in_sequence}, \
                                             {update:?}, reasons {reasons:#x}"
                                        );
                                        let seed = u64::from(psn);
                                        let mut a = counters(st, seed);
                                        account::count_response(&mut a, &f, 1078, 9_000);
                                        let mut b = counters(st, seed);
                                        account::count_plain(&mut b, &f, 1078, 9_000);
                                        assert_eq!(a, b, "response repeat: opcode {opcode:#x} psn {psn}");
                                        response_repeats += 1;
                                    }
                                    if account::repeats(&st, &f, LENS) == 0 {
                                        assert!(
                                            in_sequence
                                                && update == StateUpdate::default()
                                                && st_full.flags & !STATE_REMEMBERED
                                                    == st.flags & !STATE_REMEMBERED,
                                            "repeats but is not plain: opcode {opcode:#x} flags {flags} \
                                             psn {psn} (expected {next_psn}) ecn {ecn} dscp {dscp} config \
                                             {ci}: in sequence {in_sequence}, {update:?}, reasons {reasons:#x}"
                                        );
                                        let seed = u64::from(psn);
                                        let mut a = counters(st, seed);
                                        account::count_repeat(&mut a, &f, 1078, 9_000);
                                        let mut b = counters(st, seed);
                                        account::count_plain(&mut b, &f, 1078, 9_000);
                                        assert_eq!(a, b, "repeat: opcode {opcode:#x} psn {psn}");
                                        repeats += 1;
                                    }
                                    assert_eq!(
                                        np == 0,
                                        !not_plain,
                                        "plain or not: opcode {opcode:#x} flags {flags} psn {psn} \
                                         (expected {next_psn}) ecn {ecn} dscp {dscp} syndrome \
                                         {syndrome:#x} config {ci}: news | reasons {np:#x}, in sequence \
                                         {in_sequence}, {update:?}, flags {} -> {}, reasons {reasons:#x}",
                                        st.flags,
                                        st_full.flags
                                    );
                                    if np != 0 {
                                        others += 1;
                                        sampled_out += u64::from(reasons == REASON_HASH && in_sequence);
                                        continue;
                                    }
                                    plain += 1;
                                    by_opcode[opcode as usize] = true;
                                    let seed = u64::from(psn) ^ u64::from(opcode) << 24;
                                    let mut a = counters(st, seed);
                                    account::count_plain(&mut a, &f, 1078, 9_000);
                                    // The kernel's plain packet: counted, then remembered
                                    // when it is a request other than a READ REQUEST, or a
                                    // response.
                                    let request = roce::is_request(opcode);
                                    let remembers = request && !roce::is_read_request(opcode);
                                    let lens = OTHER_LENS ^ u32::from(opcode);
                                    account::note_repeat(&mut a.state, &f, lens);
                                    // What the fast path remembers of a state.
                                    let memory =
                                        |s: &FlowState| (s.first_dscp, s.flags, s.repeat, s.repeat_lens);
                                    if !request {
                                        assert_eq!(
                                            memory(&a.state),
                                            (
                                                dscp,
                                                flags | STATE_REPEAT | STATE_REPEAT_RESPONSE,
                                                [tos, opcode],
                                                lens
                                            ),
                                            "a response remembered: opcode {opcode:#x}"
                                        );
                                        // The next like it repeats it at any PSN, unless a
                                        // NAK or of other lengths, and is plain but for its
                                        // sampling; a request's test never takes it.
                                        for dp in [1, 7, PSN_MASK] {
                                            let p2 = (psn + dp) & PSN_MASK;
                                            let next = facts(opcode, p2, dscp, ecn, syndrome);
                                            the_next_like_it_repeats(
                                                account::repeats_response,
                                                &a.state,
                                                &next,
                                                lens,
                                                cfg,
                                            );
                                            let next_psn =
                                                facts(opcode, a.state.next_psn, dscp, ecn, syndrome);
                                            assert_ne!(
                                                account::repeats(&a.state, &next_psn, lens),
                                                0,
                                                "opcode {opcode:#x}: a response as a request's repeat"
                                            );
                                        }
                                        if roce::is_ack_opcode(opcode) {
                                            for nak in [0x20, 0x60, 0x61, 0x7f] {
                                                let next = facts(opcode, psn, dscp, ecn, nak);
                                                assert_ne!(
                                                    account::repeats_response(&a.state, &next, lens),
                                                    0,
                                                    "opcode {opcode:#x}: NAK {nak:#x} as a repeat"
                                                );
                                            }
                                        }
                                    }
                                    if remembers {
                                        assert_eq!(
                                            memory(&a.state),
                                            (
                                                dscp,
                                                flags & !STATE_REMEMBERED | STATE_REPEAT,
                                                [tos, opcode],
                                                lens
                                            ),
                                            "remembered: opcode {opcode:#x}"
                                        );
                                        // The next like it repeats it, and is plain but for
                                        // its sampling; of other lengths it does not.
                                        let next = facts(opcode, (psn + 1) & PSN_MASK, dscp, ecn, syndrome);
                                        the_next_like_it_repeats(
                                            account::repeats,
                                            &a.state,
                                            &next,
                                            lens,
                                            cfg,
                                        );
                                        assert_ne!(
                                            account::repeats_response(&a.state, &next, lens),
                                            0,
                                            "opcode {opcode:#x}: a request as a response's repeat"
                                        );
                                    } else if request {
                                        assert_eq!(
                                            memory(&a.state),
                                            memory(&st),
                                            "not remembered: opcode {opcode:#x}"
                                        );
                                    }
                                    let mut b = counters(st_full, seed);
                                    account::count(&mut b, &f, 1078, 9_000, &update);
                                    // What the full accounting leaves of what the fast path
                                    // remembers: a request clears it, a response keeps it.
                                    for c in [&mut a, &mut b] {
                                        c.state.flags &= !STATE_REMEMBERED;
                                        c.state.repeat = [0; 2];
                                        c.state.repeat_lens = 0;
                                    }
                                    assert_eq!(
                                        a, b,
                                        "opcode {opcode:#x} flags {flags} psn {psn} syndrome {syndrome:#x}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // The common packets are plain: data in sequence, an ACK, a read response, a READ
    // REQUEST after one; a CNP never is (it is always reported).
    for o in [
        op::WRITE_MIDDLE,
        op::SEND_ONLY,
        op::ACKNOWLEDGE,
        op::READ_RESPONSE_MIDDLE,
        op::READ_REQUEST,
    ] {
        assert!(by_opcode[o as usize], "opcode {o:#x} is never plain");
    }
    assert!(!by_opcode[OP_CNP as usize], "a CNP was plain");
    assert!(
        plain > 10_000 && others > 100_000 && sampled_out > 1000 && repeats > 1000 && response_repeats > 1000,
        "{plain} plain, {others} not, {repeats} repeats, {response_repeats} response repeats"
    );
}
