//! The query decoding of the collector's API (roce-trace/src/http.rs; requests are parsed
//! by hyper): `percent_decode` against an independent decoder (the `percent-encoding`
//! crate, `+` as a space), and `percent_encode` round-tripping.
#![no_main]

use libfuzzer_sys::fuzz_target;
use roce_trace::http::{percent_decode, percent_encode};

fuzz_target!(|data: &[u8]| {
    let head = String::from_utf8_lossy(data);

    // Decoding agrees with an independent decoder.
    let spaced: Vec<u8> = head.bytes().map(|b| if b == b'+' { b' ' } else { b }).collect();
    let want =
        String::from_utf8_lossy(&percent_encoding::percent_decode(&spaced).collect::<Vec<u8>>()).into_owned();
    assert_eq!(percent_decode(&head), want, "decoding {head:?}");

    // Whatever is encoded decodes back.
    assert_eq!(percent_decode(&percent_encode(&head)), head);
});
