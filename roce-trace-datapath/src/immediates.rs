//! Writes load-time configuration into the eBPF object's instructions
//! (`roce_trace_common::datapath::imm`): each marker a program loads with `lddw` becomes
//! the configured value before the kernel sees the code. Cilium's loader specialises its
//! programs the same way; here it spares the common packet a map's cache line.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ImmediateError {
    #[error("not a 64-bit little-endian ELF object")]
    NotElf,
    #[error("the object's section headers lie outside it")]
    Truncated,
    #[error(
        "the object's code holds {found} of the {wanted} load-time immediates (each marker at least once, or none in an object built before them)"
    )]
    Partial { found: usize, wanted: usize },
}

/// An object's bytes with the 8-byte alignment the ELF parser wants.
pub struct AlignedObject {
    words: Vec<u64>,
    len: usize,
}

impl AlignedObject {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes; u8 has no alignment.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// BPF_LD | BPF_IMM | BPF_DW: a 64-bit immediate in two instruction slots.
const LDDW: u8 = 0x18;
const SHT_PROGBITS: u32 = 1;
const SHF_EXECINSTR: u64 = 4;

/// `object` with every `(marker, value)` of `imms` written over the marker's `lddw`s in
/// its code sections, and how many instructions were written. Every marker must be found
/// at least once; an object without any (built before them: `bench datapath --baseline`)
/// is returned as it is, with 0.
pub fn write_immediates(
    object: &[u8],
    imms: &[(u64, u64)],
) -> Result<(AlignedObject, usize), ImmediateError> {
    let mut out = AlignedObject {
        words: vec![0u64; object.len().div_ceil(8)],
        len: object.len(),
    };
    out.bytes_mut().copy_from_slice(object);
    let sections = code_sections(object)?;
    let mut found = vec![0usize; imms.len()];
    let b = out.bytes_mut();
    for (start, end) in sections {
        let mut at = start;
        while at + 16 <= end {
            if b[at] != LDDW {
                at += 8;
                continue;
            }
            // A plain constant has no source register (a map's address has one).
            let lo = u32::from_le_bytes(b[at + 4..at + 8].try_into().expect("4 bytes"));
            let hi = u32::from_le_bytes(b[at + 12..at + 16].try_into().expect("4 bytes"));
            let v = u64::from(hi) << 32 | u64::from(lo);
            if b[at + 1] >> 4 == 0
                && let Some(i) = imms.iter().position(|&(mark, _)| mark == v)
            {
                let value = imms[i].1;
                b[at + 4..at + 8].copy_from_slice(&(value as u32).to_le_bytes());
                b[at + 12..at + 16].copy_from_slice(&((value >> 32) as u32).to_le_bytes());
                found[i] += 1;
            }
            at += 16;
        }
    }
    let markers = found.iter().filter(|&&n| n > 0).count();
    if markers != 0 && markers != imms.len() {
        return Err(ImmediateError::Partial {
            found: markers,
            wanted: imms.len(),
        });
    }
    Ok((out, found.iter().sum()))
}

/// The byte ranges of the object's code sections (PROGBITS, executable).
fn code_sections(o: &[u8]) -> Result<Vec<(usize, usize)>, ImmediateError> {
    if o.len() < 64 || &o[..4] != b"\x7fELF" || o[4] != 2 || o[5] != 1 {
        return Err(ImmediateError::NotElf);
    }
    let u16_at = |at: usize| u16::from_le_bytes([o[at], o[at + 1]]) as usize;
    let shoff = read_u64(o, 0x28).ok_or(ImmediateError::Truncated)? as usize;
    let (shentsize, shnum) = (u16_at(0x3a), u16_at(0x3c));
    if shentsize < 64 {
        return Err(ImmediateError::Truncated);
    }
    let mut v = Vec::new();
    for i in 0..shnum {
        let sh = i
            .checked_mul(shentsize)
            .and_then(|x| x.checked_add(shoff))
            .and_then(|h| o.get(h..h.checked_add(64)?))
            .ok_or(ImmediateError::Truncated)?;
        let kind = u32::from_le_bytes(sh[4..8].try_into().expect("4 bytes"));
        let flags = read_u64(sh, 8).ok_or(ImmediateError::Truncated)?;
        if kind != SHT_PROGBITS || flags & SHF_EXECINSTR == 0 {
            continue;
        }
        let off = read_u64(sh, 0x18).ok_or(ImmediateError::Truncated)? as usize;
        let size = read_u64(sh, 0x20).ok_or(ImmediateError::Truncated)? as usize;
        let end = off
            .checked_add(size)
            .filter(|&e| e <= o.len())
            .ok_or(ImmediateError::Truncated)?;
        v.push((off, end));
    }
    Ok(v)
}

fn read_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 with one code section holding `code` (and a data section holding
    /// `data`, which is never patched).
    fn elf(code: &[u8], data: &[u8]) -> Vec<u8> {
        let mut o = vec![0u8; 64];
        o[..6].copy_from_slice(b"\x7fELF\x02\x01");
        let code_off = o.len();
        o.extend_from_slice(code);
        let data_off = o.len();
        o.extend_from_slice(data);
        while !o.len().is_multiple_of(8) {
            o.push(0);
        }
        let shoff = o.len();
        // Null section, code, data.
        o.extend_from_slice(&[0u8; 64]);
        for (kind, flags, off, size) in [
            (SHT_PROGBITS, 6u64, code_off, code.len()),
            (SHT_PROGBITS, 3u64, data_off, data.len()),
        ] {
            let mut sh = [0u8; 64];
            sh[4..8].copy_from_slice(&kind.to_le_bytes());
            sh[8..16].copy_from_slice(&flags.to_le_bytes());
            sh[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            sh[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            o.extend_from_slice(&sh);
        }
        o[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        o[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        o[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        o
    }

    fn lddw(dst: u8, src: u8, v: u64) -> [u8; 16] {
        let mut i = [0u8; 16];
        i[0] = LDDW;
        i[1] = src << 4 | dst;
        i[4..8].copy_from_slice(&(v as u32).to_le_bytes());
        i[12..16].copy_from_slice(&((v >> 32) as u32).to_le_bytes());
        i
    }

    const A: u64 = 0x5254_494d_4d5f_0001;
    const B: u64 = 0x5254_494d_4d5f_0002;

    #[test]
    fn every_marker_in_code_is_written_and_nothing_else() {
        let mut code = Vec::new();
        code.extend_from_slice(&lddw(1, 0, A));
        // A map address with the marker's bits: a source register, so not a constant.
        code.extend_from_slice(&lddw(2, 1, A));
        code.extend_from_slice(&lddw(3, 0, B));
        code.extend_from_slice(&lddw(4, 0, A));
        // `r0 = 0; exit`.
        code.extend_from_slice(&[0xb7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0]);
        let data = lddw(5, 0, A);
        let o = elf(&code, &data);
        let (out, n) = write_immediates(&o, &[(A, 0xdead_beef_0000_12b7), (B, 11)]).unwrap();
        assert_eq!(n, 3);
        let b = out.bytes();
        let code_at = 64;
        assert_eq!(&b[code_at..code_at + 16], &lddw(1, 0, 0xdead_beef_0000_12b7));
        assert_eq!(
            &b[code_at + 16..code_at + 32],
            &lddw(2, 1, A),
            "a map's address stays"
        );
        assert_eq!(&b[code_at + 32..code_at + 48], &lddw(3, 0, 11));
        assert_eq!(&b[code_at + 48..code_at + 64], &lddw(4, 0, 0xdead_beef_0000_12b7));
        assert_eq!(&b[code_at + 64..code_at + 80], &code[64..80]);
        assert_eq!(&b[code_at + 80..code_at + 96], &data, "data sections stay");
        assert_eq!(b.len(), o.len());
        assert_eq!(b.as_ptr() as usize % 8, 0);
    }

    #[test]
    fn an_object_without_markers_loads_as_it_is_and_a_partial_one_is_refused() {
        let code = lddw(1, 0, 42);
        let o = elf(&code, &[]);
        let (out, n) = write_immediates(&o, &[(A, 1), (B, 2)]).unwrap();
        assert_eq!((n, out.bytes()), (0, &o[..]));
        let o = elf(&lddw(1, 0, A), &[]);
        assert_eq!(
            write_immediates(&o, &[(A, 1), (B, 2)]).err(),
            Some(ImmediateError::Partial { found: 1, wanted: 2 })
        );
    }

    #[test]
    fn broken_objects_are_refused_not_read_past() {
        assert_eq!(
            write_immediates(b"not an elf", &[]).err(),
            Some(ImmediateError::NotElf)
        );
        let mut o = elf(&lddw(1, 0, A), &[]);
        // Section headers past the end.
        o[0x28..0x30].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert_eq!(
            write_immediates(&o, &[(A, 1)]).err(),
            Some(ImmediateError::Truncated)
        );
        let mut o = elf(&lddw(1, 0, A), &[]);
        // A code section running past the end.
        let shoff = u64::from_le_bytes(o[0x28..0x30].try_into().unwrap()) as usize;
        o[shoff + 64 + 0x20..shoff + 64 + 0x28].copy_from_slice(&(1u64 << 20).to_le_bytes());
        assert_eq!(
            write_immediates(&o, &[(A, 1)]).err(),
            Some(ImmediateError::Truncated)
        );
    }
}
