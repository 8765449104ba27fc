//! Consistent (trajectory) sampling: a hash of the fields the fabric does not change, so
//! every observation point with the same seed samples the same packets.

/// Identity hash of one packet. Addresses are in the 16-byte form of [`crate::datapath::FlowKey`]
/// (IPv4 mapped as `::ffff:a.b.c.d`), so v4 and v6 hash the same way everywhere.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the identity fields, passed flat for the eBPF verifier"
)]
pub fn identity_hash(
    seed: u32,
    src: &[u8; 16],
    dst: &[u8; 16],
    sport: u16,
    dport: u16,
    dest_qp: u32,
    psn: u32,
    opcode: u8,
) -> u32 {
    identity_finish(
        identity_flow_state(seed, src, dst, sport, dport, dest_qp),
        psn,
        opcode,
    )
}

/// The rounds of the ports and the QP.
#[inline(always)]
const fn ports_qp(h: u32, sport: u16, dport: u16, dest_qp: u32) -> u32 {
    mix(mix(h, ((sport as u32) << 16) | dport as u32), dest_qp)
}

/// The identity hash's state after the fields every packet of one flow shares — the
/// addresses, ports and QP — from which [`identity_finish`] completes a packet's hash in
/// two rounds and the finaliser. The kernel keeps it with the flow (`FlowState`), so a
/// packet pays for what changes from packet to packet only.
#[inline(always)]
pub fn identity_flow_state(
    seed: u32,
    src: &[u8; 16],
    dst: &[u8; 16],
    sport: u16,
    dport: u16,
    dest_qp: u32,
) -> u32 {
    let mut h = seed ^ 0x9e37_79b9;
    let mut i = 0;
    while i < 16 {
        h = mix(
            h,
            u32::from_ne_bytes([src[i], src[i + 1], src[i + 2], src[i + 3]]),
        );
        h = mix(
            h,
            u32::from_ne_bytes([dst[i], dst[i + 1], dst[i + 2], dst[i + 3]]),
        );
        i += 4;
    }
    ports_qp(h, sport, dport, dest_qp)
}

/// [`identity_flow_state`] of an IPv4 flow from [`v4_prefix_state`] and the addresses'
/// last words (as [`identity_hash_v4`] takes them).
#[inline(always)]
pub const fn identity_flow_state_v4(
    prefix_state: u32,
    src: u32,
    dst: u32,
    sport: u16,
    dport: u16,
    dest_qp: u32,
) -> u32 {
    ports_qp(mix(mix(prefix_state, src), dst), sport, dport, dest_qp)
}

/// A packet's identity hash from its flow's state ([`identity_flow_state`]), its PSN and
/// opcode: the flow's state, the 24-bit PSN and the opcode as one 64-bit word (state
/// high, then PSN, then opcode), through MurmurHash3's 64-bit finaliser ([`fmix64`]),
/// whose high half is the hash. Every packet of every watched flow pays for this, so it
/// is two multiplies and three shifts where murmur3's 32-bit rounds over the PSN and the
/// opcode and their finaliser were eight multiplies and four rotations (the sampling
/// scheme of protocol 8; protocol 7's points sampled other packets).
#[inline(always)]
pub const fn identity_finish(flow_state: u32, psn: u32, opcode: u8) -> u32 {
    let word = (flow_state as u64) << 32 | ((psn & 0xff_ffff) << 8 | opcode as u32) as u64;
    (fmix64(word) >> 32) as u32
}

/// MurmurHash3's 64-bit finaliser: a bijection in which every input bit moves every
/// output bit. The identity hash's last step, and the fleet's partitions'.
#[inline(always)]
pub const fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The identity hash's state after the first three words of two IPv4-mapped addresses
/// (`::ffff:` — the same for every IPv4 packet), for [`identity_hash_v4`].
pub const fn v4_prefix_state(seed: u32) -> u32 {
    let prefix = u32::from_ne_bytes([0, 0, 0xff, 0xff]);
    let mut h = seed ^ 0x9e37_79b9;
    h = mix(h, 0);
    h = mix(h, 0);
    h = mix(h, 0);
    h = mix(h, 0);
    h = mix(h, prefix);
    mix(h, prefix)
}

/// [`identity_hash`] of an IPv4 packet, from [`v4_prefix_state`] and the two addresses'
/// last words (`u32::from_ne_bytes` of the four address bytes): the same value, six
/// fewer rounds.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the identity fields, passed flat for the eBPF verifier"
)]
pub fn identity_hash_v4(
    prefix_state: u32,
    src: u32,
    dst: u32,
    sport: u16,
    dport: u16,
    dest_qp: u32,
    psn: u32,
    opcode: u8,
) -> u32 {
    identity_finish(
        identity_flow_state_v4(prefix_state, src, dst, sport, dport, dest_qp),
        psn,
        opcode,
    )
}

/// Id of a mirror session (outer source as four words, session id or GRE key, `MIRROR_*`):
/// the same murmur mix, a fixed seed (ids are local to one host, never compared across
/// hosts), and never 0, which means "not mirrored" in a flow key.
#[inline(always)]
pub const fn mirror_hash(src: [u32; 4], session: u32, kind: u8) -> u32 {
    let mut h = 0x6d69_7272; // "mirr"
    h = mix(h, src[0]);
    h = mix(h, src[1]);
    h = mix(h, src[2]);
    h = mix(h, src[3]);
    h = mix(h, session);
    h = mix(h, kind as u32);
    fmix(h) | 1
}

// murmur3's 32-bit block mix and finaliser.
#[inline(always)]
const fn mix(h: u32, k: u32) -> u32 {
    let k = k
        .wrapping_mul(0xcc9e_2d51)
        .rotate_left(15)
        .wrapping_mul(0x1b87_3593);
    (h ^ k).rotate_left(13).wrapping_mul(5).wrapping_add(0xe654_6b64)
}

#[inline(always)]
const fn fmix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Threshold for "1 in `rate`" sampling: a packet is sampled when its hash is `<=` it.
/// `rate == 0` disables hash sampling (anomalies are still reported).
pub const fn threshold_for_rate(rate: u32) -> Option<u32> {
    match rate {
        0 => None,
        1 => Some(u32::MAX),
        n => Some(((1u64 << 32) / n as u64 - 1) as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pseudo-random words for the tests, from `x` (not 0).
    fn xorshift(mut x: u32) -> impl FnMut() -> u32 {
        move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        }
    }

    #[test]
    fn thresholds() {
        assert_eq!(threshold_for_rate(0), None);
        assert_eq!(threshold_for_rate(1), Some(u32::MAX));
        assert_eq!(threshold_for_rate(2), Some(0x7fff_ffff));
        assert_eq!(threshold_for_rate(1000), Some(4_294_966));
    }

    #[test]
    fn hash_depends_on_every_identity_field_and_the_seed() {
        let (a, b) = ([1u8; 16], [2u8; 16]);
        let base = identity_hash(7, &a, &b, 1, 4791, 0x11, 5, 0x0a);
        assert_ne!(base, identity_hash(8, &a, &b, 1, 4791, 0x11, 5, 0x0a));
        assert_ne!(base, identity_hash(7, &b, &a, 1, 4791, 0x11, 5, 0x0a));
        assert_ne!(base, identity_hash(7, &a, &b, 2, 4791, 0x11, 5, 0x0a));
        assert_ne!(base, identity_hash(7, &a, &b, 1, 4791, 0x12, 5, 0x0a));
        assert_ne!(base, identity_hash(7, &a, &b, 1, 4791, 0x11, 6, 0x0a));
        assert_ne!(base, identity_hash(7, &a, &b, 1, 4791, 0x11, 5, 0x0b));
        assert_eq!(base, identity_hash(7, &a, &b, 1, 4791, 0x11, 5, 0x0a));
    }

    #[test]
    fn the_ipv4_shortcut_is_the_same_hash() {
        let mut next = xorshift(0x1234_5678);
        for _ in 0..10_000 {
            let (seed, a, b, ports, qp, psn) = (next(), next(), next(), next(), next(), next());
            let mapped = |w: u32| {
                let mut m = [0u8; 16];
                m[10] = 0xff;
                m[11] = 0xff;
                m[12..].copy_from_slice(&w.to_ne_bytes());
                m
            };
            let (sport, dport, op) = ((ports >> 16) as u16, ports as u16, psn as u8);
            assert_eq!(
                identity_hash_v4(v4_prefix_state(seed), a, b, sport, dport, qp, psn & 0xff_ffff, op),
                identity_hash(
                    seed,
                    &mapped(a),
                    &mapped(b),
                    sport,
                    dport,
                    qp,
                    psn & 0xff_ffff,
                    op
                ),
            );
        }
    }

    /// The hash as one sequence of rounds, written out apart from the split the kernel
    /// uses (flow state, then the packet's fields): the two must agree bit for bit, or
    /// points running them would sample different packets.
    #[expect(clippy::too_many_arguments, reason = "the identity fields")]
    fn reference(
        seed: u32,
        src: &[u8; 16],
        dst: &[u8; 16],
        sport: u16,
        dport: u16,
        qp: u32,
        psn: u32,
        op: u8,
    ) -> u32 {
        let w = |a: &[u8; 16], i: usize| u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
        let mut h = seed ^ 0x9e37_79b9;
        for i in (0..16).step_by(4) {
            h = mix(h, w(src, i));
            h = mix(h, w(dst, i));
        }
        for k in [((sport as u32) << 16) | dport as u32, qp] {
            h = mix(h, k);
        }
        (fmix64((h as u64) << 32 | (psn as u64) << 8 | op as u64) >> 32) as u32
    }

    #[test]
    fn the_flow_state_split_is_the_same_hash() {
        let mut next = xorshift(0x9abc_def0);
        for _ in 0..10_000 {
            let mut a = [0u8; 16];
            let mut b = [0u8; 16];
            for i in (0..16).step_by(4) {
                a[i..i + 4].copy_from_slice(&next().to_ne_bytes());
                b[i..i + 4].copy_from_slice(&next().to_ne_bytes());
            }
            let (seed, ports, qp, psn) = (next(), next(), next() & 0xff_ffff, next() & 0xff_ffff);
            let (sport, dport, op) = ((ports >> 16) as u16, ports as u16, qp as u8);
            let want = reference(seed, &a, &b, sport, dport, qp, psn, op);
            assert_eq!(identity_hash(seed, &a, &b, sport, dport, qp, psn, op), want);
            let st = identity_flow_state(seed, &a, &b, sport, dport, qp);
            assert_eq!(identity_finish(st, psn, op), want);
            // IPv4: the mapped form through the prefix shortcut.
            a[..12].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
            b[..12].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
            let w = |m: &[u8; 16]| u32::from_ne_bytes([m[12], m[13], m[14], m[15]]);
            let st4 = identity_flow_state_v4(v4_prefix_state(seed), w(&a), w(&b), sport, dport, qp);
            assert_eq!(
                identity_finish(st4, psn, op),
                reference(seed, &a, &b, sport, dport, qp, psn, op)
            );
        }
        // And the value itself does not drift within a protocol version (points of one
        // fabric must sample the same packets): computed apart, in Python (murmur3's
        // rounds, then fmix64 of state << 32 | psn << 8 | opcode; protocol 7's murmur3
        // finish gave 0xfe4a_ee0b here).
        assert_eq!(
            identity_hash(0, &[0; 16], &[1; 16], 49152, 4791, 0x11, 5, 0x0a),
            0x6bc0_43d1
        );
    }

    #[test]
    fn mirror_ids_are_nonzero_and_depend_on_every_field() {
        let src = [0, 0, 0xffff_0000, 0x0964_00c6];
        let base = mirror_hash(src, 7, 3);
        assert_ne!(base, 0);
        assert_eq!(base, mirror_hash(src, 7, 3));
        assert_ne!(base, mirror_hash([0, 0, 0xffff_0000, 0x0a64_00c6], 7, 3));
        assert_ne!(base, mirror_hash([1, 0, 0xffff_0000, 0x0964_00c6], 7, 3));
        assert_ne!(base, mirror_hash(src, 8, 3));
        assert_ne!(base, mirror_hash(src, 7, 4));
        // Zero is never an id, even for an all-zero session.
        assert!((0..10_000u32).all(|s| mirror_hash([0; 4], s, 0) != 0));
    }

    /// What a fabric sends: many flows, each a run of consecutive PSNs, a few opcodes. At
    /// 1 in 1000 each opcode gets its share, a sampled PSN makes the next no likelier to
    /// be sampled, and two flows whose states differ in one bit sample unrelated packets:
    /// what a weak finish (one without its shifts, or without the state in the word)
    /// would not give.
    #[test]
    fn sampling_is_even_over_flows_runs_of_psns_and_opcodes() {
        let th = threshold_for_rate(1000).unwrap();
        let mut next = xorshift(0x5eed_1234);
        let ops = [0x06u8, 0x07, 0x08, 0x11];
        let (mut per_op, mut after_hit, mut in_neighbour) = ([0u32; 4], 0, 0);
        for _ in 0..256 {
            let (st, start) = (next(), next());
            for (i, &op) in ops.iter().enumerate() {
                let mut last = false;
                for k in 0..4096u32 {
                    let psn = start.wrapping_add(k) & 0xff_ffff;
                    let hit = identity_finish(st, psn, op) <= th;
                    per_op[i] += u32::from(hit);
                    after_hit += u32::from(hit && last);
                    in_neighbour += u32::from(hit && identity_finish(st ^ 1 << (k % 32), psn, op) <= th);
                    last = hit;
                }
            }
        }
        // 1,048,576 packets an opcode: 1,049 expected, sigma 32.
        for (op, n) in ops.iter().zip(per_op) {
            assert!(
                (889..=1209).contains(&n),
                "opcode {op:#x}: {n} sampled of 1048576"
            );
        }
        // Both about 4 expected (4 Mi pairs at one in a million).
        assert!(
            after_hit <= 16,
            "{after_hit} sampled PSNs right after a sampled one"
        );
        assert!(
            in_neighbour <= 16,
            "{in_neighbour} packets sampled in a flow one bit away too"
        );
    }

    #[test]
    fn one_in_n_is_close_to_n() {
        let th = threshold_for_rate(100).unwrap();
        let hits = (0..100_000u32)
            .filter(|&psn| identity_hash(1, &[0; 16], &[1; 16], 9, 4791, 3, psn, 6) <= th)
            .count();
        assert!((800..=1200).contains(&hits), "{hits} of 100000 at 1 in 100");
    }
}
