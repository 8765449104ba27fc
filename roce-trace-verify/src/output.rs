//! A verdict as a table for people, JSON for programs, JUnit XML for CI.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::checks::{CheckResult, Load, Status};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    #[serde(rename = "type")]
    pub kind: String,
    /// Where the observations came from (report file, collector, interfaces).
    pub source: String,
    pub load: Load,
    pub flows: usize,
    pub status: Status,
    pub checks: Vec<CheckResult>,
}

impl Verdict {
    pub fn new(source: String, load: Load, flows: usize, checks: Vec<CheckResult>) -> Self {
        let status = overall(&checks);
        Self {
            kind: "verify".into(),
            source,
            load,
            flows,
            status,
            checks,
        }
    }

    /// 0 every check passed (or had nothing to judge), 1 a check failed, 3 a check
    /// could not be made (no traffic for it).
    pub fn exit_code(&self) -> u8 {
        match self.status {
            Status::Pass | Status::Skip => 0,
            Status::Fail => 1,
            Status::NoData => 3,
        }
    }
}

/// Fail beats no-data beats pass.
fn overall(checks: &[CheckResult]) -> Status {
    if checks.iter().any(|c| c.status == Status::Fail) {
        Status::Fail
    } else if checks.is_empty() || checks.iter().any(|c| c.status == Status::NoData) {
        Status::NoData
    } else {
        Status::Pass
    }
}

/// Evidence lines shown per check in the table (all of it is in the JSON).
const SHOWN: usize = 6;

pub fn table(v: &Verdict) -> String {
    let w = v.checks.iter().map(|c| c.check.len()).max().unwrap_or(5).max(5);
    let mut s = String::new();
    let _ = writeln!(s, "{:<w$}  {:<7}  EVIDENCE", "CHECK", "STATUS");
    for c in &v.checks {
        let _ = writeln!(s, "{:<w$}  {:<7}  {}", c.check, c.status.name(), c.summary);
        for e in c.evidence.iter().take(SHOWN) {
            let mut line = String::new();
            if !e.flow.is_empty() {
                let _ = write!(line, "{} ", e.flow);
            }
            if !e.at.is_empty() {
                let _ = write!(line, "at {}: ", e.at.join(" .. "));
            }
            line.push_str(&e.detail);
            let _ = writeln!(s, "{:<w$}  {:<7}    {line}", "", "");
        }
        if c.evidence.len() > SHOWN {
            let _ = writeln!(
                s,
                "{:<w$}  {:<7}    … {} more in the JSON",
                "",
                "",
                c.evidence.len() - SHOWN
            );
        }
    }
    let count = |st: Status| v.checks.iter().filter(|c| c.status == st).count();
    let _ = writeln!(
        s,
        "verdict: {} — {} passed, {} failed, {} could not be checked, {} skipped ({} flows, load {:?})",
        v.status.name(),
        count(Status::Pass),
        count(Status::Fail),
        count(Status::NoData),
        count(Status::Skip),
        v.flows,
        v.load
    );
    s
}

fn xml(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => {}
            c => o.push(c),
        }
    }
    o
}

/// JUnit XML: one test case per check; could-not-check is an error, skip a skip.
pub fn junit(v: &Verdict) -> String {
    let count = |st: Status| v.checks.iter().filter(|c| c.status == st).count();
    let mut s = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        s,
        "<testsuites name=\"roce-trace verify\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\">",
        v.checks.len(),
        count(Status::Fail),
        count(Status::NoData),
        count(Status::Skip)
    );
    let _ = writeln!(
        s,
        "  <testsuite name=\"fabric\" tests=\"{}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\">",
        v.checks.len(),
        count(Status::Fail),
        count(Status::NoData),
        count(Status::Skip)
    );
    let _ = writeln!(
        s,
        "    <properties><property name=\"source\" value=\"{}\"/></properties>",
        xml(&v.source)
    );
    for c in &v.checks {
        let _ = write!(
            s,
            "    <testcase classname=\"fabric\" name=\"{}\">",
            xml(&c.check)
        );
        let body: String = c
            .evidence
            .iter()
            .map(|e| format!("{} at {}: {}\n", e.flow, e.at.join(" .. "), e.detail))
            .collect();
        match c.status {
            Status::Pass => {}
            Status::Skip => {
                let _ = write!(s, "<skipped message=\"{}\"/>", xml(&c.summary));
            }
            Status::NoData => {
                let _ = write!(s, "<error type=\"no_data\" message=\"{}\"/>", xml(&c.summary));
            }
            Status::Fail => {
                let _ = write!(
                    s,
                    "<failure type=\"{}\" message=\"{}\">{}</failure>",
                    xml(&c.check),
                    xml(&format!("{}: {}", c.rule, c.summary)),
                    xml(&body)
                );
            }
        }
        let _ = writeln!(s, "</testcase>");
    }
    s.push_str("  </testsuite>\n</testsuites>\n");
    s
}
