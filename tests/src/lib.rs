//! Helpers for roce-trace's privileged tests: the real eBPF object under
//! BPF_PROG_TEST_RUN, pcap files, tshark, network namespaces, and the virtual leaf-spine
//! fabric ([`lab`]).

pub mod lab;
pub mod promql;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use aya::programs::{TestRun, TestRunOptions};
use roce_trace_common::datapath::{
    FlowCounters, FlowKey, FlowSlotChunk, MAP_FLOW_SLOTS, MAP_FLOWS, MirrorInfo, PROG_TC, PROG_TC_INGRESS,
    SLOTS_PER_CHUNK, Sample, slot_place,
};
use roce_trace_datapath::loader::{Datapath, DatapathOptions, GlobalTotals};

/// Whether this is CI (`CI=true`, as GitHub Actions, GitLab and most others set it): there
/// every test must run.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// A test that cannot run here, for `reason`: under CI (`CI=true`) that fails it (panics);
/// elsewhere it prints `skipped: REASON` and returns true, and the caller returns:
/// `let Some(x) = … else { cannot_run("…"); return; };`.
pub fn cannot_run(reason: &str) -> bool {
    assert!(
        !in_ci(),
        "this test cannot run here, and under CI=true that is a failure: {reason}"
    );
    eprintln!("skipped: {reason}");
    true
}

/// Privileged tests need root (CAP_BPF, CAP_NET_ADMIN). They fail rather than pass
/// silently without it, unless ROCE_TRACE_SKIP_PRIVILEGED=1 says to skip them — and even
/// then under CI (see [`cannot_run`]).
pub fn require_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var_os("ROCE_TRACE_SKIP_PRIVILEGED").is_some_and(|v| v == "1") {
        cannot_run("not root and ROCE_TRACE_SKIP_PRIVILEGED=1");
        return false;
    }
    panic!("this test needs root (CAP_BPF + CAP_NET_ADMIN); set ROCE_TRACE_SKIP_PRIVILEGED=1 to skip");
}

/// A process a test started, killed (SIGKILL) and reaped when dropped unless it was waited
/// for: a test that fails half-way leaves nothing running to disturb the next one. Derefs
/// to its [`Child`](std::process::Child). Started through `ip netns exec`, the process is
/// the program itself (`ip` execs it), so signals reach the program.
pub struct Proc {
    child: Option<std::process::Child>,
    /// Spawned as the leader of its own process group, which the drop kills whole (a shell
    /// pipeline).
    group: bool,
}

impl Proc {
    /// Spawns `cmd`, panicking with the program's name when it cannot.
    pub fn spawn(cmd: &mut Command) -> Self {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {:?}: {e}", cmd.get_program()));
        Self {
            child: Some(child),
            group: false,
        }
    }

    /// Spawns `cmd` in a process group of its own: the drop kills every process in it
    /// (a shell and its pipeline), not only the shell.
    pub fn spawn_group(cmd: &mut Command) -> Self {
        use std::os::unix::process::CommandExt;
        let mut p = Self::spawn(cmd.process_group(0));
        p.group = true;
        p
    }

    /// Waits for it, collecting what is left of its stdout and stderr.
    pub fn wait_with_output(mut self) -> std::process::Output {
        self.child
            .take()
            .expect("running")
            .wait_with_output()
            .expect("waiting for a child")
    }

    /// SIGINT (what Ctrl-C sends), then waits for it.
    pub fn interrupt(mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGINT);
        self.wait().expect("waiting for a child")
    }

    /// Sends `sig` to the process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child, not yet reaped (self holds it).
        unsafe { libc::kill(self.id() as i32, sig) };
    }
}

impl std::ops::Deref for Proc {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        self.child.as_ref().expect("running")
    }
}

impl std::ops::DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.child.as_mut().expect("running")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let Some(mut c) = self.child.take() else { return };
        if self.group {
            // The group outlives its leader while any member lives: killed whole even
            // when the leader has exited.
            // SAFETY: signalling the process group we created.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
        }
        // No signal once reaped: std remembers the exit and never kills a reused pid.
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The real datapath object, run on byte buffers.
pub struct ProgTest {
    pub dp: Datapath,
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    /// The programs' maps, by kernel id (to read one map apart from the others).
    map_ids: Vec<u32>,
}

pub const XDP_PASS: u32 = 2;
/// TC_ACT_UNSPEC (-1) as the u32 the kernel returns.
pub const TC_ACT_UNSPEC: u32 = u32::MAX;

impl ProgTest {
    pub fn new(opts: &DatapathOptions) -> Self {
        Self::with(Datapath::load(opts).expect("load datapath"))
    }

    /// Another build's object (a benchmark's baseline).
    pub fn with_object(opts: &DatapathOptions, object: &[u8]) -> Self {
        Self::with(Datapath::load_object(opts, object).expect("load the baseline datapath"))
    }

    fn with(mut dp: Datapath) -> Self {
        dp.xdp().expect("xdp verifies");
        dp.tc(PROG_TC).expect("tc egress verifies");
        dp.tc(PROG_TC_INGRESS).expect("tc ingress verifies");
        let ring = dp.take_samples().expect("ring");
        let map_ids = dp
            .xdp()
            .unwrap()
            .info()
            .expect("program info")
            .map_ids()
            .expect("map ids")
            .expect("the kernel names a program's maps");
        Self { dp, ring, map_ids }
    }

    /// One of the programs' maps, by name.
    pub fn map(&self, name: &str) -> aya::maps::Map {
        for &id in &self.map_ids {
            let data = aya::maps::MapData::from_id(id).expect("map by id");
            if data.info().expect("map info").name_as_str() == Some(name) {
                return aya::maps::Map::from_map_data(data).expect("map");
            }
        }
        panic!("the programs have no map {name}");
    }

    /// CPU `cpu`'s flow table (`FLOW_SLOTS`): each slot that holds a flow, with the flow's
    /// counters there.
    pub fn slot_table(&self, cpu: usize) -> Vec<(u32, FlowKey, FlowCounters)> {
        let map: aya::maps::Array<_, FlowSlotChunk> =
            aya::maps::Array::try_from(self.map(MAP_FLOW_SLOTS)).unwrap();
        let per_cpu = map.len() / roce_trace_datapath::sys::cpu_id_count().unwrap() as u32;
        // Every slot the chunks hold (the table may use fewer), placed as the kernel does.
        let slot_bits = (per_cpu * SLOTS_PER_CHUNK).trailing_zeros();
        let mut v = Vec::new();
        let mut chunk: Option<(u32, FlowSlotChunk)> = None;
        for i in 0..per_cpu * SLOTS_PER_CHUNK {
            let (c, entry) = slot_place(cpu as u32, i, slot_bits);
            if chunk.as_ref().is_none_or(|(n, _)| *n != c) {
                chunk = Some((c, map.get(&c, 0).unwrap()));
            }
            let slot = &chunk.as_ref().unwrap().1[entry as usize];
            if slot.counters.counts.packets != 0 {
                v.push((i, slot.key, slot.counters));
            }
        }
        v
    }

    /// CPU `cpu`'s copies in `FLOWS` (the LRU hash of flows without a slot), by key;
    /// copies without packets left out.
    pub fn flows_map(&self, cpu: usize) -> Vec<(FlowKey, FlowCounters)> {
        let map: aya::maps::PerCpuHashMap<_, FlowKey, FlowCounters> =
            aya::maps::PerCpuHashMap::try_from(self.map(MAP_FLOWS)).unwrap();
        let mut v: Vec<_> = map
            .iter()
            .map(|r| r.unwrap())
            .filter(|(_, c)| c[cpu].counts.packets != 0)
            .map(|(k, c)| (k, c[cpu]))
            .collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Runs the XDP program once on `frame`; returns its verdict.
    pub fn run_xdp(&mut self, frame: &[u8]) -> u32 {
        let mut out = vec![0u8; frame.len() + 256];
        let prog = self.dp.xdp().unwrap();
        let r = prog
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ..TestRunOptions::new()
            })
            .expect("xdp test run");
        assert_eq!(
            &out[..r.data_size_out as usize],
            frame,
            "XDP must not modify the packet"
        );
        r.return_value
    }

    /// Runs the TC egress program once on `frame`; returns its verdict.
    pub fn run_tc(&mut self, frame: &[u8]) -> u32 {
        self.run_classifier(PROG_TC, frame)
    }

    /// Runs the TC ingress program once on `frame`; returns its verdict.
    pub fn run_tc_in(&mut self, frame: &[u8]) -> u32 {
        self.run_classifier(PROG_TC_INGRESS, frame)
    }

    fn run_classifier(&mut self, name: &'static str, frame: &[u8]) -> u32 {
        let mut out = vec![0u8; frame.len() + 256];
        let prog = self.dp.tc(name).unwrap();
        let r = prog
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ..TestRunOptions::new()
            })
            .expect("tc test run");
        assert_eq!(
            &out[..r.data_size_out as usize],
            frame,
            "TC must not modify the packet"
        );
        r.return_value
    }

    /// Runs `repeat` iterations in the kernel; returns the mean time per packet.
    pub fn time_xdp(&mut self, frame: &[u8], repeat: u32) -> std::time::Duration {
        let prog = self.dp.xdp().unwrap();
        let opts = TestRunOptions {
            data_in: Some(frame),
            repeat,
            ..TestRunOptions::new()
        };
        prog.test_run(opts).expect("xdp test run").duration
    }

    /// Runs TC egress `repeat` times in the kernel; returns the mean time per packet.
    pub fn time_tc(&mut self, frame: &[u8], repeat: u32) -> std::time::Duration {
        let prog = self.dp.tc(PROG_TC).unwrap();
        let opts = TestRunOptions {
            data_in: Some(frame),
            repeat,
            ..TestRunOptions::new()
        };
        prog.test_run(opts).expect("tc test run").duration
    }

    /// The sample ring's descriptor, to wait on as a reader does (epoll).
    pub fn ring_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::{AsFd, AsRawFd};
        self.ring.as_fd().as_raw_fd()
    }

    /// Reads the samples waiting and drops them; how many (whatever their size: another
    /// build's).
    pub fn drain_samples(&mut self) -> usize {
        let mut n = 0;
        while self.ring.next().is_some() {
            n += 1;
        }
        n
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

    /// Each CPU's working memory of the full path (`CpuGlobals::work`: the flow key and the
    /// parsed headers) as bytes, read in place: what a packet the fast path counts and does
    /// not report never writes.
    pub fn working_memory(&self) -> Vec<Vec<u8>> {
        let aya::maps::Map::Array(data) = self.map(roce_trace_common::datapath::MAP_GLOBALS) else {
            panic!("GLOBALS is not an array map");
        };
        let g = roce_trace_datapath::mapped::MappedArray::<roce_trace_common::scratch::CpuGlobalsBytes>::new(
            &data,
        )
        .expect("the globals map");
        (0..g.len())
            .map(|i| g.get(i).expect("a CPU's globals").work.to_vec())
            .collect()
    }

    /// Writes into `FLOWS` every CPU has counted (`FLOWS_WRITES`): 0 while it is empty.
    pub fn flows_writes(&self) -> u64 {
        self.dp.flows_writes()
    }

    pub fn globals(&self) -> GlobalTotals {
        self.dp.globals().unwrap()
    }

    /// The `MIRRORS` map: mirror sessions by the id flow keys carry.
    pub fn mirrors(&self) -> std::collections::HashMap<u32, MirrorInfo> {
        self.dp.mirrors().unwrap()
    }
}

/// Writes Ethernet frames to a classic pcap file.
pub fn write_pcap(path: &Path, frames: &[Vec<u8>]) {
    let timed: Vec<(std::time::Duration, Vec<u8>)> = frames
        .iter()
        .enumerate()
        .map(|(i, fr)| (std::time::Duration::from_millis(i as u64), fr.clone()))
        .collect();
    write_pcap_at(path, &timed);
}

/// Writes frames to a pcap file, each at its own time (since the epoch).
pub fn write_pcap_at(path: &Path, frames: &[(std::time::Duration, Vec<u8>)]) {
    std::fs::write(path, pcap_bytes(frames)).unwrap();
}

/// Frames with their capture times as a classic pcap.
pub fn pcap_bytes(frames: &[(std::time::Duration, Vec<u8>)]) -> Vec<u8> {
    use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
    let mut w = PcapWriter::with_header(
        Vec::new(),
        PcapHeader {
            snaplen: 65535,
            ..Default::default()
        },
    )
    .unwrap();
    for (ts, fr) in frames {
        w.write_packet(&PcapPacket::new(*ts, fr.len() as u32, fr))
            .unwrap();
    }
    w.into_writer()
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

/// The Python that has scapy: the checkout's `.venv` (scripts/setup creates it: Debian's
/// system Python refuses pip installs), or `$ROCE_TRACE_PYTHON`.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("ROCE_TRACE_PYTHON") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python3")
}

/// What `python ARGS…` printed (see [`python`]), line by line (scapy cross-checks); panics
/// with its stderr when it fails.
pub fn python_lines(args: &[&std::ffi::OsStr]) -> Vec<String> {
    let py = python();
    let out = Command::new(&py)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{} (scripts/setup creates it): {e}", py.display()));
    assert!(
        out.status.success(),
        "{} {args:?} failed (scripts/setup installs scapy): {}",
        py.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// tshark's decoding of `pcap` as RoCEv2 on UDP 4791: one row per frame, one column per
/// field (the first occurrence of a field a frame has twice).
pub fn tshark_fields(pcap: &Path, fields: &[&str]) -> Vec<Vec<String>> {
    tshark_fields_occurrence(pcap, fields, 'f')
}

/// [`tshark_fields`] with tshark's `occurrence` (`f` first, `l` last — the inner header of
/// a mirrored copy).
pub fn tshark_fields_occurrence(pcap: &Path, fields: &[&str], occurrence: char) -> Vec<Vec<String>> {
    let occurrence = format!("occurrence={occurrence}");
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
        &occurrence,
    ]);
    for f in fields {
        cmd.args(["-e", f]);
    }
    let out = cmd.output().expect("tshark is installed (scripts/setup)");
    assert!(
        out.status.success(),
        "tshark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split('\t').map(str::to_owned).collect())
        .collect()
}

/// A scratch directory under the temporary directory, removed on drop (kept, and named,
/// when `ROCE_TRACE_KEEP=1`: reports, verdicts and logs to look at after a run).
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
        if std::env::var_os("ROCE_TRACE_KEEP").is_some_and(|v| v == "1") {
            eprintln!("kept {}", self.0.display());
            return;
        }
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
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The roce-trace binary of this build (the README's test command builds it first).
/// Debian's `nats-server` (fleet-mode tests); `scripts/setup` installs it.
pub fn nats_server_bin() -> &'static str {
    [
        "/usr/sbin/nats-server",
        "/usr/bin/nats-server",
        "/usr/local/bin/nats-server",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
    .unwrap_or_else(|| panic!("nats-server is not installed (scripts/setup installs Debian's `nats-server`)"))
}

pub fn roce_trace_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let bin = dir.join("roce-trace");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --bins` before the tests",
        bin.display()
    );
    bin
}

/// Runs `args` inside network namespace `ns`, panicking with its output on failure.
pub fn exec_in(ns: &str, args: &[&str]) -> String {
    let mut full = vec!["ip", "netns", "exec", ns];
    full.extend_from_slice(args);
    sh(&full)
}

/// Runs `f` on a thread that has entered the named network namespace (one a test did not
/// create, such as a lab node's, is left as it is).
pub fn in_netns<T: Send + 'static>(name: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{name}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: fd is an open netns file; setns affects only this thread.
        let r = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
}

/// A network namespace this test created; deleted (with its veths) on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(name: &str) -> Self {
        let name = format!("{name}-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        sh(&["ip", "netns", "add", &name]);
        let ns = Self { name };
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    pub fn exec(&self, args: &[&str]) -> String {
        exec_in(&self.name, args)
    }

    /// Runs `f` on a thread that has entered this namespace (sockets opened there stay
    /// in it).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        in_netns(&self.name, f)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// Two namespaces joined by a veth pair: `a` (10.99.0.1, fd99::1) and `b` (.2, ::2).
pub struct VethPair {
    pub a: Netns,
    pub b: Netns,
    pub a_if: String,
    pub b_if: String,
}

impl VethPair {
    pub fn new(tag: &str) -> Self {
        let a = Netns::new(&format!("rt{tag}a"));
        let b = Netns::new(&format!("rt{tag}b"));
        let (a_if, b_if) = ("rtv0".to_owned(), "rtv1".to_owned());
        sh(&[
            "ip", "link", "add", "rtvtmp0", "netns", &a.name, "type", "veth", "peer", "name", "rtvtmp1",
            "netns", &b.name,
        ]);
        a.exec(&["ip", "link", "set", "rtvtmp0", "name", &a_if]);
        b.exec(&["ip", "link", "set", "rtvtmp1", "name", &b_if]);
        for (ns, ifn, v4, v6) in [
            (&a, &a_if, "10.99.0.1/24", "fd99::1/64"),
            (&b, &b_if, "10.99.0.2/24", "fd99::2/64"),
        ] {
            ns.exec(&[
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.accept_dad=0",
                "net.ipv6.conf.default.accept_dad=0",
            ]);
            ns.exec(&["ip", "addr", "add", v4, "dev", ifn]);
            ns.exec(&["ip", "-6", "addr", "add", v6, "dev", ifn, "nodad"]);
            ns.exec(&["ip", "link", "set", ifn, "up"]);
        }
        Self { a, b, a_if, b_if }
    }
}

/// Sends raw Ethernet frames out of `ifname` in the calling thread's namespace through an
/// AF_PACKET socket (they cross the interface's TC egress like any transmitted packet).
pub fn send_frames(ifname: &str, frames: &[Vec<u8>]) {
    packet_send(ifname, frames, None);
}

/// Like [`send_frames`], but each frame leaves as an skb whose linear area holds only its
/// first `linear` bytes and whose rest sits in page fragments (AF_PACKET with a virtio-net
/// header whose `hdr_len` says `linear`): what a NIC driver or a zero-copy sender hands the
/// stack. The kernel makes a paged skb only of frames of a page or more (4,096 bytes),
/// so the interface's MTU must let them through.
pub fn send_frames_paged(ifname: &str, frames: &[Vec<u8>], linear: u16) {
    for f in frames {
        assert!(f.len() >= 4096, "a frame under a page stays linear");
    }
    packet_send(ifname, frames, Some(linear));
}

/// The AF_PACKET sender of [`send_frames`] and [`send_frames_paged`]: with `vnet_linear`,
/// each frame is preceded by a virtio-net header whose `hdr_len` is it.
fn packet_send(ifname: &str, frames: &[Vec<u8>], vnet_linear: Option<u16>) {
    const PACKET_VNET_HDR: libc::c_int = 15;
    let idx = roce_trace_datapath::sys::ifindex(ifname).unwrap();
    // SAFETY: plain socket syscalls on a fd we own; addresses are valid sockaddr_ll.
    unsafe {
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0);
        assert!(fd >= 0, "AF_PACKET socket: {}", std::io::Error::last_os_error());
        if vnet_linear.is_some() {
            let on: libc::c_int = 1;
            let r = libc::setsockopt(
                fd,
                libc::SOL_PACKET,
                PACKET_VNET_HDR,
                &on as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as u32,
            );
            assert_eq!(r, 0, "PACKET_VNET_HDR: {}", std::io::Error::last_os_error());
        }
        let mut addr: libc::sockaddr_ll = std::mem::zeroed();
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = idx as i32;
        addr.sll_halen = 6;
        for f in frames {
            let m = match vnet_linear {
                None => std::borrow::Cow::Borrowed(f),
                Some(linear) => {
                    // struct virtio_net_hdr: flags, gso_type (none), hdr_len, gso_size,
                    // csum_start, csum_offset; little-endian.
                    let mut m = vec![0u8, 0];
                    m.extend_from_slice(&linear.to_le_bytes());
                    m.extend_from_slice(&[0; 6]);
                    m.extend_from_slice(f);
                    std::borrow::Cow::Owned(m)
                }
            };
            let n = libc::sendto(
                fd,
                m.as_ptr() as *const libc::c_void,
                m.len(),
                0,
                &addr as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
            assert_eq!(n as usize, m.len(), "sendto: {}", std::io::Error::last_os_error());
        }
        libc::close(fd);
    }
}

/// The MAC address of interface `ifname` in namespace `ns`.
pub fn mac_of(ns: &Netns, ifname: &str) -> [u8; 6] {
    let out = ns.exec(&["cat", &format!("/sys/class/net/{ifname}/address")]);
    let v: Vec<u8> = out
        .trim()
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).unwrap())
        .collect();
    v.try_into().unwrap()
}

/// A running `roce-trace capture`, its JSON Lines collected from stdout.
pub struct CaptureProc {
    pub child: Proc,
    stderr_lines: std::sync::mpsc::Receiver<String>,
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl CaptureProc {
    /// Starts `roce-trace capture ARGS` in `ns` and waits until its hooks are attached.
    pub fn start(ns: &Netns, args: &[&str]) -> Self {
        use std::io::BufRead;
        let mut child = Proc::spawn(
            Command::new("ip")
                .args(["netns", "exec", &ns.name])
                .arg(roce_trace_bin())
                .arg("capture")
                .args(args)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped()),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let all = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let all2 = all.clone();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                all2.lock().unwrap().push_str(&format!("{line}\n"));
                let _ = tx.send(line);
            }
        });
        let p = Self {
            child,
            stderr_lines: rx,
            stderr: all,
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match p.stderr_lines.recv_timeout(left) {
                Ok(l) if l.contains("capturing on") => return p,
                Ok(_) => {}
                Err(_) => panic!("capture did not start: {}", p.stderr.lock().unwrap()),
            }
        }
    }

    /// Waits for exit; returns the parsed JSON records.
    pub fn finish(mut self) -> Vec<serde_json::Value> {
        use std::io::Read;
        let mut out = String::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        let status = self.child.wait().unwrap();
        assert!(
            status.success(),
            "capture failed: {}",
            self.stderr.lock().unwrap()
        );
        out.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
            .collect()
    }
}

/// Starts `roce-trace gen ARGS --json` in namespace `ns`.
pub fn spawn_gen(ns: &str, args: &[&str]) -> Proc {
    Proc::spawn(
        Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(roce_trace_bin())
            .arg("gen")
            .args(args)
            .arg("--json")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped()),
    )
}

/// Waits for a `gen` and returns its JSON report.
pub fn gen_report(c: Proc) -> serde_json::Value {
    let out = c.wait_with_output();
    assert!(
        out.status.success(),
        "gen failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Starts tcpdump in namespace `ns` (immediate mode, so stopping it loses little) and
/// returns once it captures.
pub fn start_tcpdump(ns: &str, ifname: &str, pcap: &Path, filter: &str) -> Proc {
    use std::io::{BufRead, BufReader};
    let mut c = Proc::spawn(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "tcpdump",
                "-i",
                ifname,
                "--immediate-mode",
                "-B",
                "65536",
                "-w",
            ])
            .arg(pcap)
            .arg(filter)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped()),
    );
    let mut err = BufReader::new(c.stderr.take().unwrap());
    let mut line = String::new();
    while err.read_line(&mut line).unwrap() > 0 && !line.contains("listening on") {
        line.clear();
    }
    assert!(line.contains("listening on"), "tcpdump did not start");
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    c
}

/// SIGINT to a child (tcpdump, gen) after a moment (the last packets), then waits for it.
pub fn interrupt(c: Proc) {
    std::thread::sleep(std::time::Duration::from_millis(200));
    c.interrupt();
}

/// A roce-trace process in a namespace, started and waited for until its stderr says
/// `ready`; the rest of its stderr is kept for failure messages.
pub struct Daemon {
    pub child: Proc,
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Daemon {
    pub fn start(ns: &str, args: &[&str], ready: &str) -> Self {
        Self::start_under(ns, &[], args, ready)
    }

    /// As [`Daemon::start`], run through `wrapper` (e.g. `setpriv …`), which must exec
    /// it (the process is then roce-trace's).
    pub fn start_under(ns: &str, wrapper: &[&str], args: &[&str], ready: &str) -> Self {
        use std::io::BufRead;
        let mut child = Proc::spawn(
            Command::new("ip")
                .args(["netns", "exec", ns])
                .args(wrapper)
                .arg(roce_trace_bin())
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped()),
        );
        let all = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let err = child.stderr.take().unwrap();
        let all2 = all.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                all2.lock().unwrap().push_str(&format!("{line}\n"));
                let _ = tx.send(line);
            }
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.contains(ready) => return Self { child, stderr: all },
                Ok(_) => {}
                Err(_) => panic!("{args:?} did not print `{ready}`: {}", all.lock().unwrap()),
            }
        }
    }

    /// SIGINT, then waits; panics with its stderr when it failed.
    pub fn stop(self) {
        let st = self.child.interrupt();
        assert!(st.success(), "exited with {st}: {}", self.stderr.lock().unwrap());
    }

    /// SIGKILL: the process gets no chance to clean up.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs this test binary's test `name` alone (CI=`ci`, or unset), for what happens to a
    /// test that fails or cannot run: whether it passed, its stdout and its stderr. Output
    /// goes through files: a process the probe leaves behind cannot hold this up.
    fn run_probe(name: &str, ci: Option<&str>) -> (bool, String, String) {
        let dir = TempDir::new(&format!("probe-{}", name.replace(':', "-")));
        let (out, err) = (dir.path("stdout"), dir.path("stderr"));
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env("ROCE_TRACE_PROBE", "1")
            .env_remove("CI")
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap());
        if let Some(v) = ci {
            cmd.env("CI", v);
        }
        let ok = cmd.status().unwrap().success();
        let read = |p: &Path| std::fs::read_to_string(p).unwrap();
        (ok, read(&out), read(&err))
    }

    fn probing() -> bool {
        std::env::var_os("ROCE_TRACE_PROBE").is_some()
    }

    #[test]
    fn probe_cannot_run() {
        if probing() {
            cannot_run("the probe's reason");
        }
    }

    #[test]
    fn a_test_that_cannot_run_fails_under_ci_and_is_skipped_elsewhere() {
        let (ok, out, err) = run_probe("tests::probe_cannot_run", Some("true"));
        assert!(!ok, "CI=true: {out}{err}");
        assert!(
            (out.clone() + &err).contains("under CI=true that is a failure: the probe's reason"),
            "{out}{err}"
        );
        let (ok, out, err) = run_probe("tests::probe_cannot_run", None);
        assert!(ok, "{out}{err}");
        assert!(err.contains("skipped: the probe's reason"), "{err}");
    }

    /// Whether process `pid` is gone (or a zombie nobody reaped: dead all the same).
    fn dead(pid: u32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        }
    }

    fn wait_dead(pid: u32) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !dead(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        dead(pid)
    }

    /// A test that panics with processes running: a daemon through `ip netns exec`, a
    /// shell pipeline in its own group. It prints their pids first.
    #[test]
    fn probe_panics_with_children() {
        if !probing() {
            return;
        }
        let ns = Netns::new("rtproc");
        let daemon = Proc::spawn(Command::new("ip").args(["netns", "exec", &ns.name, "sleep", "1000"]));
        let mut pipeline = Proc::spawn_group(
            Command::new("sh")
                .args(["-c", "sleep 1000 & echo $!; sleep 1000 | cat"])
                .stdout(std::process::Stdio::piped()),
        );
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(pipeline.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        // `ip netns exec` execs the program once in the namespace: the pid becomes sleep's.
        let comm = || std::fs::read_to_string(format!("/proc/{}/comm", daemon.id())).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while comm().trim() != "sleep" && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        println!("comm {}", comm().trim());
        println!("pids {} {} {}", daemon.id(), pipeline.id(), line.trim());
        panic!("the probe fails with its children running");
    }

    #[test]
    fn a_failing_test_leaves_no_process_behind() {
        if !require_root() {
            return;
        }
        let (ok, out, err) = run_probe("tests::probe_panics_with_children", None);
        assert!(!ok, "the probe failed: {out}{err}");
        assert!(
            out.contains("comm sleep"),
            "ip netns exec is the program: {out}{err}"
        );
        let pids: Vec<u32> = out
            .lines()
            .find_map(|l| l.strip_prefix("pids "))
            .unwrap_or_else(|| panic!("no pids: {out}{err}"))
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        assert_eq!(pids.len(), 3);
        for pid in pids {
            assert!(wait_dead(pid), "process {pid} outlived the failed test");
        }
    }

    #[test]
    fn a_process_waited_for_is_not_signalled_again() {
        let mut p = Proc::spawn(&mut Command::new("true"));
        assert!(p.wait().unwrap().success());
        drop(p); // kills nothing: std knows it was reaped
        let out = Proc::spawn(
            Command::new("echo")
                .arg("hi")
                .stdout(std::process::Stdio::piped()),
        )
        .wait_with_output();
        assert_eq!(out.stdout, b"hi\n");
    }
}
