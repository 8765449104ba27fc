//! `roce-trace capture -r FILE`: pcap and pcapng input (a NIC sniffer's capture, `-` for
//! stdin) through the same parser and the same per-packet accounting as the datapath,
//! producing the same flows, samples and JSON. The whole packet is here, so the ICRC is
//! verified too.

use std::{
    collections::HashMap,
    io::{BufReader, Read},
    path::Path,
};

use roce_trace_common::{
    account,
    datapath::*,
    parse::{Facts, INNER_HEAD_LEN, SlicePacket, load_icrc, parse_into},
};
use thiserror::Error;

use crate::{
    loader::{DatapathOptions, GlobalTotals},
    mirror::MirrorTable,
};

#[derive(Debug, Error)]
pub enum PcapError {
    #[error("reading {what} at byte offset {offset}: {source}")]
    Io {
        what: &'static str,
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    /// The datapath options the reader was given are not valid.
    #[error(transparent)]
    Options(#[from] crate::loader::DatapathError),
    #[error("opening {}: {source}", .path.display())]
    Open {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a pcap or pcapng file (magic {0:02x?})")]
    NotPcap([u8; 4]),
    #[error("truncated {what} at byte offset {offset}")]
    Truncated { what: &'static str, offset: u64 },
    #[error("bad {what} at byte offset {offset}: {why}")]
    Bad {
        what: &'static str,
        offset: u64,
        why: String,
    },
    #[error("link type {0} is not Ethernet (1); only Ethernet captures are read")]
    LinkType(u32),
    #[error("pcapng: {0}")]
    PcapNg(String),
}

/// One frame with its capture time (Unix ns).
pub struct CapturedFrame {
    pub time_ns: u64,
    pub data: Vec<u8>,
    pub orig_len: u32,
}

/// Reads every frame of a pcap or pcapng stream, calling `f` for each.
pub fn read_frames(mut r: impl Read, mut f: impl FnMut(CapturedFrame)) -> Result<u64, PcapError> {
    let mut magic = [0u8; 4];
    read_exact(&mut r, &mut magic, "file header", 0)?;
    match magic {
        [0x0a, 0x0d, 0x0d, 0x0a] => read_pcapng(std::io::Cursor::new(magic).chain(r), f),
        _ => {
            let (le, nanos) = match magic {
                [0xd4, 0xc3, 0xb2, 0xa1] => (true, false),
                [0xa1, 0xb2, 0xc3, 0xd4] => (false, false),
                [0x4d, 0x3c, 0xb2, 0xa1] => (true, true),
                [0xa1, 0xb2, 0x3c, 0x4d] => (false, true),
                m => return Err(PcapError::NotPcap(m)),
            };
            let u32_of = |b: &[u8]| {
                let a = [b[0], b[1], b[2], b[3]];
                if le {
                    u32::from_le_bytes(a)
                } else {
                    u32::from_be_bytes(a)
                }
            };
            let mut hdr = [0u8; 20];
            read_exact(&mut r, &mut hdr, "file header", 4)?;
            let linktype = u32_of(&hdr[16..20]) & 0x0fff_ffff;
            if linktype != 1 {
                return Err(PcapError::LinkType(linktype));
            }
            let mut offset = 24u64;
            let mut n = 0u64;
            loop {
                let mut rec = [0u8; 16];
                match r.read(&mut rec[..1]) {
                    Ok(0) => return Ok(n),
                    Ok(_) => {}
                    Err(source) => {
                        return Err(PcapError::Io {
                            what: "a packet record",
                            offset,
                            source,
                        });
                    }
                }
                read_exact(&mut r, &mut rec[1..], "packet record header", offset)?;
                let (sec, frac) = (u32_of(&rec[0..4]) as u64, u32_of(&rec[4..8]) as u64);
                let (incl, orig) = (u32_of(&rec[8..12]), u32_of(&rec[12..16]));
                if incl > 256 * 1024 {
                    return Err(PcapError::Bad {
                        what: "packet record",
                        offset,
                        why: format!("captured length {incl} is not plausible"),
                    });
                }
                let mut data = vec![0u8; incl as usize];
                read_exact(&mut r, &mut data, "packet data", offset + 16)?;
                let time_ns = sec * 1_000_000_000 + if nanos { frac } else { frac * 1000 };
                f(CapturedFrame {
                    time_ns,
                    data,
                    orig_len: orig,
                });
                offset += 16 + incl as u64;
                n += 1;
            }
        }
    }
}

fn read_exact(r: &mut impl Read, buf: &mut [u8], what: &'static str, offset: u64) -> Result<(), PcapError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => PcapError::Truncated { what, offset },
        _ => PcapError::Io {
            what,
            offset,
            source: e,
        },
    })
}

fn read_pcapng(r: impl Read, mut f: impl FnMut(CapturedFrame)) -> Result<u64, PcapError> {
    use pcap_file::pcapng::{
        Block, PcapNgReader, blocks::interface_description::InterfaceDescriptionOption as Opt,
    };
    let mut rd = PcapNgReader::new(r).map_err(|e| PcapError::PcapNg(format!("section header: {e}")))?;
    let mut n = 0u64;
    let mut block = 0u64;
    // Per interface: its link type, its timestamps' units per second (if_tsresol:
    // microseconds when absent, as Wireshark and tcpdump write) and its offset in seconds
    // (if_tsoffset).
    let mut ifaces: Vec<(u32, u128, u64)> = Vec::new();
    while let Some(b) = rd.next_block() {
        block += 1;
        let b = b.map_err(|e| PcapError::PcapNg(format!("block {block}: {e}")))?;
        match b {
            Block::InterfaceDescription(i) => {
                let (mut per_second, mut offset) = (1_000_000u128, 0u64);
                for o in &i.options {
                    match o {
                        Opt::IfTsResol(r) => {
                            per_second = ts_units_per_second(*r).ok_or_else(|| {
                                PcapError::PcapNg(format!(
                                    "block {block}: if_tsresol {r:#04x} is finer than this reader takes"
                                ))
                            })?;
                        }
                        Opt::IfTsOffset(s) => offset = *s,
                        _ => {}
                    }
                }
                ifaces.push((u32::from(i.linktype), per_second, offset));
            }
            Block::EnhancedPacket(p) => {
                let (lt, per_second, offset) = *ifaces.get(p.interface_id as usize).ok_or_else(|| {
                    PcapError::PcapNg(format!(
                        "block {block}: packet names interface {} that was never described",
                        p.interface_id
                    ))
                })?;
                if lt != 1 {
                    return Err(PcapError::LinkType(lt));
                }
                // The reader hands the block's 64-bit timestamp over as nanoseconds,
                // whatever unit the interface said it counts in.
                let raw = p.timestamp.as_nanos();
                let ns = raw * 1_000_000_000 / per_second + u128::from(offset) * 1_000_000_000;
                f(CapturedFrame {
                    time_ns: u64::try_from(ns).unwrap_or(u64::MAX),
                    data: p.data.to_vec(),
                    orig_len: p.original_len,
                });
                n += 1;
            }
            Block::SimplePacket(p) => {
                f(CapturedFrame {
                    time_ns: 0,
                    data: p.data.to_vec(),
                    orig_len: p.original_len,
                });
                n += 1;
            }
            _ => {}
        }
    }
    Ok(n)
}

/// if_tsresol's units per second: 10^v, or 2^v when the high bit is set (`None` past
/// what 128 bits hold).
fn ts_units_per_second(r: u8) -> Option<u128> {
    let v = u32::from(r & 0x7f);
    if r & 0x80 == 0 {
        10u128.checked_pow(v)
    } else {
        1u128.checked_shl(v)
    }
}

/// Sampled packets as pcapng, for Wireshark: one Interface Description Block per
/// observation point (its name `node/iface/direction`, nanosecond timestamps), each
/// packet's leading bytes with its original length, and a comment saying why it was
/// sampled.
pub struct PcapNgOut<W: std::io::Write> {
    w: pcap_file::pcapng::PcapNgWriter<W>,
    ids: HashMap<String, u32>,
}

impl<W: std::io::Write> PcapNgOut<W> {
    pub fn new(w: W) -> Result<Self, PcapError> {
        let w = pcap_file::pcapng::PcapNgWriter::new(w).map_err(|e| PcapError::PcapNg(e.to_string()))?;
        Ok(Self {
            w,
            ids: HashMap::new(),
        })
    }

    /// One packet seen at `point`; its interface is described on first use.
    pub fn write(
        &mut self,
        point: &str,
        time_ns: u64,
        orig_len: u32,
        data: &[u8],
        comment: String,
    ) -> Result<(), PcapError> {
        use std::borrow::Cow;

        use pcap_file::{
            DataLink,
            pcapng::blocks::{
                enhanced_packet::{EnhancedPacketBlock, EnhancedPacketOption},
                interface_description::{InterfaceDescriptionBlock, InterfaceDescriptionOption},
            },
        };
        let err = |e: pcap_file::PcapError| PcapError::PcapNg(e.to_string());
        let id = match self.ids.get(point) {
            Some(&id) => id,
            None => {
                let id = self.ids.len() as u32;
                self.w
                    .write_pcapng_block(InterfaceDescriptionBlock {
                        linktype: DataLink::ETHERNET,
                        snaplen: SAMPLE_HEAD_LEN as u32,
                        options: vec![
                            InterfaceDescriptionOption::IfName(Cow::Owned(point.to_owned())),
                            InterfaceDescriptionOption::IfDescription(Cow::Borrowed(
                                "roce-trace observation point",
                            )),
                            // pcap-file writes timestamps in nanoseconds.
                            InterfaceDescriptionOption::IfTsResol(9),
                        ],
                    })
                    .map_err(err)?;
                self.ids.insert(point.to_owned(), id);
                id
            }
        };
        self.w
            .write_pcapng_block(EnhancedPacketBlock {
                interface_id: id,
                timestamp: std::time::Duration::from_nanos(time_ns),
                original_len: orig_len.max(data.len() as u32),
                data: Cow::Borrowed(data),
                options: vec![EnhancedPacketOption::Comment(Cow::Owned(comment))],
            })
            .map_err(err)?;
        Ok(())
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.w.get_mut().flush()
    }
}

/// Flows, samples and counters of a capture, as the datapath would have made them.
#[derive(Default)]
pub struct Offline {
    pub flows: HashMap<FlowKey, (FlowState, FlowCounters)>,
    pub icrc_errors: HashMap<FlowKey, u64>,
    /// The mirror sessions of the flow keys, by id: the datapath's `MIRRORS`, filled the
    /// same way (the first session to claim an id keeps it).
    pub mirrors: MirrorTable,
    pub globals: GlobalTotals,
    pub frames: u64,
    cfg: Option<DatapathConfig>,
    /// The datapath's `MIRROR_FROM`: mirrored copies only from these (empty: any).
    mirror_from: Vec<AddrPrefix>,
}

impl Offline {
    pub fn new(opts: &DatapathOptions) -> Result<Self, PcapError> {
        let cfg = opts.config()?;
        Ok(Self {
            cfg: Some(cfg),
            mirror_from: opts.mirror_from.clone(),
            ..Self::default()
        })
    }

    /// One frame through the shared parser and accounting; `on_sample` gets what the
    /// datapath would have reported.
    pub fn frame(&mut self, fr: &CapturedFrame, mut on_sample: impl FnMut(&Sample)) {
        let cfg = self.cfg.expect("made by Offline::new");
        let dir = DIR_INGRESS;
        self.frames += 1;
        let g = &mut self.globals.0;
        let pkt = SlicePacket::new(&fr.data);
        let mut p = Default::default();
        let mut inner = [0u8; INNER_HEAD_LEN];
        if let Err(reason) = parse_into(&pkt, cfg.udp_port, &mut p, &mut inner) {
            g[reason.index(dir) as usize] += 1;
            return;
        }
        // As the datapath: a mirrored copy from outside the mirror ranges goes no further.
        if let Some(m) = p.mirror()
            && !self.mirror_from.is_empty()
            && !self.mirror_from.iter().any(|r| r.contains(&m.src))
        {
            g[GlobalCounter::MirrorRefused.index(dir) as usize] += 1;
            return;
        }
        g[GlobalCounter::RoceV2.index(dir) as usize] += 1;
        if let Some(m) = p.mirror() {
            g[GlobalCounter::Mirrored.index(dir) as usize] += 1;
            self.mirrors.insert(p.mirror_id, m);
        }
        load_icrc(&pkt, &mut p);
        let key = account::flow_key(&p, 0, dir);
        let facts = Facts::of(&p);
        let (state, counters) = self
            .flows
            .entry(key)
            .or_insert_with(|| (account::new_state(&p, &cfg), FlowCounters::default()));
        let update = if counters.counts.packets == 0 {
            account::StateUpdate::default()
        } else {
            account::update_state(state, &facts)
        };
        if update.psn_regression {
            g[GlobalCounter::PsnRegressions.index(dir) as usize] += 1;
        }
        let flow_sample_state = state.sample_state;
        account::count(
            counters,
            &facts,
            fr.orig_len.max(fr.data.len() as u32),
            fr.time_ns,
            &update,
        );
        // The ICRC, recomputed over the whole IP packet; one captured short counts as wrong.
        let icrc_ok =
            roce_trace_common::icrc::check_icrc(&fr.data, p.l3_off as usize, p.icrc()) == Some(true);
        let e = self.icrc_errors.entry(key).or_default();
        if !icrc_ok {
            *e += 1;
        }
        let reasons = account::reasons(&facts, &cfg, flow_sample_state);
        if reasons != 0 {
            g[GlobalCounter::SamplesEmitted.index(dir) as usize] += 1;
            let mut s = Sample::default();
            s.fill(&pkt, &p, &key, fr.time_ns, fr.orig_len, reasons);
            on_sample(&s);
        }
    }
}

impl Offline {
    /// Forgets the flows whose last packet is more than `idle_ns` of capture time before
    /// `now_ns`, then, past `max` flows, the least recently seen until `max` remain — as
    /// the kernel's LRU table forgets flows, so a reader of an endless stream
    /// (`tcpdump … | roce-trace agent -r -`) holds a bounded table. What was forgotten:
    /// each flow's key, last counters and ICRC errors (a flow seen again starts from
    /// zero).
    pub fn expire(&mut self, now_ns: u64, idle_ns: u64, max: usize) -> Vec<(FlowKey, FlowCounters, u64)> {
        let mut keys: Vec<FlowKey> = self
            .flows
            .iter()
            .filter(|(_, (_, c))| now_ns.saturating_sub(c.last_ns) > idle_ns)
            .map(|(k, _)| *k)
            .collect();
        let remaining = self.flows.len() - keys.len();
        if remaining > max {
            let mut by_age: Vec<(u64, FlowKey)> = self
                .flows
                .iter()
                .filter(|(_, (_, c))| now_ns.saturating_sub(c.last_ns) <= idle_ns)
                .map(|(k, (_, c))| (c.last_ns, *k))
                .collect();
            let over = remaining - max;
            by_age.select_nth_unstable(over - 1);
            keys.extend(by_age[..over].iter().map(|(_, k)| *k));
        }
        keys.into_iter()
            .filter_map(|k| {
                let (_, c) = self.flows.remove(&k)?;
                Some((k, c, self.icrc_errors.remove(&k).unwrap_or(0)))
            })
            .collect()
    }
}

/// Runs every frame of a capture through [`Offline::frame`].
pub fn analyse(
    r: impl Read,
    opts: &DatapathOptions,
    mut on_sample: impl FnMut(&Sample),
) -> Result<Offline, PcapError> {
    let mut out = Offline::new(opts)?;
    read_frames(r, |fr| out.frame(&fr, &mut on_sample))?;
    Ok(out)
}

/// Opens `path` (`-` for stdin).
pub fn open(path: &Path) -> Result<Box<dyn Read + Send>, PcapError> {
    if path == Path::new("-") {
        return Ok(Box::new(BufReader::new(std::io::stdin())));
    }
    let f = std::fs::File::open(path).map_err(|source| PcapError::Open {
        path: path.to_owned(),
        source,
    })?;
    Ok(Box::new(BufReader::new(f)))
}

#[cfg(test)]
mod pcapng_tests {
    use std::borrow::Cow;

    use pcap_file::{
        DataLink,
        pcapng::{
            PcapNgWriter,
            blocks::{
                enhanced_packet::EnhancedPacketBlock,
                interface_description::{InterfaceDescriptionBlock, InterfaceDescriptionOption as Opt},
            },
        },
    };

    use super::*;

    /// One frame on an interface described with `options`, its block's raw timestamp
    /// `raw` (in the interface's units); the time read back.
    fn time_read(options: Vec<Opt<'static>>, raw: u64) -> Result<u64, PcapError> {
        let mut w = PcapNgWriter::new(Vec::new()).unwrap();
        w.write_pcapng_block(InterfaceDescriptionBlock {
            linktype: DataLink::ETHERNET,
            snaplen: 256,
            options,
        })
        .unwrap();
        w.write_pcapng_block(EnhancedPacketBlock {
            interface_id: 0,
            // The writer puts the nanoseconds of this Duration in the block as they are.
            timestamp: std::time::Duration::from_nanos(raw),
            original_len: 60,
            data: Cow::Owned(vec![0; 60]),
            options: vec![],
        })
        .unwrap();
        let mut t = None;
        read_frames(&w.into_inner()[..], |f| t = Some(f.time_ns))?;
        Ok(t.expect("one frame"))
    }

    /// Timestamps are read in the unit each interface says (Wireshark and tcpdump write
    /// microseconds and say nothing, roce-trace writes nanoseconds and says so), with the
    /// interface's offset; a resolution no integer holds is an error.
    #[test]
    fn pcapng_timestamps_are_read_in_the_interfaces_own_unit() {
        let s = 1_700_000_000u64;
        assert_eq!(
            time_read(vec![], s * 1_000_000 + 250).unwrap(),
            s * 1_000_000_000 + 250_000
        );
        assert_eq!(
            time_read(vec![Opt::IfTsResol(6)], 1_500_000).unwrap(),
            1_500_000_000
        );
        assert_eq!(
            time_read(vec![Opt::IfTsResol(9)], 1_500_000_123).unwrap(),
            1_500_000_123
        );
        assert_eq!(time_read(vec![Opt::IfTsResol(3)], 1_500).unwrap(), 1_500_000_000);
        assert_eq!(
            time_read(vec![Opt::IfTsResol(0x83)], 12).unwrap(),
            1_500_000_000,
            "2^-3 s"
        );
        assert_eq!(
            time_read(vec![Opt::IfTsResol(9), Opt::IfTsOffset(10)], 5).unwrap(),
            10_000_000_005
        );
        assert!(time_read(vec![Opt::IfTsResol(60)], 1).is_err());
    }
}
