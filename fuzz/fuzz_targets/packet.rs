//! The shared packet parser on byte slices (`roce_trace_common::parse`) and the ICRC
//! helpers (`roce_trace::frame`).
//!
//! - Arbitrary bytes: parsing never panics and what it returns lies inside the frame;
//!   the ICRC helpers take any slice and offset; the host pipeline (`pcap::Offline`) turns
//!   the frame into samples that become records and observations.
//! - Frames built from the input by the product's frame builder (any opcode, tags, IPv4
//!   options or IPv6, extended headers, GRE/ERSPAN mirroring) parse to what was built.
#![no_main]

#[path = "common/mod.rs"]
mod common;

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use roce_trace::{
    datapath::DatapathOptions,
    frame::{check_icrc, icrc},
    observation::Observation,
    pcap::{CapturedFrame, Offline},
    record::{SampleRecord, sample_icrc_ok},
    sys::KernelClock,
};
use roce_trace_common::{
    datapath::GlobalCounter,
    parse::{INNER_HEAD_LEN, Parsed, SlicePacket, load_icrc, parse_into},
    wire::{Bth, Header, ICRC_LEN, UdpHdr},
};

fn parse(data: &[u8], vlan_tci: Option<u16>) -> Result<Parsed, GlobalCounter> {
    let pkt = SlicePacket { data, vlan_tci };
    let mut p = Parsed::default();
    let mut inner = [0u8; INNER_HEAD_LEN];
    parse_into(&pkt, 4791, &mut p, &mut inner)?;
    load_icrc(&pkt, &mut p);
    Ok(p)
}

fn raw(data: &[u8], vlan_tci: Option<u16>, off: usize) {
    // The ICRC helpers on whatever they are handed.
    let _ = icrc(data);
    let _ = icrc(data.get(off.min(data.len())..).unwrap_or_default());
    let _ = check_icrc(data, off, Some([0; 4]));

    if let Ok(p) = parse(data, vlan_tci) {
        let l3 = p.l3_off as usize;
        assert!(
            l3 < data.len(),
            "IP header offset {l3} past a {}-byte frame",
            data.len()
        );
        let udp = p.udp_len as usize;
        assert!(udp >= UdpHdr::LEN + Bth::LEN + ICRC_LEN, "UDP length {udp}");
        if let Some(stored) = p.icrc() {
            let at = p.icrc_off as usize;
            assert_eq!(&data[at..at + 4], &stored, "ICRC bytes");
            let _ = check_icrc(data, l3, Some(stored));
        }
    }

    // The host pipeline: accounting, samples, records, observations.
    let mut off = Offline::new(&DatapathOptions {
        sample_rate: 1,
        expected_dscp: vec![26, 48],
        ..Default::default()
    })
    .expect("valid options");
    let fr = CapturedFrame {
        time_ns: 1,
        data: data.to_vec(),
        orig_len: data.len() as u32,
    };
    let mut samples = Vec::new();
    off.frame(&fr, |s| samples.push(*s));
    off.frame(&fr, |s| samples.push(*s));
    for s in &samples {
        let _ = sample_icrc_ok(s);
        let r = SampleRecord::from_sample(s, &KernelClock::UNIX, "eth0");
        serde_json::to_string(&r).expect("a record serialises");
        let _ = Observation::from_sample(s, 0, KernelClock::UNIX.to_unix_ns(s.ts_ns));
    }
}

fn built(u: &mut Unstructured) -> arbitrary::Result<()> {
    let b = common::roce_frame(u)?;
    let got = parse(&b.frame, None);
    let Some(w) = b.want else {
        assert_eq!(
            got.err(),
            Some(GlobalCounter::TruncatedExtHeader),
            "too short for its extended headers"
        );
        return Ok(());
    };
    let p = got.unwrap_or_else(|e| panic!("a built frame is refused: {e:?}"));
    let s = &b.spec;
    assert_eq!(p.src, common::mapped(s.src), "src");
    assert_eq!(p.dst, common::mapped(s.dst), "dst");
    assert_eq!(p.ip_version, if s.src.is_ipv4() { 4 } else { 6 }, "IP version");
    assert_eq!((p.dscp, p.ecn, p.ttl), (s.dscp, s.ecn, s.ttl), "class and TTL");
    assert_eq!((p.udp_sport, p.udp_dport), (s.udp_sport, s.udp_dport), "ports");
    assert_eq!(p.bth, s.bth(), "BTH");
    assert_eq!(p.l3_off as usize, w.l3_off, "IP header offset");
    assert_eq!(p.vlan_depth, w.vlan_depth, "tags");
    assert_eq!(p.pcp(), w.pcp, "PCP");
    assert_eq!(
        p.mirror().map(|m| (m.addr(), m.session, m.kind)),
        w.mirror,
        "mirror session"
    );
    assert_eq!(p.mirror_id != 0, w.mirror.is_some(), "mirror id");
    assert_eq!(p.aeth().map(|a| (a.syndrome, a.msn())), w.aeth, "AETH");
    assert_eq!(p.reth_dma_len(), w.reth_dma_len, "RETH");
    assert_eq!(p.deth_src_qp(), w.deth_src_qp, "DETH");
    assert_eq!(p.icrc(), Some(w.icrc), "ICRC as stored");
    let correct = matches!(s.icrc, roce_trace::frame::IcrcMode::Correct);
    let ok = check_icrc(&b.frame, p.l3_off as usize, p.icrc());
    if correct {
        assert_eq!(ok, Some(true), "ICRC verifies");
    } else {
        assert!(ok.is_some(), "ICRC checkable");
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 4 {
        // Structured: the builder's frames.
        0 => {
            let _ = built(&mut Unstructured::new(rest));
        }
        // Raw bytes, with an offloaded VLAN tag now and then.
        m => {
            let (tci, off, frame) = match rest {
                [a, b, o, f @ ..] if m == 3 => (Some(u16::from_be_bytes([*a, *b])), *o as usize, f),
                [o, f @ ..] => (None, *o as usize, f),
                _ => (None, 0, rest),
            };
            raw(frame, tci, off);
        }
    }
});
