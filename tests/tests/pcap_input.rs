//! `capture -r`: a pcap or pcapng file (or stdin) through the shared parser and
//! accounting: the same flows and samples, ICRCs verified, bad files named by offset.

use std::{
    collections::BTreeMap,
    io::Write,
    process::{Command, Stdio},
};

use roce_trace_common::roce::op;
use roce_trace_gen::frame::{RoceFrame, ext};
use roce_trace_tests::*;
use serde_json::Value;

fn capture_r(input: &str, stdin: Option<&[u8]>) -> (i32, Vec<Value>, String) {
    let mut c = Proc::spawn(
        Command::new(roce_trace_bin())
            .args(["capture", "-r", input, "--json", "--sample-rate", "1"])
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    if let Some(b) = stdin {
        c.stdin.take().unwrap().write_all(b).unwrap();
    }
    let out = c.wait_with_output();
    let recs = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (
        out.status.code().unwrap_or(-1),
        recs,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_huawei_capture_yields_what_tshark_decodes_with_every_icrc_valid() {
    let Some(shared) = shared_dir() else {
        cannot_run("../shared is absent, so captures/huawei-rc-send.pcap is not available");
        return;
    };
    let pcap = shared.join("captures/huawei-rc-send.pcap");
    let (code, recs, err) = capture_r(pcap.to_str().unwrap(), None);
    assert_eq!(code, 0, "{err}");
    // tshark's view: per RoCE frame, source, QP, opcode, PSN, DSCP, ECN.
    let rows = tshark_fields(
        &pcap,
        &[
            "ip.src",
            "infiniband.bth.destqp",
            "infiniband.bth.opcode",
            "infiniband.bth.psn",
            "ip.dsfield.dscp",
            "ip.dsfield.ecn",
            "udp.dstport",
        ],
    );
    let theirs: Vec<(String, u64, u64, u64, u64, u64)> = rows
        .iter()
        .filter(|r| r[6] == "4791")
        .map(|r| {
            (
                r[0].clone(),
                u64::from_str_radix(r[1].trim_start_matches("0x"), 16).unwrap(),
                r[2].parse().unwrap(),
                r[3].parse().unwrap(),
                r[4].parse().unwrap(),
                r[5].parse().unwrap(),
            )
        })
        .collect();
    let ecn_code = |s: &str| {
        ["not_ect", "ect1", "ect0", "ce"]
            .iter()
            .position(|x| *x == s)
            .unwrap() as u64
    };
    let ours: Vec<(String, u64, u64, u64, u64, u64)> = recs
        .iter()
        .filter(|r| r["type"] == "sample")
        .map(|r| {
            (
                r["src_ip"].as_str().unwrap().to_owned(),
                r["dst_qp"].as_u64().unwrap(),
                r["opcode"].as_u64().unwrap(),
                r["psn"].as_u64().unwrap(),
                r["dscp"].as_u64().unwrap(),
                ecn_code(r["ecn"].as_str().unwrap()),
            )
        })
        .collect();
    assert_eq!(ours.len(), 105);
    assert_eq!(ours, theirs, "every RoCEv2 frame, in order, as tshark decodes it");
    // Flows: the per-(source, QP) counts tshark implies, all ICRCs valid.
    let mut want: BTreeMap<(String, u64), u64> = BTreeMap::new();
    for t in &theirs {
        *want.entry((t.0.clone(), t.1)).or_default() += 1;
    }
    let got: BTreeMap<(String, u64), u64> = recs
        .iter()
        .filter(|r| r["type"] == "flow")
        .map(|r| {
            (
                (
                    r["src_ip"].as_str().unwrap().to_owned(),
                    r["dst_qp"].as_u64().unwrap(),
                ),
                r["packets"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, want);
    assert!(
        recs.iter()
            .filter(|r| r["type"] == "flow")
            .all(|r| r["icrc_errors"] == 0 && r["ecn"]["ect0"] == r["packets"])
    );
    let summary = recs.iter().find(|r| r["type"] == "summary").unwrap();
    assert_eq!(summary["counters"]["ingress"]["frames_seen"], 123);
    assert_eq!(summary["counters"]["ingress"]["non_roce"], 18);
    // The parser's own counts, exact: not the interface's.
    assert!(summary.get("frames_from").is_none(), "{summary}");
}

#[test]
fn stdin_pcapng_and_corruption() {
    let dir = TempDir::new("pcapin");
    let frames: Vec<Vec<u8>> = (0..20)
        .map(|psn| {
            RoceFrame {
                psn,
                ext: ext::reth(0, 1, 64),
                payload: vec![psn as u8; 64],
                ..RoceFrame {
                    opcode: op::WRITE_ONLY,
                    ..Default::default()
                }
            }
            .build()
        })
        .collect();
    let mut bad = frames.clone();
    bad[7][60] ^= 0xff; // a payload byte flipped in flight
    let pcap = dir.path("f.pcap");
    write_pcap(&pcap, &bad);
    let bytes = std::fs::read(&pcap).unwrap();
    // From a file and from stdin: the same records.
    let (code, from_file, err) = capture_r(pcap.to_str().unwrap(), None);
    assert_eq!(code, 0, "{err}");
    let (code, from_stdin, _) = capture_r("-", Some(&bytes));
    assert_eq!(code, 0);
    let strip = |v: &[Value]| -> Vec<Value> {
        v.iter()
            .filter(|r| r["type"] != "summary")
            .map(|r| {
                let mut r = r.clone();
                r["iface"] = Value::Null;
                r
            })
            .collect()
    };
    assert_eq!(strip(&from_file), strip(&from_stdin));
    let flow = from_file.iter().find(|r| r["type"] == "flow").unwrap();
    assert_eq!(flow["packets"], 20);
    assert_eq!(flow["icrc_errors"], 1, "the corrupted packet's ICRC is wrong");

    // pcapng, as Wireshark and recent tcpdump write it.
    let ng = dir.path("f.pcapng");
    {
        use pcap_file::pcapng::{
            PcapNgWriter, blocks::enhanced_packet::EnhancedPacketBlock,
            blocks::interface_description::InterfaceDescriptionBlock,
        };
        let mut w = PcapNgWriter::new(std::fs::File::create(&ng).unwrap()).unwrap();
        w.write_pcapng_block(InterfaceDescriptionBlock {
            linktype: pcap_file::DataLink::ETHERNET,
            snaplen: 0xffff,
            options: vec![],
        })
        .unwrap();
        for (i, f) in frames.iter().enumerate() {
            w.write_pcapng_block(EnhancedPacketBlock {
                interface_id: 0,
                timestamp: std::time::Duration::from_millis(i as u64),
                original_len: f.len() as u32,
                data: f.as_slice().into(),
                options: vec![],
            })
            .unwrap();
        }
    }
    let (code, ngrecs, err) = capture_r(ng.to_str().unwrap(), None);
    assert_eq!(code, 0, "{err}");
    let flow = ngrecs.iter().find(|r| r["type"] == "flow").unwrap();
    assert_eq!(
        (flow["packets"].as_u64(), flow["icrc_errors"].as_u64()),
        (Some(20), Some(0))
    );
}

#[test]
fn truncated_and_garbage_files_name_the_offset() {
    let dir = TempDir::new("pcapbad");
    let frames: Vec<Vec<u8>> = (0..3)
        .map(|psn| {
            RoceFrame {
                psn,
                ..Default::default()
            }
            .build()
        })
        .collect();
    let pcap = dir.path("ok.pcap");
    write_pcap(&pcap, &frames);
    let bytes = std::fs::read(&pcap).unwrap();
    // Cut inside the third packet's data: 24 + 2 × (16 + 60) + 16 + 10.
    let cut = dir.path("cut.pcap");
    std::fs::write(&cut, &bytes[..24 + 2 * 76 + 16 + 10]).unwrap();
    let (code, _, err) = capture_r(cut.to_str().unwrap(), None);
    assert_eq!(code, 1);
    // The third record starts at 24 + 2 × 76 = 176; its data at 192.
    assert!(err.contains("truncated packet data at byte offset 192"), "{err}");
    let junk = dir.path("junk.pcap");
    std::fs::write(&junk, b"this is not a capture at all").unwrap();
    let (code, _, err) = capture_r(junk.to_str().unwrap(), None);
    assert_eq!(code, 1);
    assert!(err.contains("not a pcap or pcapng file"), "{err}");
    let (code, _, err) = capture_r("/nonexistent.pcap", None);
    assert_eq!(code, 1);
    assert!(err.contains("opening /nonexistent.pcap"), "{err}");
}

/// Mirrored copies in a pcap (an analyser host's capture of ERSPAN/GRE from switches):
/// decapsulated by the same parser as XDP, one flow per mirror session, ICRCs verified on
/// the inner packet, cut-short encapsulation counted; cross-checked against scapy's
/// ERSPAN decoding.
#[test]
fn mirrored_copies_decapsulate_per_session_in_the_pcap_path() {
    use roce_trace_gen::frame::Mirror;
    let s1 = "198.51.100.7".parse().unwrap();
    let s2 = "198.51.100.8".parse().unwrap();
    let analyser = "192.0.2.100".parse().unwrap();
    let pkt = |psn: u32, ttl: u8| {
        RoceFrame {
            psn,
            ttl,
            dest_qp: 0x42,
            payload: vec![psn as u8; 100],
            ..Default::default()
        }
        .build()
    };
    let mut frames = Vec::new();
    for psn in 0..4 {
        frames.push(
            Mirror::ErspanII {
                session: 10,
                seq: psn,
                index: 2,
            }
            .encapsulate(s1, analyser, &pkt(psn, 63)),
        );
        frames.push(
            Mirror::ErspanIII {
                session: 20,
                seq: psn,
                timestamp: psn,
                platform: true,
            }
            .encapsulate(s2, analyser, &pkt(psn, 62)),
        );
        frames.push(Mirror::GreEthernet { key: Some(30) }.encapsulate(s2, analyser, &pkt(psn, 62)));
    }
    let cut = Mirror::ErspanII {
        session: 10,
        seq: 9,
        index: 2,
    }
    .encapsulate(s1, analyser, &pkt(9, 63));
    frames.push(cut[..14 + 20 + 8 + 3].to_vec());
    let dir = TempDir::new("rt7-mirror-pcap");
    let pcap = dir.path("mirrored.pcap");
    write_pcap(&pcap, &frames);
    let (code, recs, err) = capture_r(pcap.to_str().unwrap(), None);
    assert_eq!(code, 0, "{err}");
    let flows: Vec<&Value> = recs.iter().filter(|r| r["type"] == "flow").collect();
    let mut by_session: BTreeMap<(String, u64, String), (u64, u64, u64)> = BTreeMap::new();
    for f in &flows {
        assert_eq!(
            (f["src_ip"].as_str(), f["dst_qp"].as_u64()),
            (Some("10.0.0.1"), Some(0x42))
        );
        let m = &f["mirror"];
        by_session.insert(
            (
                m["src_ip"].as_str().unwrap().to_owned(),
                m["session"].as_u64().unwrap(),
                m["kind"].as_str().unwrap().to_owned(),
            ),
            (
                f["packets"].as_u64().unwrap(),
                f["ttl"].as_u64().unwrap(),
                f["icrc_errors"].as_u64().unwrap(),
            ),
        );
    }
    let want: BTreeMap<(String, u64, String), (u64, u64, u64)> = [
        (("198.51.100.7".to_owned(), 10, "erspan2".to_owned()), (4, 63, 0)),
        (("198.51.100.8".to_owned(), 20, "erspan3".to_owned()), (4, 62, 0)),
        (("198.51.100.8".to_owned(), 30, "gre".to_owned()), (4, 62, 0)),
    ]
    .into();
    assert_eq!(
        by_session, want,
        "one flow per mirror session, inner TTL, ICRC valid"
    );
    let samples: Vec<&Value> = recs.iter().filter(|r| r["type"] == "sample").collect();
    assert_eq!(samples.len(), 12);
    assert!(
        samples
            .iter()
            .all(|s| s["mirror"].is_object() && s["dst_qp"] == 0x42)
    );
    let summary = recs.iter().find(|r| r["type"] == "summary").unwrap();
    assert_eq!(summary["counters"]["ingress"]["mirrored"], 12);
    assert_eq!(summary["parse_failures"]["truncated_encap"], 1);

    // scapy decodes the same sessions and inner packets from the same bytes.
    let script = r#"
import sys
from scapy.all import rdpcap, IP, GRE, UDP
from scapy.contrib.erspan import ERSPAN_II, ERSPAN_III
for p in rdpcap(sys.argv[1]):
    if ERSPAN_II in p: sess = p[ERSPAN_II].session_id
    elif ERSPAN_III in p: sess = p[ERSPAN_III].session_id
    elif GRE in p and p[GRE].key_present: sess = p[GRE].key
    else: continue
    inner = p.getlayer(IP, nb=2)
    if inner is None: continue
    print(p[IP].src, sess, inner.src, inner.ttl)
"#;
    let theirs = python_lines(&["-c".as_ref(), script.as_ref(), pcap.as_os_str()]);
    let ours: Vec<String> = samples
        .iter()
        .map(|s| {
            format!(
                "{} {} {} {}",
                s["mirror"]["src_ip"].as_str().unwrap(),
                s["mirror"]["session"],
                s["src_ip"].as_str().unwrap(),
                s["ttl"]
            )
        })
        .collect();
    assert_eq!(ours, theirs, "scapy's ERSPAN/GRE decoding");
}

/// A reader of an endless stream (`tcpdump … | roce-trace capture -r -`) holds a bounded
/// table: a flow idle for 2 minutes of capture time gets its final record then, mid-stream,
/// and is forgotten; the summary still counts every flow and packet. One packet of flow A
/// at 0 s, then 5,000 of flow B from 130 s: A's final record comes before B's later
/// samples. Fails if idle flows are kept to the end (A's record comes last).
#[test]
fn capture_of_a_stream_gives_idle_flows_their_final_record_and_forgets_them() {
    use std::time::Duration;
    let dir = TempDir::new("pcap-idle");
    let flow = |sport: u16, psn: u32| {
        roce_trace_gen::frame::RoceFrame {
            udp_sport: sport,
            psn,
            ..Default::default()
        }
        .build()
    };
    let mut frames = vec![(Duration::from_secs(1_700_000_000), flow(50_001, 0))];
    for i in 0..5_000u32 {
        frames.push((
            Duration::from_secs(1_700_000_130) + Duration::from_micros(u64::from(i)),
            flow(50_002, i),
        ));
    }
    let pcap = dir.path("stream.pcap");
    write_pcap_at(&pcap, &frames);
    let out = std::process::Command::new(roce_trace_bin())
        .args(["capture", "--json", "--sample-rate", "1", "-r"])
        .arg(&pcap)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let recs: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let pos = |pred: &dyn Fn(&serde_json::Value) -> bool| recs.iter().rposition(pred).unwrap();
    let a_final = pos(&|r| r["type"] == "flow" && r["udp_sport"] == 50_001);
    let last_b_sample = pos(&|r| r["type"] == "sample" && r["udp_sport"] == 50_002);
    assert!(
        a_final < last_b_sample,
        "A's final record came at the end ({a_final} > {last_b_sample})"
    );
    assert_eq!(recs[a_final]["packets"], 1);
    assert_eq!(recs[a_final]["final"], true);
    let summary = recs.last().unwrap();
    assert_eq!(summary["type"], "summary");
    assert_eq!(summary["flows"], 2, "{summary}");
    assert_eq!(summary["packets"], 5_001, "{summary}");
}
