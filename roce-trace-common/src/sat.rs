//! Sums of counts that stop at the maximum instead of wrapping (or panicking in a debug
//! build): what an agent reports is not trusted to be small, and one absurd count must not
//! crash the collector or the judge, nor wrap into a small number.

pub trait SaturatingSum {
    fn saturating_sum(self) -> u64;
}

impl<I: Iterator<Item = u64>> SaturatingSum for I {
    #[inline]
    fn saturating_sum(self) -> u64 {
        self.fold(0, u64::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_stop_at_the_maximum() {
        assert_eq!([1u64, 2, 3].into_iter().saturating_sum(), 6);
        assert_eq!([u64::MAX, 1, u64::MAX].into_iter().saturating_sum(), u64::MAX);
        assert_eq!(core::iter::empty::<u64>().saturating_sum(), 0);
    }
}
