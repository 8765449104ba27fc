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
#[derive(Clone, Debug)]
pub(crate) struct VecMap<K, V>(Vec<(K, V)>);

impl<K, V> Default for VecMap<K, V> {
    fn default() -> Self {
        Self(Vec::new())
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
                if self.0.len() == self.0.capacity() {
                    self.0.reserve_exact(1);
                }
                self.0.insert(i, (k, make()));
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
            Err(i) => {
                if self.0.len() == self.0.capacity() {
                    self.0.reserve_exact(1);
                }
                self.0.insert(i, (k, v));
            }
        }
    }

    pub(crate) fn remove(&mut self, k: &K) -> Option<V> {
        self.find(k).ok().map(|i| self.0.remove(i).1)
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

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One point's running counters of a flow as LEB128 varints (13 values, then the last
/// DSCP, PCP and TTL): 20–30 bytes for a typical flow instead of 107. Exact: every value
/// reads back as written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PackedCounts(Box<[u8]>);

/// A point's running totals, unpacked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PointTotals {
    pub(crate) counts: Counts,
    pub(crate) last_dscp: u8,
    pub(crate) last_pcp: u8,
    pub(crate) last_ttl: u8,
}

impl PackedCounts {
    pub(crate) fn pack(t: &PointTotals) -> Self {
        let mut out = Vec::with_capacity(32);
        for &v in t.counts.values() {
            put_varint(&mut out, v);
        }
        out.extend([t.last_dscp, t.last_pcp, t.last_ttl]);
        Self(out.into_boxed_slice())
    }

    pub(crate) fn unpack(&self) -> PointTotals {
        let mut i = 0;
        let vals: [u64; Counts::LEN] = std::array::from_fn(|_| get_varint(&self.0, &mut i));
        let last = |k: usize| self.0.get(i + k).copied().unwrap_or(0);
        PointTotals {
            counts: Counts::from_values(vals),
            last_dscp: last(0),
            last_pcp: last(1),
            last_ttl: last(2),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_counts_read_back_exactly() {
        for vals in [
            [0u64; Counts::LEN],
            [u64::MAX; Counts::LEN],
            std::array::from_fn(|i| 1u64 << (i * 5)),
            std::array::from_fn(|i| (i as u64 * 0x0123_4567_89ab_cdef) ^ 0x7f),
        ] {
            let t = PointTotals {
                counts: Counts::from_values(vals),
                last_dscp: 46,
                last_pcp: 0xff,
                last_ttl: 1,
            };
            assert_eq!(PackedCounts::pack(&t).unpack(), t);
        }
        let typical = PointTotals {
            counts: Counts {
                packets: 1_000_000,
                bytes: 1_100_000_000,
                ecn: [0, 0, 1_000_000, 0],
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(PackedCounts::pack(&typical).0.len() <= 24);
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

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
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
/// fixed number of them, exact to the nanosecond and the byte. Each interval is packed as
/// three varints: its start after the previous interval's end (zigzag: 0 when they tile,
/// as an agent's deltas do), its length and its bytes — about 10 bytes instead of 24.
#[derive(Clone, Debug, Default)]
pub(crate) struct DeliveryLog {
    packed: Vec<u8>,
    /// The end of the interval before the first one kept (0: none was dropped), and of
    /// the last one.
    base_end_ns: u64,
    last_end_ns: u64,
    len: u16,
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
        let gap = d.start_ns.wrapping_sub(self.last_end_ns) as i64;
        let mut enc = Vec::with_capacity(30);
        put_varint(&mut enc, ((gap << 1) ^ (gap >> 63)) as u64);
        put_varint(&mut enc, d.end_ns.wrapping_sub(d.start_ns));
        put_varint(&mut enc, d.bytes);
        if self.packed.capacity() - self.packed.len() < enc.len() {
            self.packed.reserve_exact(enc.len().max(32));
        }
        self.packed.extend_from_slice(&enc);
        self.last_end_ns = d.end_ns;
        self.len += 1;
    }

    fn drop_first(&mut self) {
        let mut i = 0;
        let Some(first) = Self::next(&self.packed, &mut i, self.base_end_ns) else {
            return;
        };
        self.packed.drain(..i);
        self.base_end_ns = first.end_ns;
        self.len -= 1;
    }

    fn next(b: &[u8], i: &mut usize, prev_end: u64) -> Option<crate::report::DeliveryAt> {
        if *i >= b.len() {
            return None;
        }
        let z = get_varint(b, i);
        let gap = ((z >> 1) as i64) ^ -((z & 1) as i64);
        let start_ns = prev_end.wrapping_add(gap as u64);
        let end_ns = start_ns.wrapping_add(get_varint(b, i));
        let bytes = get_varint(b, i);
        Some(crate::report::DeliveryAt {
            start_ns,
            end_ns,
            bytes,
        })
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = crate::report::DeliveryAt> + '_ {
        let (mut i, mut prev) = (0, self.base_end_ns);
        std::iter::from_fn(move || {
            let d = Self::next(&self.packed, &mut i, prev)?;
            prev = d.end_ns;
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
        log.clear();
        assert_eq!(log.iter().count(), 0);
    }
}
