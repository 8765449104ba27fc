//! The agent's config file parser (roce-trace/src/agent.rs, `AgentConfig::parse`): any
//! text is refused with a reason or parsed into a config that validates, whose interval
//! is a duration.
#![no_main]

use libfuzzer_sys::fuzz_target;
use roce_trace::agent::AgentConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match AgentConfig::parse(text) {
        Ok(c) => {
            assert_eq!(c.validate(), Ok(()));
            if let Some(i) = &c.interval {
                humantime::parse_duration(i).expect("a validated interval parses");
            }
            assert!(c.expect_dscp.iter().flatten().all(|d| *d < 64));
            assert_ne!(c.queue, Some(0));
        }
        Err(e) => assert!(!e.is_empty()),
    }
});
