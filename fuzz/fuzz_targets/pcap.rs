//! The pcap/pcapng reader (roce-trace/src/pcap.rs) on arbitrary files, through the host
//! pipeline as `pcap::analyse` runs it: never a panic; an error names an offset inside the
//! file; the frames counted are the frames delivered; every sample becomes a record.
#![no_main]

use libfuzzer_sys::fuzz_target;
use roce_trace::{
    datapath::DatapathOptions,
    pcap::{Offline, PcapError, read_frames},
    record::SampleRecord,
    sys::KernelClock,
};

fuzz_target!(|data: &[u8]| {
    let mut off = Offline::new(&DatapathOptions {
        sample_rate: 1,
        ..Default::default()
    })
    .expect("valid options");
    let mut bytes = 0usize;
    let read = read_frames(data, |fr| {
        bytes += fr.data.len();
        off.frame(&fr, |s| {
            let r = SampleRecord::from_sample(s, &KernelClock::UNIX, "pcap");
            serde_json::to_string(&r).expect("a record serialises");
        });
    });
    match read {
        Ok(n) => assert_eq!(n, off.frames, "frames counted and delivered"),
        Err(PcapError::Truncated { offset, .. } | PcapError::Bad { offset, .. }) => {
            assert!(
                offset <= data.len() as u64,
                "offset {offset} past a {}-byte file",
                data.len()
            )
        }
        Err(_) => {}
    }
    assert!(bytes <= data.len(), "more frame bytes than the file holds");
    let packets: u64 = off.flows.values().map(|(_, c)| c.counts.packets).sum();
    assert!(packets <= off.frames);
});
