//! Builds the eBPF object with a pinned nightly (its LLVM must match bpf-linker's) and
//! embeds it in the roce-trace binary.
use aya_build::{Package, Toolchain};

/// Keep in step with scripts/setup.
const EBPF_TOOLCHAIN: &str = "nightly-2026-05-15";

fn main() -> anyhow::Result<()> {
    let root_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../roce-trace-ebpf");
    aya_build::build_ebpf(
        [Package {
            name: "roce-trace-ebpf",
            root_dir,
            ..Default::default()
        }],
        Toolchain::Custom(EBPF_TOOLCHAIN),
    )
}
