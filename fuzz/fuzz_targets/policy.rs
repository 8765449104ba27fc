//! The policy parser of `verify` (roce-trace/src/verify/policy.rs): any text is refused
//! with a reason or parsed; a parsed policy written back as TOML parses to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use roce_trace::verify::policy::Policy;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Policy::parse(text) {
        Ok(p) => {
            let again = toml::to_string(&p).expect("a policy serialises");
            assert_eq!(Policy::parse(&again).as_ref(), Ok(&p), "written back as\n{again}");
        }
        Err(e) => assert!(!e.is_empty()),
    }
});
