//! The HTTP request head parser of the collector's API (roce-trace/src/http.rs):
//! `request_target` on any head, `percent_decode` against an independent decoder
//! (the `percent-encoding` crate, `+` as a space), and `percent_encode` round-tripping.
#![no_main]

use libfuzzer_sys::fuzz_target;
use roce_trace::http::{percent_decode, percent_encode, request_target};

fuzz_target!(|data: &[u8]| {
    // What the server does with the bytes it read.
    let head = String::from_utf8_lossy(data);
    match request_target(&head) {
        Ok((path, query)) => {
            assert!(head.trim_start().starts_with("GET"));
            assert!(!path.contains('?'), "the query is split off");
            assert!(!path.chars().any(char::is_whitespace) && !query.chars().any(char::is_whitespace));
            // The collector's `id=` lookup.
            for kv in query.split('&') {
                if let Some(v) = kv.strip_prefix("id=") {
                    let _ = percent_decode(v);
                }
            }
        }
        Err(r) => assert!(r.status == 400 || r.status == 405, "status {}", r.status),
    }

    // Decoding agrees with an independent decoder.
    let spaced: Vec<u8> = head.bytes().map(|b| if b == b'+' { b' ' } else { b }).collect();
    let want =
        String::from_utf8_lossy(&percent_encoding::percent_decode(&spaced).collect::<Vec<u8>>()).into_owned();
    assert_eq!(percent_decode(&head), want, "decoding {head:?}");

    // Whatever is encoded decodes back.
    assert_eq!(percent_decode(&percent_encode(&head)), head);
});
