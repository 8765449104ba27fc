//! Builds the eBPF object with a pinned nightly (its LLVM must match bpf-linker's) and
//! embeds it in roce-trace-datapath (and so in the roce-trace binary).
//!
//! `ROCE_TRACE_EBPF_OBJECT=PATH` embeds an object built before instead (another build of
//! this crate made it, e.g. the main workspace's for the fuzz harnesses: scripts/fuzz),
//! sparing a second eBPF build.
use aya_build::{Package, Toolchain};

/// Keep in step with scripts/setup.
const EBPF_TOOLCHAIN: &str = "nightly-2026-05-15";
/// What `EBPF_OBJECT` in src/loader.rs includes from OUT_DIR.
const OBJECT: &str = "roce-trace";

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=ROCE_TRACE_EBPF_OBJECT");
    if let Some(prebuilt) = std::env::var_os("ROCE_TRACE_EBPF_OBJECT") {
        let out =
            std::path::Path::new(&std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join(OBJECT);
        println!("cargo:rerun-if-changed={}", prebuilt.display());
        std::fs::copy(&prebuilt, &out)
            .map_err(|e| anyhow::anyhow!("ROCE_TRACE_EBPF_OBJECT={}: {e}", prebuilt.display()))?;
        return Ok(());
    }
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
