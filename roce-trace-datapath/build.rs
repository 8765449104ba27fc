//! Builds the eBPF object with the eBPF crate's pinned nightly (its LLVM must match
//! bpf-linker's; `roce-trace-ebpf/rust-toolchain.toml` names it) and embeds it in
//! roce-trace-datapath, and so in the roce-trace binary. Quiet when it works: the nested
//! cargo's output is shown only when the eBPF build fails.
//!
//! `ROCE_TRACE_EBPF_OBJECT=PATH` embeds an object built before instead (another build of
//! this crate made it, e.g. the main workspace's for the fuzz harnesses: scripts/fuzz),
//! sparing a second eBPF build.

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
};

/// What `EBPF_OBJECT` in src/loader.rs includes from OUT_DIR (the eBPF crate's binary).
const OBJECT: &str = "roce-trace";
const EBPF_CRATE: &str = "roce-trace-ebpf";

mod toolchain;
use toolchain::channel;

fn main() -> Result<(), String> {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-env-changed=ROCE_TRACE_EBPF_OBJECT");
    if let Some(prebuilt) = std::env::var_os("ROCE_TRACE_EBPF_OBJECT") {
        println!("cargo:rerun-if-changed={}", Path::new(&prebuilt).display());
        std::fs::copy(&prebuilt, out.join(OBJECT))
            .map_err(|e| format!("ROCE_TRACE_EBPF_OBJECT={}: {e}", Path::new(&prebuilt).display()))?;
        return Ok(());
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(EBPF_CRATE);
    let toolchain_file = root.join("rust-toolchain.toml");
    let text =
        std::fs::read_to_string(&toolchain_file).map_err(|e| format!("{}: {e}", toolchain_file.display()))?;
    let toolchain = channel(&text).ok_or_else(|| format!("{}: no channel", toolchain_file.display()))?;
    // Cargo rebuilds us when the eBPF crate's library changes (a build-dependency); its
    // binary and the toolchain pin need saying.
    println!("cargo:rerun-if-changed={}", root.display());
    let target_dir = out.join("ebpf-target");
    // BPF v3 (Linux 5.1): 32-bit ALU and jumps. The identity hash and the parser's u32 and
    // u16 arithmetic were 64-bit operations with masks around them: the programs are 10 %
    // shorter (JIT bytes) with it.
    let mut flags = OsString::from("--cfg=bpf_target_arch=\"x86_64\"");
    for f in [
        "-Cdebuginfo=2",
        "-Clink-arg=--btf",
        "-Ctarget-feature=+allows-misaligned-mem-access",
        "-Ctarget-cpu=v3",
    ] {
        flags.push("\x1f");
        flags.push(f);
    }
    let mut cmd = Command::new("rustup");
    cmd.args([
        "run",
        toolchain,
        "cargo",
        "build",
        "--package",
        EBPF_CRATE,
        "--bins",
        "--release",
    ])
    .args([
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--target-dir",
    ])
    .arg(&target_dir)
    .current_dir(&root)
    .env("CARGO_ENCODED_RUSTFLAGS", flags);
    // The outer build's compiler is not the pinned nightly.
    for key in [
        "RUSTC",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_TARGET_DIR",
    ] {
        cmd.env_remove(key);
    }
    let run = cmd.output().map_err(|e| {
        format!("running rustup for the eBPF build ({toolchain}; scripts/setup installs it): {e}")
    })?;
    if !run.status.success() {
        for line in String::from_utf8_lossy(&run.stderr).lines() {
            println!("cargo:warning={line}");
        }
        return Err(format!(
            "building {EBPF_CRATE} with {toolchain} failed ({}): its output is above",
            run.status
        ));
    }
    let built = target_dir.join("bpfel-unknown-none/release").join(OBJECT);
    std::fs::copy(&built, out.join(OBJECT)).map_err(|e| format!("{}: {e}", built.display()))?;
    Ok(())
}
