//! Datapath cost per packet: the real object under BPF_PROG_TEST_RUN with `repeat`, so
//! the kernel times only the program (no syscall per packet).

use roce_trace::{
    datapath::DatapathOptions,
    frame::{RoceFrame, ext},
};
use roce_trace_common::roce::op;
use roce_trace_tests::ProgTest;

pub fn run(repeat: u32) -> anyhow::Result<()> {
    let f = |opcode| RoceFrame {
        opcode,
        ..Default::default()
    };
    let kinds: Vec<(&str, Vec<u8>, u32)> = vec![
        (
            "RC WRITE MIDDLE 1 KiB, not sampled",
            RoceFrame {
                payload: vec![0; 1024],
                ..f(op::WRITE_MIDDLE)
            }
            .build(),
            0,
        ),
        (
            "RC WRITE MIDDLE 1 KiB, 1 in 1000",
            RoceFrame {
                payload: vec![0; 1024],
                ..f(op::WRITE_MIDDLE)
            }
            .build(),
            1000,
        ),
        (
            "RC WRITE MIDDLE 1 KiB, every packet sampled",
            RoceFrame {
                payload: vec![0; 1024],
                ..f(op::WRITE_MIDDLE)
            }
            .build(),
            1,
        ),
        (
            "RC ACK (AETH)",
            RoceFrame {
                ext: ext::aeth(0x1f, 1),
                ..f(op::ACKNOWLEDGE)
            }
            .build(),
            1000,
        ),
        (
            "CNP (always reported)",
            RoceFrame {
                opcode: 0x81,
                dscp: 48,
                ext: ext::cnp(),
                ..Default::default()
            }
            .build(),
            1000,
        ),
        (
            "UDP to another port (non-RoCE)",
            RoceFrame {
                udp_dport: 5000,
                ..f(op::SEND_ONLY)
            }
            .build(),
            1000,
        ),
    ];
    println!("roce-trace datapath, BPF_PROG_TEST_RUN, {repeat} iterations per row (mean ns per packet)");
    println!("{:<46} {:>8} {:>8}", "frame", "XDP ns", "TC ns");
    for (name, frame, rate) in kinds {
        let mut t = ProgTest::new(&DatapathOptions {
            sample_rate: rate,
            ..Default::default()
        });
        // A full ring is cheaper than a real sample and would flatter the numbers: when
        // every packet is sampled, run few enough that the 4 MiB ring never fills.
        let every_packet_emitted = rate == 1 || name.contains("always reported");
        let n = if every_packet_emitted {
            repeat.min(30_000)
        } else {
            repeat
        };
        let xdp = t.time_xdp(&frame, n);
        let _ = t.samples();
        let tc = t.time_tc(&frame, n);
        let _ = t.samples();
        let drops = t
            .globals()
            .total(roce_trace_common::datapath::GlobalCounter::RingbufFull);
        anyhow::ensure!(
            drops == 0,
            "{name}: {drops} ring-buffer drops would skew the figure"
        );
        println!("{:<46} {:>8} {:>8}", name, xdp.as_nanos(), tc.as_nanos());
    }
    Ok(())
}
