//! The eBPF crate's pinned nightly: the `channel` of `roce-trace-ebpf/rust-toolchain.toml`
//! (its LLVM must match bpf-linker's). Read by both build paths — this crate's build.rs and
//! `cargo xtask` (lint, setup checks) — through this one file.

/// The `channel` of a rust-toolchain.toml.
pub fn channel(toolchain_toml: &str) -> Option<&str> {
    toolchain_toml.lines().find_map(|l| {
        let v = l.trim().strip_prefix("channel")?.trim_start().strip_prefix('=')?;
        Some(v.trim().trim_matches('"'))
    })
}
