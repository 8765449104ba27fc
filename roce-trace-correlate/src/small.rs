//! Small containers for per-flow state: a flow has a handful of points, links and classes,
//! so its maps are sorted vectors grown one slot at a time (a `BTreeMap` allocates a node
//! of eleven slots for one entry, a `Vec` four), and the counters of each point are kept
//! as varints (most of a flow's 13 counters are zero or small).

use roce_trace_common::datapath::Counts;

/// Pushes `v`, growing the vector by exactly one slot when it is full: a flow's vectors
/// hold a few entries for hours, so slack would cost more than the copies.
pub(crate) fn push_tight<T>(v: &mut Vec<T>, x: T) {
    if v.len() == v.capacity() {
        v.reserve_exact(1);
    }
    v.push(x);
}

/// A map of a few entries, sorted by key: iteration is in key order, as a `BTreeMap`'s.
/// A boxed slice grown one slot at a time (16 bytes inline instead of a `Vec`'s 24: a
/// flow holds several of these for hours, and they change size rarely).
#[derive(Clone, Debug)]
pub(crate) struct VecMap<K, V>(Box<[(K, V)]>);

impl<K, V> Default for VecMap<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K, V> VecMap<K, V> {
    pub(crate) fn new() -> Self {
        Self(Box::default())
    }

    /// Changes the entries as a vector (no copy: a boxed slice is a vector without its
    /// capacity), kept exactly as long as it ends up.
    fn edit<R>(&mut self, change: impl FnOnce(&mut Vec<(K, V)>) -> R) -> R {
        let mut v = std::mem::take(&mut self.0).into_vec();
        let r = change(&mut v);
        self.0 = v.into_boxed_slice();
        r
    }
}

impl<K: Ord + Copy, V> VecMap<K, V> {
    fn find(&self, k: &K) -> Result<usize, usize> {
        self.0.binary_search_by(|(x, _)| x.cmp(k))
    }

    pub(crate) fn get(&self, k: &K) -> Option<&V> {
        self.find(k).ok().map(|i| &self.0[i].1)
    }

    pub(crate) fn get_mut(&mut self, k: &K) -> Option<&mut V> {
        self.find(k).ok().map(|i| &mut self.0[i].1)
    }

    pub(crate) fn contains_key(&self, k: &K) -> bool {
        self.find(k).is_ok()
    }

    /// The value at `k`, inserted by `make` when absent.
    pub(crate) fn get_or_insert_with(&mut self, k: K, make: impl FnOnce() -> V) -> &mut V {
        let i = match self.find(&k) {
            Ok(i) => i,
            Err(i) => {
                let x = (k, make());
                self.edit(|v| {
                    v.reserve_exact(1);
                    v.insert(i, x);
                });
                i
            }
        };
        &mut self.0[i].1
    }

    pub(crate) fn entry_or_default(&mut self, k: K) -> &mut V
    where
        V: Default,
    {
        self.get_or_insert_with(k, V::default)
    }

    pub(crate) fn insert(&mut self, k: K, v: V) {
        match self.find(&k) {
            Ok(i) => self.0[i].1 = v,
            Err(i) => self.edit(|m| {
                m.reserve_exact(1);
                m.insert(i, (k, v));
            }),
        }
    }

    pub(crate) fn remove(&mut self, k: &K) -> Option<V> {
        let i = self.find(k).ok()?;
        Some(self.edit(|v| v.remove(i).1))
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

/// A point's running totals, unpacked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PointTotals {
    pub(crate) counts: Counts,
    pub(crate) last_dscp: u8,
    pub(crate) last_pcp: u8,
    pub(crate) last_ttl: u8,
}

const _: () = assert!(Counts::LEN <= 16, "the nonzero mask is 16 bits");

/// The most one point's totals take packed: mask, 13 ten-byte varints, 3 class bytes.
const PACKED_MAX: usize = 2 + Counts::LEN * 10 + 3;

impl PointTotals {
    /// A 16-bit mask of the nonzero counters, each of those as a LEB128 varint, then the
    /// last DSCP, PCP and TTL: most of a flow's 13 counters are zero, so a typical point
    /// takes 12–16 bytes instead of 107. Exact: every value reads back as written.
    fn pack(&self, out: &mut impl Extend<u8>) {
        let vals = self.counts.values();
        let mask = vals
            .iter()
            .enumerate()
            .fold(0u16, |m, (i, &v)| m | (u16::from(v != 0) << i));
        out.extend(mask.to_le_bytes());
        for &v in vals.iter().filter(|&&v| v != 0) {
            put_varint(out, v);
        }
        out.extend([self.last_dscp, self.last_pcp, self.last_ttl]);
    }

    fn unpack(b: &[u8]) -> Self {
        let mask = u16::from_le_bytes([b.first().copied().unwrap_or(0), b.get(1).copied().unwrap_or(0)]);
        let mut i = 2;
        let vals: [u64; Counts::LEN] = std::array::from_fn(|k| {
            if mask & (1 << k) != 0 {
                get_varint(b, &mut i)
            } else {
                0
            }
        });
        let last = |k: usize| b.get(i + k).copied().unwrap_or(0);
        Self {
            counts: Counts::from_values(vals),
            last_dscp: last(0),
            last_pcp: last(1),
            last_ttl: last(2),
        }
    }
}

/// Every point's running counters of one flow in a single buffer, in point order: per
/// point its id (varint), the length of its packed totals (one byte) and the totals
/// ([`PointTotals::pack`]). One allocation a flow instead of one a point; updated in
/// place when the packed length does not change (the common case once counts are large).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PackedCounts(Vec<u8>);

impl PackedCounts {
    /// (point, where its totals start, their length) of each entry, in point order.
    fn entries(&self) -> impl Iterator<Item = (u32, usize, usize)> + '_ {
        let mut i = 0;
        std::iter::from_fn(move || {
            if i >= self.0.len() {
                return None;
            }
            let p = get_varint(&self.0, &mut i) as u32;
            let len = usize::from(*self.0.get(i)?);
            let at = i + 1;
            i = at + len;
            Some((p, at, len))
        })
    }

    pub(crate) fn get(&self, p: u32) -> Option<PointTotals> {
        let (_, at, len) = self.entries().find(|(q, ..)| *q == p)?;
        Some(PointTotals::unpack(&self.0[at..at + len]))
    }

    pub(crate) fn set(&mut self, p: u32, t: &PointTotals) {
        let mut packed = Scratch::<PACKED_MAX>::new();
        t.pack(&mut packed);
        const { assert!(PACKED_MAX <= 255) };
        let found = self.entries().find(|(q, ..)| *q >= p);
        match found {
            Some((q, at, len)) if q == p => {
                if len != packed.len() {
                    self.0[at - 1] = packed.len() as u8;
                    if packed.len() > len {
                        self.grow(packed.len() - len);
                    }
                }
                self.0.splice(at..at + len, packed.as_slice().iter().copied());
            }
            other => {
                // A new point: inserted before the first larger one (or at the end).
                let mut entry = Scratch::<{ PACKED_MAX + 6 }>::new();
                put_varint(&mut entry, u64::from(p));
                entry.extend([packed.len() as u8]);
                entry.extend(packed.as_slice().iter().copied());
                let start = match other {
                    Some((q, at, _)) => at - 1 - varint_len(u64::from(q)),
                    None => self.0.len(),
                };
                self.grow(entry.len());
                self.0.splice(start..start, entry.as_slice().iter().copied());
            }
        }
    }

    /// Room for `n` more bytes, growing by at least half the buffer: each move of a
    /// flow's buffer leaves a hole the allocator rarely reuses, so a few moves with a
    /// little slack cost less resident memory than one move per new point.
    fn grow(&mut self, n: usize) {
        if self.0.capacity() - self.0.len() < n {
            self.0.reserve_exact(n.max(self.0.len() / 2));
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, PointTotals)> + '_ {
        self.entries()
            .map(|(p, at, len)| (p, PointTotals::unpack(&self.0[at..at + len])))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn varint_len(v: u64) -> usize {
    (64 - v.leading_zeros() as usize).div_ceil(7).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_counts_read_back_exactly() {
        let shapes: Vec<[u64; Counts::LEN]> = vec![
            [0u64; Counts::LEN],
            [u64::MAX; Counts::LEN],
            std::array::from_fn(|i| 1u64 << (i * 5)),
            std::array::from_fn(|i| (i as u64 * 0x0123_4567_89ab_cdef) ^ 0x7f),
            std::array::from_fn(|i| if i % 3 == 0 { 0 } else { 127 + i as u64 }),
        ];
        let mut table = PackedCounts::default();
        let mut want: std::collections::BTreeMap<u32, PointTotals> = Default::default();
        // Points arrive in any order, totals grow and shrink in packed length, and every
        // point reads back exactly after every change to any of them.
        let points = [7u32, 300, 0, 129, 70_000, 128, 5, u32::MAX];
        for round in 0..3 {
            for (k, &p) in points.iter().enumerate() {
                let t = PointTotals {
                    counts: Counts::from_values(shapes[(k + round) % shapes.len()]),
                    last_dscp: (k * 7) as u8,
                    last_pcp: 0xff,
                    last_ttl: round as u8,
                };
                table.set(p, &t);
                want.insert(p, t);
                assert_eq!(
                    table.iter().collect::<Vec<_>>(),
                    want.clone().into_iter().collect::<Vec<_>>()
                );
                for (q, t) in &want {
                    assert_eq!(table.get(*q), Some(*t), "point {q}");
                }
            }
        }
        assert_eq!(table.get(1), None);
        // A typical point: a million packets of 1,100 bytes, all ECT(0).
        let typical = PointTotals {
            counts: Counts {
                packets: 1_000_000,
                bytes: 1_100_000_000,
                ecn: [0, 0, 1_000_000, 0],
                ..Default::default()
            },
            ..Default::default()
        };
        let mut one = PackedCounts::default();
        one.set(3, &typical);
        assert!(one.0.len() <= 20, "{} bytes", one.0.len());
        assert_eq!(one.0.capacity(), one.0.len(), "no slack");
    }

    #[test]
    fn a_vec_map_keeps_key_order() {
        let mut m: VecMap<u32, u32> = VecMap::default();
        for k in [5, 1, 9, 3, 1] {
            *m.entry_or_default(k) += 1;
        }
        assert_eq!(
            m.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
            [(1, 2), (3, 1), (5, 1), (9, 1)]
        );
        m.insert(4, 7);
        assert_eq!(m.remove(&3), Some(1));
        assert_eq!(m.get(&4), Some(&7));
        assert_eq!(m.len(), 4);
    }
}

fn put_varint(out: &mut impl Extend<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.extend([b]);
            return;
        }
        out.extend([b | 0x80]);
    }
}

/// A few bytes being encoded, on the stack: packing a flow's state allocates nothing but
/// the state itself (temporary heap buffers between a flow's reallocations would leave
/// holes the allocator cannot give back).
struct Scratch<const N: usize> {
    b: [u8; N],
    n: usize,
}

impl<const N: usize> Scratch<N> {
    fn new() -> Self {
        Self { b: [0; N], n: 0 }
    }

    fn as_slice(&self) -> &[u8] {
        &self.b[..self.n]
    }

    fn len(&self) -> usize {
        self.n
    }
}

impl<const N: usize> Extend<u8> for Scratch<N> {
    fn extend<I: IntoIterator<Item = u8>>(&mut self, bytes: I) {
        for x in bytes {
            self.b[self.n] = x;
            self.n += 1;
        }
    }
}

/// A varint at `*i`, moving past it (0 past the end: never written so).
fn get_varint(b: &[u8], i: &mut usize) -> u64 {
    let (mut v, mut shift) = (0u64, 0);
    while let Some(&x) = b.get(*i) {
        *i += 1;
        v |= u64::from(x & 0x7f) << shift;
        shift += 7;
        if x & 0x80 == 0 || shift >= 64 {
            break;
        }
    }
    v
}

/// The bytes a flow delivered over its last counter intervals, oldest first, at most a
/// fixed number of them, exact to the nanosecond, the byte and the packet. Each interval
/// is packed as differences from the interval before, zigzag varints: its bytes always;
/// its start after the previous one's end (0 when they tile, as an agent's deltas do), its
/// length, its packets and its CE marks only when not 0, as a shape byte before them
/// says. A steady flow reported every second takes 2–4 bytes an interval instead of 40.
#[derive(Clone, Debug, Default)]
pub(crate) struct DeliveryLog {
    packed: Vec<u8>,
    /// The interval before the first one kept (all 0: none was dropped), and the last.
    base: crate::report::DeliveryAt,
    last: crate::report::DeliveryAt,
    len: u16,
}

fn zigzag(d: u64) -> u64 {
    let d = d as i64;
    ((d << 1) ^ (d >> 63)) as u64
}

fn unzigzag(z: u64) -> u64 {
    (((z >> 1) as i64) ^ -((z & 1) as i64)) as u64
}

impl DeliveryLog {
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }

    /// Appends an interval, dropping the oldest when `cap` are kept.
    pub(crate) fn push(&mut self, d: crate::report::DeliveryAt, cap: usize) {
        if usize::from(self.len) >= cap.min(usize::from(u16::MAX)) {
            self.drop_first();
        }
        let prev = self.last;
        let mut enc = Scratch::<51>::new();
        let len = d.end_ns.wrapping_sub(d.start_ns);
        let prev_len = prev.end_ns.wrapping_sub(prev.start_ns);
        // Each a difference from the interval before; the bytes always follow, the others
        // only when not 0, as the shape byte says (a steady flow: the shape and the bytes).
        let fields = [
            zigzag(d.start_ns.wrapping_sub(prev.end_ns)),
            zigzag(len.wrapping_sub(prev_len)),
            zigzag(d.packets.wrapping_sub(prev.packets)),
            zigzag(d.ce.wrapping_sub(prev.ce)),
        ];
        let shape = fields
            .iter()
            .enumerate()
            .fold(0u8, |m, (k, v)| m | (u8::from(*v != 0) << k));
        enc.extend([shape]);
        put_varint(&mut enc, zigzag(d.bytes.wrapping_sub(prev.bytes)));
        for v in fields.into_iter().filter(|v| *v != 0) {
            put_varint(&mut enc, v);
        }
        if self.packed.capacity() - self.packed.len() < enc.len() {
            // Past its first interval a flow is reported steadily: room for the whole log
            // of a steady flow (2–4 bytes an interval) at once, then doubling, so the
            // log is not moved a dozen times on its way to full.
            let steady = if self.len >= 1 {
                cap.min(usize::from(u16::MAX)) * 3 + 16
            } else {
                0
            };
            let more = enc.len().max(self.packed.len()).max(16);
            self.packed
                .reserve_exact(more.max(steady.saturating_sub(self.packed.len())));
        }
        self.packed.extend_from_slice(enc.as_slice());
        self.last = d;
        self.len += 1;
    }

    fn drop_first(&mut self) {
        let mut i = 0;
        let Some(first) = Self::next(&self.packed, &mut i, self.base) else {
            return;
        };
        self.packed.drain(..i);
        self.base = first;
        self.len -= 1;
    }

    fn next(b: &[u8], i: &mut usize, prev: crate::report::DeliveryAt) -> Option<crate::report::DeliveryAt> {
        if *i >= b.len() {
            return None;
        }
        let shape = b[*i];
        *i += 1;
        let bytes = prev.bytes.wrapping_add(unzigzag(get_varint(b, i)));
        let mut field = |k: u8| {
            if shape & (1 << k) != 0 {
                unzigzag(get_varint(b, i))
            } else {
                0
            }
        };
        let start_ns = prev.end_ns.wrapping_add(field(0));
        let prev_len = prev.end_ns.wrapping_sub(prev.start_ns);
        let end_ns = start_ns.wrapping_add(prev_len.wrapping_add(field(1)));
        let packets = prev.packets.wrapping_add(field(2));
        let ce = prev.ce.wrapping_add(field(3));
        Some(crate::report::DeliveryAt {
            start_ns,
            end_ns,
            bytes,
            packets,
            ce,
        })
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = crate::report::DeliveryAt> + '_ {
        let (mut i, mut prev) = (0, self.base);
        std::iter::from_fn(move || {
            let d = Self::next(&self.packed, &mut i, prev)?;
            prev = d;
            Some(d)
        })
    }
}

#[cfg(test)]
mod delivery_tests {
    use super::*;
    use crate::report::DeliveryAt;

    /// Intervals that tile, leave gaps, overlap and start at any time read back exactly,
    /// the oldest dropped past the bound.
    #[test]
    fn the_delivery_log_reads_back_exactly() {
        let mut log = DeliveryLog::default();
        let mut want = std::collections::VecDeque::new();
        let mut t = 1_764_000_000_000_000_000u64;
        for k in 0..200u64 {
            let start = match k % 5 {
                0 => t + 3_000_000_000,      // a gap (no change reported for a while)
                1 => t.saturating_sub(1000), // overlapping by a microsecond
                _ => t,                      // tiling
            };
            let d = DeliveryAt {
                start_ns: start,
                end_ns: start + 1_000_000_000 + k * 7,
                bytes: k * k * 1_000_003 + u64::from(k == 7) * u64::MAX / 2,
                packets: k * 1013 + u64::from(k == 9) * u64::MAX / 3,
                ce: (k % 3) * k,
            };
            t = d.end_ns;
            log.push(d, 64);
            want.push_back(d);
            if want.len() > 64 {
                want.pop_front();
            }
            assert_eq!(
                log.iter().collect::<Vec<_>>(),
                Vec::from(want.clone()),
                "after {k}"
            );
            assert_eq!(usize::from(log.len), want.len());
        }
        assert!(
            log.packed.len() < 64 * 16,
            "{} bytes for 64 intervals",
            log.packed.len()
        );
        // A steady flow, reported every second: a few bytes an interval.
        let mut steady = DeliveryLog::default();
        for k in 0..100u64 {
            steady.push(
                DeliveryAt {
                    start_ns: t + k * 1_000_000_000,
                    end_ns: t + (k + 1) * 1_000_000_000,
                    bytes: 132_000 + k % 2,
                    packets: 128 + k % 2,
                    ce: 0,
                },
                64,
            );
        }
        assert_eq!(steady.iter().count(), 64);
        assert_eq!(steady.iter().next().unwrap().start_ns, t + 36 * 1_000_000_000);
        assert!(
            steady.packed.len() <= 64 * 3 + 12,
            "{} bytes",
            steady.packed.len()
        );
        log.clear();
        assert_eq!(log.iter().count(), 0);
    }
}
