//! Baselines: the paths, classes and spreads of a known-good window, and what changed
//! since — a flow that moved, a class that changed, a path that vanished, a spread that
//! degraded.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use serde::{Deserialize, Serialize};

use crate::checks::{CheckResult, Evidence, Role, Status, role, stability};
use roce_trace_correlate::{CollectorReport, Point, path_nodes};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FlowBase {
    /// Nodes in path order (interfaces and directions vary less than names matter).
    pub path: Vec<String>,
    /// DSCP at each point.
    pub class: BTreeMap<Point, u8>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    #[serde(rename = "type")]
    pub kind: String,
    pub flows: BTreeMap<String, FlowBase>,
    /// Per host pair (`src -> dst`), the distinct paths its data flows took.
    pub paths: BTreeMap<String, BTreeSet<Vec<String>>>,
    /// Worst per-host-pair throughput spread of the data flows.
    pub spread: Option<f64>,
}

fn nodes(path: &[Point]) -> Vec<String> {
    path_nodes(path).into_iter().map(str::to_owned).collect()
}

fn pair(src: &IpAddr, dst: &IpAddr) -> String {
    format!("{src} -> {dst}")
}

impl Baseline {
    pub fn of(report: &CollectorReport, min_packets: u64) -> Self {
        let mut b = Baseline {
            kind: "verify_baseline".into(),
            ..Default::default()
        };
        for f in report.flows.iter().filter(|f| !f.path.is_empty()) {
            b.flows.insert(
                f.id.clone(),
                FlowBase {
                    path: nodes(&f.path),
                    class: f.class.iter().map(|c| (c.point.clone(), c.dscp)).collect(),
                },
            );
            if role(f) == Some(Role::Data) {
                b.paths
                    .entry(pair(&f.src_ip, &f.dst_ip))
                    .or_default()
                    .insert(nodes(&f.path));
            }
        }
        let data: Vec<_> = report
            .flows
            .iter()
            .filter(|f| role(f) == Some(Role::Data))
            .collect();
        b.spread = stability(&data, 1.0, min_packets).1;
        b
    }

    /// The baseline as written to a file (pretty JSON).
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("a baseline serialises")
    }

    /// A baseline read back; `name` (its file) is quoted in errors.
    pub fn from_json(text: &str, name: &str) -> Result<Self, crate::DocumentError> {
        crate::document(
            text,
            name,
            ("baseline", "roce-trace baseline", "verify_baseline"),
            |b: &Baseline| &b.kind,
        )
    }

    /// What changed from this baseline to `now`.
    pub fn compare(&self, now: &Baseline, max_spread_growth: f64) -> CheckResult {
        let mut r = CheckResult {
            check: "baseline".into(),
            rule: format!("paths and classes as in the baseline, spread at most {max_spread_growth} worse"),
            status: Status::Pass,
            checked: 0,
            summary: String::new(),
            evidence: Vec::new(),
        };
        let ev = |flow: &str, at: Vec<String>, detail: String| Evidence {
            flow: flow.to_owned(),
            at,
            detail,
        };
        let mut gone = 0;
        for (id, b) in &self.flows {
            let Some(n) = now.flows.get(id) else {
                gone += 1;
                continue;
            };
            r.checked += 1;
            if n.path != b.path {
                r.evidence.push(ev(
                    id,
                    n.path.clone(),
                    format!("moved from {} to {}", b.path.join(" > "), n.path.join(" > ")),
                ));
            }
            for (point, dscp) in &n.class {
                if let Some(was) = b.class.get(point)
                    && was != dscp
                {
                    r.evidence
                        .push(ev(id, vec![point.to_string()], format!("DSCP {was} -> {dscp}")));
                }
            }
        }
        for (pair, paths) in &self.paths {
            // Only host pairs that carry traffic now can show a path gone.
            let Some(now_paths) = now.paths.get(pair) else {
                continue;
            };
            for p in paths.difference(now_paths) {
                r.evidence.push(ev(
                    "",
                    p.clone(),
                    format!("{pair}: path {} no longer used", p.join(" > ")),
                ));
            }
        }
        if let (Some(was), Some(is)) = (self.spread, now.spread)
            && is > was + max_spread_growth
        {
            r.evidence.push(ev(
                "",
                Vec::new(),
                format!(
                    "throughput spread {:.1}% (baseline {:.1}%)",
                    is * 100.0,
                    was * 100.0
                ),
            ));
        }
        let new = now.flows.keys().filter(|k| !self.flows.contains_key(*k)).count();
        r.summary = format!(
            "{} flow(s) compared, {} change(s); {gone} baseline flow(s) not seen, {new} new",
            r.checked,
            r.evidence.len()
        );
        r.status = if r.checked == 0 && now.paths.is_empty() {
            r.summary = format!("no baseline flow seen; {new} new");
            Status::NoData
        } else if r.evidence.is_empty() {
            Status::Pass
        } else {
            Status::Fail
        };
        r
    }
}
