//! Loads the embedded eBPF object, attaches it (XDP or TC ingress, TC egress) and reads its maps.
//! This is the kernel boundary: everything above works on the types it returns.

use std::collections::HashMap;

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap as BpfHashMap, MapData, PerCpuHashMap, RingBuf},
    programs::{SchedClassifier, TcAttachType, Xdp, XdpMode, tc},
};
use roce_trace_common::{datapath::*, sampling::threshold_for_rate, scratch::CpuGlobalsBytes};
use thiserror::Error;

use crate::{mapped::MappedArray, mirror::MirrorTable, sys};

/// The datapath object, built by this crate's build.rs and embedded in the binary.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/roce-trace"));

#[derive(Debug, Error)]
pub enum DatapathError {
    #[error(transparent)]
    Sys(#[from] sys::SysError),
    #[error("loading the eBPF object failed")]
    Load(#[source] aya::EbpfError),
    #[error("the kernel rejected program `{name}`")]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("attaching {hook} to `{iface}` failed")]
    Attach {
        hook: &'static str,
        iface: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("map `{0}` missing from the eBPF object")]
    MissingMap(&'static str),
    #[error("reading map `{name}` failed")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("mapping map `{name}` into memory failed")]
    Mmap {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid option: {0}")]
    InvalidOption(String),
}

/// Bytes the kernel's flow table may take over all CPUs (see
/// [`DatapathOptions::table_slots`]).
pub const FLOW_TABLE_BUDGET: usize = 16 << 20;

/// Load-time settings of the datapath.
#[derive(Clone, Debug)]
pub struct DatapathOptions {
    pub udp_port: u16,
    /// 1 in N packets by identity hash; 0 = anomalies only.
    pub sample_rate: u32,
    /// Shared by every host so all sample the same packets.
    pub seed: u32,
    /// Packets with a DSCP outside this set are always reported; empty = no expectation.
    pub expected_dscp: Vec<u8>,
    /// Flows the LRU map `FLOWS` keeps (flows without a flow-table slot).
    pub max_flows: u32,
    /// Slots of the per-CPU flow table, rounded up to a power of two, at most
    /// `MAX_FLOW_SLOTS`.
    pub flow_slots: u32,
    /// A flow-table slot idle this long goes to a new flow that hashes to it.
    pub slot_idle_ms: u32,
    /// Wake the sample reader once a batch waits rather than as soon as it has caught up
    /// (a wake-up per sample costs the packet an IRQ-work self-IPI): for a reader that
    /// also drains on a timer, which bounds how late a sample is read (capture every
    /// `SAMPLE_DRAIN_MS`, the agent every `AGENT_SAMPLE_DRAIN_MS`).
    pub batch_wakeups: bool,
    /// Mirrored copies (GRE/ERSPAN) only from these ranges, checked in the datapath
    /// before a session is remembered (empty: from any source); at most
    /// `MAX_MIRROR_FROM`.
    pub mirror_from: Vec<AddrPrefix>,
}

impl Default for DatapathOptions {
    fn default() -> Self {
        Self {
            udp_port: roce_trace_common::wire::ROCEV2_UDP_PORT,
            sample_rate: 1000,
            seed: 0,
            expected_dscp: Vec::new(),
            max_flows: DEFAULT_MAX_FLOWS,
            flow_slots: MAX_FLOW_SLOTS,
            slot_idle_ms: DEFAULT_SLOT_IDLE_MS,
            batch_wakeups: false,
            mirror_from: Vec::new(),
        }
    }
}

impl DatapathOptions {
    /// Slots of each CPU's flow table as loaded on a host with `cpus` CPU ids:
    /// `flow_slots` rounded up to a power of two, at most `MAX_FLOW_SLOTS`, and few enough
    /// that the whole table (every CPU's, which a reader reads each interval) stays
    /// within `FLOW_TABLE_BUDGET`: 2048 slots a CPU up to 42 CPUs, 256 at 256.
    pub fn table_slots(&self, cpus: usize) -> u32 {
        let budget = FLOW_TABLE_BUDGET / (cpus.max(1) * size_of::<FlowSlot>());
        let fits = if budget == 0 { 1 } else { 1 << budget.ilog2() };
        self.flow_slots
            .max(1)
            .next_power_of_two()
            .min(MAX_FLOW_SLOTS)
            .min(fits as u32)
    }

    pub fn config(&self) -> Result<DatapathConfig, DatapathError> {
        let mut mask = 0u64;
        for &d in &self.expected_dscp {
            if d > 63 {
                return Err(DatapathError::InvalidOption(format!(
                    "DSCP {d} is out of range 0..=63"
                )));
            }
            mask |= 1 << d;
        }
        if self.max_flows == 0 {
            return Err(DatapathError::InvalidOption(
                "max flows must be at least 1".into(),
            ));
        }
        if self.mirror_from.len() > MAX_MIRROR_FROM as usize {
            return Err(DatapathError::InvalidOption(format!(
                "{} mirror source ranges: the datapath checks {MAX_MIRROR_FROM} at most",
                self.mirror_from.len()
            )));
        }
        let threshold = threshold_for_rate(self.sample_rate);
        Ok(DatapathConfig {
            udp_port: self.udp_port,
            mirror_from: self.mirror_from.len() as u16,
            slot_idle_ms: self.slot_idle_ms,
            wakeup_bytes: if self.batch_wakeups { SAMPLE_BATCH_BYTES } else { 0 },
            ..DatapathConfig::with(
                self.seed,
                threshold.unwrap_or(0),
                threshold.is_some() as u32,
                mask,
            )
        })
    }
}

/// The array map `name` of a loaded object, mapped read-only (see [`MappedArray`]).
fn mapped_array<T: aya::Pod>(ebpf: &Ebpf, name: &'static str) -> Result<MappedArray<T>, DatapathError> {
    let mmap_err = |source| DatapathError::Mmap { name, source };
    match ebpf.map(name) {
        Some(aya::maps::Map::Array(data)) => MappedArray::new(data).map_err(mmap_err),
        Some(_) => Err(mmap_err(std::io::Error::other(
            "not a plain array map (an object built before FLOW_SLOTS and GLOBALS became mmapable arrays?)",
        ))),
        None => Err(DatapathError::MissingMap(name)),
    }
}

/// Which XDP attachment to ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpModeChoice {
    /// Native (driver) mode, falling back to generic with a warning.
    Auto,
    Native,
    Generic,
}

/// Which hook observes arriving packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IngressHook {
    /// XDP where the driver runs it on its own receive buffers; TC ingress on veth
    /// (which copies every packet it hands to XDP) and where native XDP is unavailable.
    Auto,
    /// XDP, in the mode asked for.
    Xdp(XdpModeChoice),
    /// TC ingress (tcx, else clsact): sees the same packets as an skb.
    Tc,
}

/// How a hook ended up attached, for the user and the summary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub iface: String,
    pub ifindex: u32,
    /// `xdp`, `tc-ingress` or `tc-egress`.
    pub hook: &'static str,
    /// `DIR_INGRESS` or `DIR_EGRESS`.
    pub direction: u8,
    pub mode: &'static str,
    /// Set when the requested mode was not available and another was used.
    pub warning: Option<String>,
}

pub struct Datapath {
    ebpf: Ebpf,
    /// `FLOW_SLOTS` and `GLOBALS`, mapped once at load and read in place.
    slots: MappedArray<FlowSlotChunk>,
    globals: MappedArray<CpuGlobalsBytes>,
    /// `log2` of the flow table's slots a CPU (`DatapathConfig::slot_bits`).
    slot_bits: u32,
}

impl Datapath {
    /// Loads (verifies) the programs with `opts` baked in. Needs CAP_BPF.
    pub fn load(opts: &DatapathOptions) -> Result<Self, DatapathError> {
        Self::load_object(opts, EBPF_OBJECT)
    }

    /// [`Self::load`] from another build's object (`cargo xtask bench datapath
    /// --baseline` times two builds side by side); its maps must be named as this build's.
    pub fn load_object(opts: &DatapathOptions, object: &[u8]) -> Result<Self, DatapathError> {
        sys::check_kernel()?;
        sys::check_privileges()?;
        // Arrays indexed by CPU id: as many elements as ids the kernel may give.
        let cpus = sys::cpu_id_count()
            .map_err(|source| DatapathError::InvalidOption(format!("cannot count the CPUs: {source}")))?;
        let slots = opts.table_slots(cpus);
        let cfg = DatapathConfig {
            slot_bits: slots.trailing_zeros(),
            ..opts.config()?
        };
        let mut ebpf = EbpfLoader::new()
            .override_global(GLOBAL_CONFIG, &cfg, true)
            .map_max_entries(MAP_FLOWS, opts.max_flows)
            // Every flow has an owner record, in a slot or not.
            .map_max_entries(
                MAP_FLOW_OWNER,
                opts.max_flows.saturating_add(slots.saturating_mul(cpus as u32)),
            )
            .map_max_entries(MAP_FLOW_SLOTS, (cpus as u32) << flow_chunk_bits(cfg.slot_bits))
            .map_max_entries(MAP_GLOBALS, cpus as u32)
            .load(object)
            .map_err(DatapathError::Load)?;
        if !opts.mirror_from.is_empty() {
            let map = ebpf
                .map_mut(MAP_MIRROR_FROM)
                .ok_or(DatapathError::MissingMap(MAP_MIRROR_FROM))?;
            let mut ranges: aya::maps::Array<&mut MapData, AddrPrefix> = aya::maps::Array::try_from(map)
                .map_err(|source| DatapathError::Map {
                    name: MAP_MIRROR_FROM,
                    source,
                })?;
            for (i, p) in opts.mirror_from.iter().enumerate() {
                ranges.set(i as u32, p, 0).map_err(|source| DatapathError::Map {
                    name: MAP_MIRROR_FROM,
                    source,
                })?;
            }
        }
        let slots = mapped_array(&ebpf, MAP_FLOW_SLOTS)?;
        let globals = mapped_array(&ebpf, MAP_GLOBALS)?;
        Ok(Self {
            ebpf,
            slots,
            globals,
            slot_bits: cfg.slot_bits,
        })
    }

    pub fn xdp(&mut self) -> Result<&mut Xdp, DatapathError> {
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(PROG_XDP)
            .ok_or(DatapathError::MissingMap(PROG_XDP))?
            .try_into()
            .map_err(|source| DatapathError::Program {
                name: PROG_XDP,
                source,
            })?;
        // Loaded on first use: a program without an fd is not loaded yet.
        if prog.fd().is_err() {
            prog.load().map_err(|source| DatapathError::Program {
                name: PROG_XDP,
                source,
            })?;
        }
        Ok(prog)
    }

    /// The TC program of one direction (`PROG_TC` egress, `PROG_TC_INGRESS`), loaded.
    pub fn tc(&mut self, name: &'static str) -> Result<&mut SchedClassifier, DatapathError> {
        let prog: &mut SchedClassifier = self
            .ebpf
            .program_mut(name)
            .ok_or(DatapathError::MissingMap(name))?
            .try_into()
            .map_err(|source| DatapathError::Program { name, source })?;
        if prog.fd().is_err() {
            prog.load()
                .map_err(|source| DatapathError::Program { name, source })?;
        }
        Ok(prog)
    }

    /// Attaches the XDP program to `iface` through a BPF link, so it detaches when this
    /// process exits, however it exits.
    pub fn attach_xdp(&mut self, iface: &str, mode: XdpModeChoice) -> Result<Attachment, DatapathError> {
        let ifindex = sys::ifindex(iface)?;
        let prog = self.xdp()?;
        let attach = |prog: &mut Xdp, m: XdpMode| prog.attach_to_if_index(ifindex, m);
        let (mode_name, warning) = match mode {
            XdpModeChoice::Native => {
                attach(prog, XdpMode::Driver).map_err(|source| attach_err("XDP (native)", iface, source))?;
                ("native", None)
            }
            XdpModeChoice::Generic => {
                attach(prog, XdpMode::Skb).map_err(|source| attach_err("XDP (generic)", iface, source))?;
                ("generic", None)
            }
            XdpModeChoice::Auto => match attach(prog, XdpMode::Driver) {
                Ok(_) => ("native", None),
                Err(native_err) => {
                    attach(prog, XdpMode::Skb)
                        .map_err(|source| attach_err("XDP (generic)", iface, source))?;
                    (
                        "generic",
                        Some(format!(
                            "native XDP is not available on {iface} ({native_err}); using generic XDP, \
                             which sees the same packets at a higher cost per packet"
                        )),
                    )
                }
            },
        };
        Ok(Attachment {
            iface: iface.to_owned(),
            ifindex,
            hook: "xdp",
            direction: DIR_INGRESS,
            mode: mode_name,
            warning,
        })
    }

    /// Attaches a TC program (`direction`: `DIR_INGRESS` or `DIR_EGRESS`): a tcx link
    /// (Linux 6.6+, detaches on exit), else a clsact filter.
    pub fn attach_tc(&mut self, iface: &str, direction: u8) -> Result<Attachment, DatapathError> {
        let ifindex = sys::ifindex(iface)?;
        let tcx = sys::kernel_version() >= (6, 6);
        if !tcx {
            // Already present is fine; any real failure shows up in attach below.
            let _ = tc::qdisc_add_clsact(iface);
        }
        let (name, attach_type, hook, what) = if direction == DIR_INGRESS {
            (PROG_TC_INGRESS, TcAttachType::Ingress, "tc-ingress", "TC ingress")
        } else {
            (PROG_TC, TcAttachType::Egress, "tc-egress", "TC egress")
        };
        let prog = self.tc(name)?;
        prog.attach(iface, attach_type)
            .map_err(|source| attach_err(what, iface, source))?;
        let warning = (!tcx).then(|| {
            format!(
                "kernel has no tcx: the {what} program on {iface} is a clsact filter, which stays \
                 if roce-trace is killed (remove with `tc qdisc del dev {iface} clsact`)"
            )
        });
        Ok(Attachment {
            iface: iface.to_owned(),
            ifindex,
            hook,
            direction,
            mode: if tcx { "tcx" } else { "clsact" },
            warning,
        })
    }

    /// The ingress hook `choice` resolves to on `iface`: for [`IngressHook::Auto`], TC on
    /// veth (XDP there makes the kernel copy every arriving packet into a buffer XDP can
    /// use, and switches the device to NAPI mode: it would disturb the traffic it
    /// observes), native XDP elsewhere, TC where native XDP cannot attach.
    fn attach_ingress(&mut self, iface: &str, choice: IngressHook) -> Result<Attachment, DatapathError> {
        match choice {
            IngressHook::Xdp(mode) => self.attach_xdp(iface, mode),
            IngressHook::Tc => self.attach_tc(iface, DIR_INGRESS),
            IngressHook::Auto if sys::driver(iface).as_deref() == Some("veth") => {
                self.attach_tc(iface, DIR_INGRESS)
            }
            IngressHook::Auto => match self.attach_xdp(iface, XdpModeChoice::Native) {
                Ok(a) => Ok(a),
                Err(native_err) => {
                    let mut a = self.attach_tc(iface, DIR_INGRESS)?;
                    a.warning = Some(format!(
                        "native XDP is not available on {iface} ({native_err}); observing ingress \
                         with TC, which sees the same packets"
                    ));
                    Ok(a)
                }
            },
        }
    }

    /// The ingress hook and/or TC on egress of every interface, in that order; warnings
    /// (a mode fallen back to) are logged.
    pub fn attach_all(
        &mut self,
        ifaces: &[String],
        ingress: Option<IngressHook>,
        egress: bool,
    ) -> Result<Vec<Attachment>, DatapathError> {
        let mut hooks = Vec::new();
        for iface in ifaces {
            if let Some(choice) = ingress {
                hooks.push(self.attach_ingress(iface, choice)?);
            }
            if egress {
                hooks.push(self.attach_tc(iface, DIR_EGRESS)?);
            }
        }
        for h in &hooks {
            if let Some(w) = &h.warning {
                tracing::warn!("{w}");
            }
        }
        Ok(hooks)
    }

    /// Every flow in the kernel, per-CPU copies merged.
    ///
    /// A flow's copy on one CPU is in that CPU's flow table (`FLOW_SLOTS`) or in `FLOWS`,
    /// never both, except while the kernel moves an idle flow out of its slot into `FLOWS`.
    /// So the slots are read first, then `FLOWS`, and a copy found in both counts once (the
    /// one in `FLOWS`): a move between the two reads is neither missed nor counted twice.
    /// Only the slots a CPU's globals mark as having held a flow (`CpuGlobals::occupied`)
    /// are read: an empty table costs the reader four lines a CPU, not a line a slot.
    pub fn flows(&self) -> Result<HashMap<FlowKey, FlowCounters>, DatapathError> {
        let err = |name| move |source| DatapathError::Map { name, source };
        let mut copies = FlowCopies::default();
        let cpus = self.slots.len() >> flow_chunk_bits(self.slot_bits);
        let slots_per_cpu = 1usize << self.slot_bits;
        for cpu in 0..cpus {
            let Some(g) = self.globals.ptr(cpu) else { break };
            // SAFETY: a valid element of the mapping (`ptr` checked the index), its marks
            // read with a volatile copy; any bytes are valid u64s.
            let occupied = unsafe { core::ptr::addr_of!((*g).occupied).read_volatile() };
            // The marks before the slots: the programs mark a slot before they write it.
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            'words: for (word, &bits) in occupied.iter().enumerate() {
                let mut bits = bits;
                while bits != 0 {
                    let s = word * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    // The marks go up with the slot: none past the table, and a chunk
                    // not mapped (none is: the mapping holds every CPU's) ends this CPU.
                    if s >= slots_per_cpu {
                        break 'words;
                    }
                    let (chunk, entry) = slot_place(cpu as u32, s as u32, self.slot_bits);
                    let Some(chunk) = self.slots.ptr(chunk as usize) else {
                        break 'words;
                    };
                    // SAFETY: entry `entry` (< SLOTS_PER_CHUNK) of a mapped chunk (a
                    // `FlowSlotChunk` is that many slots), read with volatile copies only;
                    // any bytes are a valid `FlowSlot`. The packet count first, as a slot
                    // can be marked and not yet written.
                    let slot = unsafe {
                        let slot = chunk.cast::<FlowSlot>().add(entry as usize);
                        if core::ptr::addr_of!((*slot).counters.counts.packets).read_volatile() == 0 {
                            continue;
                        }
                        slot.read_volatile()
                    };
                    copies.slot(cpu, cpus, &slot);
                }
            }
        }
        // After the slots: a copy moved out of a slot was counted before the slot emptied.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        if self.flows_writes() == 0 {
            return Ok(copies.merge());
        }
        let map = self
            .ebpf
            .map(MAP_FLOWS)
            .ok_or(DatapathError::MissingMap(MAP_FLOWS))?;
        let map: PerCpuHashMap<&MapData, FlowKey, FlowCounters> =
            PerCpuHashMap::try_from(map).map_err(err(MAP_FLOWS))?;
        for item in map.iter() {
            let (k, values) = item.map_err(err(MAP_FLOWS))?;
            copies.flows_entry(k, &values);
        }
        Ok(copies.merge())
    }

    /// The mirror sessions the datapath has seen, by id (`FlowKey::mirror`). Read after
    /// [`Datapath::flows`]: the programs record a session before its first flow, so every
    /// flow read before holds an id found here (unless the map was full).
    pub fn mirrors(&self) -> Result<HashMap<u32, MirrorInfo>, DatapathError> {
        let map = self
            .ebpf
            .map(MAP_MIRRORS)
            .ok_or(DatapathError::MissingMap(MAP_MIRRORS))?;
        let map: BpfHashMap<&MapData, u32, MirrorInfo> =
            BpfHashMap::try_from(map).map_err(|source| DatapathError::Map {
                name: MAP_MIRRORS,
                source,
            })?;
        map.iter()
            .collect::<Result<_, _>>()
            .map_err(|source| DatapathError::Map {
                name: MAP_MIRRORS,
                source,
            })
    }

    /// Fills `t` from [`Datapath::mirrors`] when one of `keys` has an id it cannot name
    /// (the map is read only then), and warns about any it still cannot.
    pub fn resolve_mirrors<'a>(
        &self,
        t: &mut MirrorTable,
        keys: impl Iterator<Item = &'a FlowKey> + Clone,
    ) -> Result<(), DatapathError> {
        if keys.clone().any(|k| t.missing(k)) {
            t.extend(self.mirrors()?);
            t.warn_missing(keys);
        }
        Ok(())
    }

    /// Writes into `FLOWS` so far, every CPU's (`FLOWS_WRITES`): 0 while it is empty.
    pub fn flows_writes(&self) -> u64 {
        (0..self.globals.len())
            .filter_map(|cpu| self.globals.ptr(cpu))
            // SAFETY: a valid element of the mapping (`ptr` checked the index), its one
            // counter read with a volatile load.
            .map(|g| unsafe { core::ptr::addr_of!((*g).counters[FLOWS_WRITES]).read_volatile() })
            .sum()
    }

    /// CPU `cpu`'s counters, copied alone: the clock before them and the working memory
    /// after them, which the programs write as they run, are left where they are.
    fn counters(&self, cpu: usize) -> Option<[u64; GLOBAL_COUNTERS_LEN as usize]> {
        let g = self.globals.ptr(cpu)?;
        // SAFETY: a valid element of the mapping (`ptr` checked the index), read with a
        // volatile copy of its counters only; any bytes are valid u64s.
        Some(unsafe { core::ptr::addr_of!((*g).counters).read_volatile() })
    }

    /// Global counters summed over CPUs, indexed by `GlobalCounter::index(direction)`.
    pub fn globals(&self) -> Result<GlobalTotals, DatapathError> {
        let mut totals = GlobalTotals::default();
        for cpu in 0..self.globals.len() {
            let Some(counters) = self.counters(cpu) else { break };
            for (slot, v) in totals.0.iter_mut().zip(&counters) {
                *slot += v;
            }
        }
        Ok(totals)
    }

    /// Reads a sample ring the poller says is readable: `read`, re-arm, `read` again —
    /// what the kernel committed between the last read and re-arming woke nobody. Returns
    /// what the two reads returned, added.
    pub fn read_ready<E>(
        guard: &mut tokio::io::unix::AsyncFdReadyMutGuard<'_, RingBuf<MapData>>,
        mut read: impl FnMut(&mut RingBuf<MapData>) -> Result<u64, E>,
    ) -> Result<u64, E> {
        let n = read(guard.get_inner_mut())?;
        guard.clear_ready();
        Ok(n + read(guard.get_inner_mut())?)
    }

    /// The sample ring buffer (can be taken once).
    pub fn take_samples(&mut self) -> Result<RingBuf<MapData>, DatapathError> {
        let map = self
            .ebpf
            .take_map(MAP_SAMPLES)
            .ok_or(DatapathError::MissingMap(MAP_SAMPLES))?;
        RingBuf::try_from(map).map_err(|source| DatapathError::Map {
            name: MAP_SAMPLES,
            source,
        })
    }
}

fn attach_err(hook: &'static str, iface: &str, source: aya::programs::ProgramError) -> DatapathError {
    DatapathError::Attach {
        hook,
        iface: iface.to_owned(),
        source,
    }
}

/// Global counters of both directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalTotals(pub [u64; GLOBAL_COUNTERS_LEN as usize]);

impl Default for GlobalTotals {
    fn default() -> Self {
        Self([0; GLOBAL_COUNTERS_LEN as usize])
    }
}

impl GlobalTotals {
    /// `FramesSeen` is the sum of [`GlobalCounter::OUTCOMES`] (each frame ends in one).
    pub fn get(&self, c: GlobalCounter, direction: u8) -> u64 {
        if c.kind() == CounterKind::AllFrames {
            return GlobalCounter::OUTCOMES
                .iter()
                .map(|&o| self.0[o.index(direction) as usize])
                .sum();
        }
        self.0[c.index(direction) as usize]
    }
    /// Both directions added.
    pub fn total(&self, c: GlobalCounter) -> u64 {
        self.get(c, DIR_INGRESS) + self.get(c, DIR_EGRESS)
    }
}

/// Each flow's copy on each CPU, gathered from the flow table's slots and then from
/// `FLOWS` (in that order, see [`Datapath::flows`]): a copy in `FLOWS` replaces one found
/// in a slot of the same CPU, the same counters caught while the kernel moved them.
#[derive(Default)]
pub struct FlowCopies(HashMap<FlowKey, Vec<FlowCounters>>);

impl FlowCopies {
    /// A slot of CPU `cpu` (of `cpus`); empty slots are skipped.
    pub fn slot(&mut self, cpu: usize, cpus: usize, slot: &FlowSlot) {
        if slot.counters.counts.packets == 0 {
            return;
        }
        let c = self
            .0
            .entry(slot.key)
            .or_insert_with(|| vec![FlowCounters::default(); cpus]);
        if let Some(c) = c.get_mut(cpu) {
            *c = slot.counters;
        }
    }

    /// A flow's per-CPU values in `FLOWS`; read after every slot.
    pub fn flows_entry(&mut self, key: FlowKey, per_cpu: &[FlowCounters]) {
        let c = self
            .0
            .entry(key)
            .or_insert_with(|| vec![FlowCounters::default(); per_cpu.len()]);
        for (mine, v) in c.iter_mut().zip(per_cpu) {
            if v.counts.packets > 0 {
                *mine = *v;
            }
        }
    }

    pub fn merge(self) -> HashMap<FlowKey, FlowCounters> {
        self.0.into_iter().map(|(k, c)| (k, merge_percpu(&c))).collect()
    }
}

/// Merges per-CPU copies of one flow: sums, earliest first, newest last-seen fields.
pub fn merge_percpu(values: &[FlowCounters]) -> FlowCounters {
    let mut m = FlowCounters {
        last_pcp: PCP_NONE,
        ..FlowCounters::default()
    };
    for v in values {
        m.absorb(v);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_reject_bad_dscp_and_build_mask() {
        let mut o = DatapathOptions {
            expected_dscp: vec![26, 48],
            ..Default::default()
        };
        let c = o.config().unwrap();
        assert_eq!(c.expected_dscp_mask, (1 << 26) | (1 << 48));
        assert_eq!(c.sample_enabled, 1);
        o.expected_dscp = vec![64];
        assert!(o.config().unwrap_err().to_string().contains("DSCP 64"));
        o.expected_dscp.clear();
        o.sample_rate = 0;
        assert_eq!(o.config().unwrap().sample_enabled, 0);
    }

    #[test]
    fn the_flow_table_shrinks_with_the_cpu_count() {
        let o = DatapathOptions::default();
        assert_eq!(o.table_slots(2), 2048);
        assert_eq!(o.table_slots(42), 2048);
        assert_eq!(o.table_slots(43), 1024);
        assert_eq!(o.table_slots(64), 1024);
        assert_eq!(o.table_slots(256), 256);
        assert_eq!(o.table_slots(1 << 20), 1);
        for cpus in [1, 2, 7, 64, 100, 256, 4096] {
            let slots = o.table_slots(cpus) as usize;
            assert!(slots.is_power_of_two());
            assert!(slots == 1 || cpus * slots * size_of::<FlowSlot>() <= FLOW_TABLE_BUDGET);
        }
        let small = DatapathOptions {
            flow_slots: 5,
            ..Default::default()
        };
        assert_eq!(small.table_slots(2), 8, "rounded up to a power of two");
    }

    /// A flow's copies on different CPUs add up whether each sits in a slot or in
    /// `FLOWS`; a copy caught in both places on one CPU (being moved out of an idle slot
    /// between the reads) counts once.
    #[test]
    fn flow_copies_count_a_moving_copy_once() {
        let key = |qp| FlowKey {
            dest_qp: qp,
            ..Default::default()
        };
        let c = |packets, last_ns| FlowCounters {
            counts: Counts {
                packets,
                bytes: packets * 100,
                ..Default::default()
            },
            first_ns: 1,
            last_ns,
            ..Default::default()
        };
        let slot = |qp, counters| FlowSlot {
            key: key(qp),
            counters,
        };
        let mut copies = FlowCopies::default();
        copies.slot(0, 2, &slot(1, c(5, 10))); // QP 1 on CPU 0, being moved
        copies.slot(1, 2, &slot(1, c(7, 20))); // QP 1 on CPU 1
        copies.slot(1, 2, &slot(2, c(3, 30))); // QP 2 on CPU 1 only
        copies.slot(0, 2, &FlowSlot::default()); // an empty slot
        copies.flows_entry(key(1), &[c(5, 10), FlowCounters::default()]); // the moved copy
        copies.flows_entry(key(3), &[FlowCounters::default(), c(4, 40)]); // QP 3: no slot
        let m = copies.merge();
        assert_eq!(m.len(), 3, "{m:?}");
        assert_eq!(
            (
                m[&key(1)].counts.packets,
                m[&key(1)].counts.bytes,
                m[&key(1)].last_ns
            ),
            (12, 1200, 20)
        );
        assert_eq!(m[&key(2)].counts.packets, 3);
        assert_eq!(m[&key(3)].counts.packets, 4);
    }

    #[test]
    fn merge_takes_newest_class_and_sums_counts() {
        let a = FlowCounters {
            counts: Counts {
                packets: 2,
                bytes: 200,
                ..Default::default()
            },
            first_ns: 10,
            last_ns: 50,
            last_dscp: 26,
            ..Default::default()
        };
        let b = FlowCounters {
            counts: Counts {
                packets: 3,
                bytes: 300,
                ..Default::default()
            },
            first_ns: 5,
            last_ns: 40,
            last_dscp: 0,
            ..Default::default()
        };
        let idle = FlowCounters::default();
        let m = merge_percpu(&[a, idle, b]);
        assert_eq!(
            (
                m.counts.packets,
                m.counts.bytes,
                m.first_ns,
                m.last_ns,
                m.last_dscp
            ),
            (5, 500, 5, 50, 26)
        );
    }
}
