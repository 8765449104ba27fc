//! Helpers for roce-trace's privileged tests: the real eBPF object under
//! BPF_PROG_TEST_RUN, pcap files, tshark, and network namespaces.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use aya::programs::{TestRun, TestRunOptions};
use roce_trace::datapath::{Datapath, DatapathOptions, GlobalTotals};
use roce_trace_common::datapath::{FlowCounters, FlowKey, Sample};

/// Privileged tests need root (CAP_BPF, CAP_NET_ADMIN). They fail rather than pass
/// silently without it, unless ROCE_TRACE_SKIP_PRIVILEGED=1 says to skip them.
pub fn require_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var_os("ROCE_TRACE_SKIP_PRIVILEGED").is_some_and(|v| v == "1") {
        eprintln!("skipped: not root and ROCE_TRACE_SKIP_PRIVILEGED=1");
        return false;
    }
    panic!("this test needs root (CAP_BPF + CAP_NET_ADMIN); set ROCE_TRACE_SKIP_PRIVILEGED=1 to skip");
}

/// The real datapath object, run on byte buffers.
pub struct ProgTest {
    pub dp: Datapath,
    ring: aya::maps::RingBuf<aya::maps::MapData>,
}

pub const XDP_PASS: u32 = 2;
/// TC_ACT_UNSPEC (-1) as the u32 the kernel returns.
pub const TC_ACT_UNSPEC: u32 = u32::MAX;

impl ProgTest {
    pub fn new(opts: &DatapathOptions) -> Self {
        let mut dp = Datapath::load(opts).expect("load datapath");
        dp.xdp().expect("xdp verifies");
        dp.tc().expect("tc verifies");
        let ring = dp.take_samples().expect("ring");
        Self { dp, ring }
    }

    /// Runs the XDP program once on `frame`; returns its verdict.
    pub fn run_xdp(&mut self, frame: &[u8]) -> u32 {
        let mut out = vec![0u8; frame.len() + 256];
        let prog = self.dp.xdp().unwrap();
        let r = prog
            .test_run(TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), ..TestRunOptions::new() })
            .expect("xdp test run");
        assert_eq!(&out[..r.data_size_out as usize], frame, "XDP must not modify the packet");
        r.return_value
    }

    /// Runs the TC program once on `frame`; returns its verdict.
    pub fn run_tc(&mut self, frame: &[u8]) -> u32 {
        let mut out = vec![0u8; frame.len() + 256];
        let prog = self.dp.tc().unwrap();
        let r = prog
            .test_run(TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), ..TestRunOptions::new() })
            .expect("tc test run");
        assert_eq!(&out[..r.data_size_out as usize], frame, "TC must not modify the packet");
        r.return_value
    }

    /// Runs `repeat` iterations in the kernel; returns the mean time per packet.
    pub fn time_xdp(&mut self, frame: &[u8], repeat: u32) -> std::time::Duration {
        let prog = self.dp.xdp().unwrap();
        let r = prog
            .test_run(TestRunOptions { data_in: Some(frame), repeat, ..TestRunOptions::new() })
            .expect("xdp test run");
        r.duration
    }

    pub fn samples(&mut self) -> Vec<Sample> {
        let mut v = Vec::new();
        while let Some(item) = self.ring.next() {
            assert_eq!(item.len(), std::mem::size_of::<Sample>());
            // SAFETY: a whole Sample, size checked above.
            v.push(unsafe { std::ptr::read_unaligned(item.as_ptr() as *const Sample) });
        }
        v
    }

    pub fn flows(&self) -> Vec<(FlowKey, FlowCounters)> {
        let mut v: Vec<_> = self.dp.flows().unwrap().into_iter().collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    pub fn globals(&self) -> GlobalTotals {
        self.dp.globals().unwrap()
    }
}

/// Writes Ethernet frames to a classic pcap file.
pub fn write_pcap(path: &Path, frames: &[Vec<u8>]) {
    use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
    let f = std::fs::File::create(path).unwrap();
    let mut w = PcapWriter::with_header(f, PcapHeader { snaplen: 65535, ..Default::default() }).unwrap();
    for (i, fr) in frames.iter().enumerate() {
        let ts = std::time::Duration::from_millis(i as u64);
        w.write_packet(&PcapPacket::new(ts, fr.len() as u32, fr)).unwrap();
    }
}

/// Reads the Ethernet frames of a pcap file.
pub fn read_pcap(path: &Path) -> Vec<Vec<u8>> {
    use pcap_file::pcap::PcapReader;
    let f = std::fs::File::open(path).unwrap();
    let mut r = PcapReader::new(f).unwrap();
    let mut v = Vec::new();
    while let Some(p) = r.next_packet() {
        v.push(p.unwrap().data.into_owned());
    }
    v
}

/// tshark's decoding of `pcap` as RoCEv2 on UDP 4791: one row per frame, one column per
/// field (multiple occurrences joined by ',').
pub fn tshark_fields(pcap: &Path, fields: &[&str]) -> Vec<Vec<String>> {
    let mut cmd = Command::new("tshark");
    cmd.args(["-r"]).arg(pcap).args([
        "-d",
        "udp.port==4791,infiniband",
        "--disable-protocol",
        "tftp",
        "-T",
        "fields",
        "-E",
        "separator=/t",
        "-E",
        "occurrence=f",
    ]);
    for f in fields {
        cmd.args(["-e", f]);
    }
    let out = cmd.output().expect("tshark is installed (scripts/setup)");
    assert!(out.status.success(), "tshark failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split('\t').map(str::to_owned).collect())
        .collect()
}

/// A scratch directory under target/, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("roce-trace-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
    pub fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `../shared` beside the repository, when present (CI has it; a bare clone may not).
pub fn shared_dir() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared");
    p.is_dir().then(|| p.canonicalize().unwrap())
}

/// Runs a command, panicking with its output when it fails.
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
