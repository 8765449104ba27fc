//! The shipped service definitions stay hardened and agree with each other: the systemd
//! units' exposure as `systemd-analyze security` rates it, and the Kubernetes manifests'
//! capabilities against the agent unit's.

use std::process::Command;

use roce_trace_tests::*;

fn dist(f: &str) -> String {
    std::fs::read_to_string(format!("{}/../dist/{f}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// The exposure `systemd-analyze security` gives a unit file (0 best, 10 worst).
fn exposure(unit: &str) -> Option<f64> {
    let path = format!("{}/../dist/{unit}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", &path])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.split("Overall exposure level for ").nth(1))
        .and_then(|r| r.split(':').nth(1)?.split_whitespace().next()?.parse().ok())
}

/// Both units rate "OK" and better than the README says they do (agent 1.9, collector
/// 1.1): loosening one (a capability, a Protect*= or the system-call filter gone) fails.
#[test]
fn the_units_stay_hardened() {
    let (Some(agent), Some(collector)) = (
        exposure("roce-trace-agent.service"),
        exposure("roce-trace-collector.service"),
    ) else {
        cannot_run("systemd-analyze security --offline is not available");
        return;
    };
    assert!(agent <= 1.9, "agent unit exposure {agent}");
    assert!(collector <= 1.1, "collector unit exposure {collector}");
}

/// The capabilities a unit or manifest lists, without the CAP_ prefix.
fn caps_of(line: &str) -> Vec<String> {
    let mut v: Vec<String> = line
        .split(|c: char| c == ',' || c == '[' || c == ']' || c.is_whitespace())
        .filter(|w| !w.is_empty())
        .map(|w| w.trim_start_matches("CAP_").to_owned())
        .collect();
    v.sort();
    v
}

/// The DaemonSet gives the agent the unit's capabilities (plus SETUID and SETGID to
/// become --user), drops all others, uses the host's network and drops to a user; the
/// collector's Deployment holds no capability; the agent unit's bounding set is its
/// ambient set.
#[test]
fn the_manifests_give_what_the_unit_gives() {
    let unit = dist("roce-trace-agent.service");
    let field = |k: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or_else(|| panic!("{k}"))
    };
    let ambient = caps_of(field("AmbientCapabilities="));
    assert_eq!(ambient, caps_of(field("CapabilityBoundingSet=")));
    assert_eq!(ambient, ["BPF", "NET_ADMIN", "NET_RAW", "PERFMON"]);
    let ds = dist("k8s/agent-daemonset.yaml");
    let add = ds
        .lines()
        .find_map(|l| l.trim().strip_prefix("add:"))
        .expect("capabilities to add");
    let mut want = ambient.clone();
    want.extend(["SETGID".to_owned(), "SETUID".to_owned()]);
    want.sort();
    assert_eq!(caps_of(add), want);
    for must in [
        "hostNetwork: true",
        "drop: [ALL]",
        "--user=65534",
        "allowPrivilegeEscalation: false",
        "readOnlyRootFilesystem: true",
    ] {
        assert!(ds.contains(must), "the DaemonSet lacks `{must}`");
    }
    let c = dist("k8s/collector.yaml");
    assert!(
        c.contains("capabilities: {drop: [ALL]}") && !c.contains("add:"),
        "{c}"
    );
    assert!(dist("roce-trace-collector.service").contains("\nCapabilityBoundingSet=\n"));
}
