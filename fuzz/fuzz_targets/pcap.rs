//! The pcap/pcapng reader (roce-trace/src/pcap.rs) on arbitrary files, through the host
//! pipeline (`pcap::analyse`): never a panic; an error names what and where; the frames
//! it counts are the frames it delivered.
#![no_main]

use libfuzzer_sys::fuzz_target;
use roce_trace::{
    datapath::DatapathOptions,
    pcap::{PcapError, analyse, read_frames},
    record::SampleRecord,
    sys::KernelClock,
};

fuzz_target!(|data: &[u8]| {
    let mut delivered = 0u64;
    let mut bytes = 0usize;
    match read_frames(data, |f| {
        delivered += 1;
        bytes += f.data.len();
    }) {
        Ok(n) => assert_eq!(n, delivered, "frames counted and delivered"),
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

    let opts = DatapathOptions {
        sample_rate: 1,
        ..Default::default()
    };
    if let Ok(off) = analyse(data, &opts, |s| {
        let r = SampleRecord::from_sample(s, &KernelClock::UNIX, "pcap");
        serde_json::to_string(&r).expect("a record serialises");
    }) {
        assert_eq!(off.frames, delivered);
        let packets: u64 = off.flows.values().map(|(_, c)| c.packets).sum();
        assert!(packets <= off.frames);
    }
});
