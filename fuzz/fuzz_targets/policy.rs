//! The policy parser of `verify` (roce-trace-verify/src/policy.rs): any text is refused
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
            match Policy::parse(&again) {
                Ok(q) => assert_eq!(q, p, "written back as\n{again}"),
                Err(e) => panic!("written back as\n{again}\nit does not parse: {e}"),
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
