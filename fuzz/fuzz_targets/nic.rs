//! What a NIC reader is handed from outside: RDMA netlink replies (byte 0 = 0) and
//! `ethtool -S` text from a fixture (byte 0 = 1). Never a panic; every length checked;
//! what is parsed is no more than the bytes hold.
#![no_main]

use libfuzzer_sys::fuzz_target;
use roce_trace::{
    nic::{Driver, Source, alias, parse_ethtool_s},
    rdma_netlink::{attrs, messages, port_counters, qp_counters},
};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        let mut done = false;
        let Ok(msgs) = messages(rest, &mut done) else {
            return;
        };
        for (_, payload) in msgs {
            assert!(payload.len() <= rest.len());
            let Ok(a) = attrs(payload) else {
                continue;
            };
            if let Ok(v) = port_counters(&a) {
                // Each counter needs at least an entry, a name and an 8-byte value.
                assert!(v.len() * 16 <= payload.len());
            }
            if let Ok(v) = qp_counters(&a) {
                assert!(v.iter().map(|c| c.qps.len() + c.counters.len()).sum::<usize>() * 8 <= payload.len());
            }
        }
    } else {
        let text = String::from_utf8_lossy(rest);
        if let Ok(rows) = parse_ethtool_s(&text) {
            assert!(rows.len() <= text.lines().count());
            for (name, _) in &rows {
                for d in Driver::ALL {
                    let _ = alias(d, Source::Ethtool, name);
                }
            }
        }
    }
});
