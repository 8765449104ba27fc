//! The datapath's mmapable arrays (`FLOW_SLOTS`, `GLOBALS`) read in place: mapped once,
//! read without a system call or a copy of the whole table each interval.

use std::{
    io,
    marker::PhantomData,
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
};

use aya::maps::MapData;

/// `BPF_F_MMAPABLE` (include/uapi/linux/bpf.h).
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// A read-only shared mapping of an array map created with `BPF_F_MMAPABLE`, holding
/// `len` elements of `T`. The programs write the elements while they are read: a reader
/// copies one element at a time with a volatile read, exactly what the map's lookup
/// (`bpf_obj_memcpy`, no lock) gave it before.
pub struct MappedArray<T> {
    base: NonNull<u8>,
    bytes: usize,
    len: usize,
    stride: usize,
    _t: PhantomData<T>,
}

// SAFETY: the mapping is read-only and only read through volatile copies; it may move to
// and be read from any thread.
unsafe impl<T> Send for MappedArray<T> {}
// SAFETY: as above: `&self` gives nothing but copies.
unsafe impl<T> Sync for MappedArray<T> {}

impl<T: aya::Pod> MappedArray<T> {
    /// Maps every element of `map`, whose values must be exactly a `T` each.
    pub fn new(map: &MapData) -> io::Result<Self> {
        let info = map.info().map_err(io::Error::other)?;
        if info.value_size() as usize != size_of::<T>() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "values of {} bytes, {} expected",
                    info.value_size(),
                    size_of::<T>()
                ),
            ));
        }
        if align_of::<T>() > 8 {
            return Err(io::Error::other("elements aligned past 8 bytes"));
        }
        if info.map_flags() & BPF_F_MMAPABLE == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the map is not mmapable",
            ));
        }
        let len = info.max_entries() as usize;
        // The kernel's element stride: the value size rounded up to 8.
        let stride = size_of::<T>().next_multiple_of(8);
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let bytes = (len * stride).next_multiple_of(page);
        // SAFETY: a new shared, read-only mapping of the map's values (the kernel checks the
        // length against the map); nothing else is at the address it returns.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self {
            base,
            bytes,
            len,
            stride,
            _t: PhantomData,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A pointer to element `i`, or `None` past the end. Read it only with volatile reads.
    pub fn ptr(&self, i: usize) -> Option<*const T> {
        // SAFETY: inside the mapping (i < len, len * stride <= bytes).
        (i < self.len).then(|| {
            unsafe { self.base.as_ptr().add(i * self.stride) }
                .cast::<T>()
                .cast_const()
        })
    }

    /// A copy of element `i` as it is now.
    pub fn get(&self, i: usize) -> Option<T> {
        // SAFETY: a valid element of the mapping, aligned (a page-aligned base, a stride
        // that is a multiple of 8, and T's alignment at most 8: every map value type is
        // u64s and bytes); any bytes are a valid T (Pod).
        self.ptr(i).map(|p| unsafe { p.read_volatile() })
    }
}

impl<T> Drop for MappedArray<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}
