//! Continuous verification: the checks judged window after window, a check's status
//! changing only when its windows agree for long enough, and every change an event.
//!
//! Pure: the caller (the collector) cuts the windows, judges them with
//! [`crate::checks::judge`] and gives each window's results to a [`Tracker`]; the tracker
//! says what changed. No clock is read here: every time is the caller's (Unix ms).
//!
//! **Flapping.** A check's status is one of three kinds of health — ok (pass, or skip:
//! nothing to judge arose), failing, and unjudged (no data) — and its established status
//! moves to another kind only after `fail_after` consecutive windows of that kind: it
//! must fail for `fail_after` windows in a row before it counts as failing, and pass (or
//! skip) for as many before it recovers. Moves within a kind (pass ↔ skip) change the
//! status shown but are not events. Until `fail_after` windows agree, a check has no
//! established status (it is pending); windows without data before its first judged one
//! do not count towards one (the collector has not seen the traffic yet: an alert on
//! metrics says when that lasts). The first status is an event of its own (`from: null`),
//! alerting only when it fails.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::checks::{CheckResult, Evidence, Status};

/// Evidence kept per change (the rest is counted in [`Change::evidence_total`]): an event
/// is bounded whatever the fabric does.
pub const EVIDENCE_KEPT: usize = 32;

/// What a status says about the fabric, for flapping and events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Pass, or skip (the condition the check judges did not arise).
    Ok,
    Failing,
    /// No data: the check could not be made.
    Unjudged,
}

impl Health {
    pub fn of(s: Status) -> Self {
        match s {
            Status::Pass | Status::Skip => Health::Ok,
            Status::Fail => Health::Failing,
            Status::NoData => Health::Unjudged,
        }
    }
}

/// A judged window: what happened between `start_ms` and `end_ms` (Unix ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    pub start_ms: u64,
    pub end_ms: u64,
}

/// One check as the windows so far leave it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckState {
    pub check: String,
    pub rule: String,
    /// The established status (`None` until `fail_after` windows agreed).
    pub status: Option<Status>,
    /// When the established status's run of windows began (the end of its first window).
    pub since_ms: Option<u64>,
    /// When the established status last changed (the window that made it).
    pub changed_ms: Option<u64>,
    /// The latest window's own status, its summary, the flows or items judged and the
    /// distinct flows or items its evidence names.
    pub latest: Status,
    pub summary: String,
    pub checked: usize,
    pub failing_items: usize,
    /// Consecutive windows, up to the latest, whose own status failed.
    pub failing_windows: u64,
    /// The latest window's failing items, at most [`EVIDENCE_KEPT`].
    pub items: Vec<String>,
    /// A move under way: the kind of health, how many windows in a row, since when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moving: Option<(Health, u32, u64)>,
}

impl CheckState {
    /// A check first seen, with no established status yet (its other fields are set by
    /// the window or the history entry that names it).
    fn new(check: &str, rule: &str, latest: Status) -> Self {
        Self {
            check: check.into(),
            rule: rule.into(),
            status: None,
            since_ms: None,
            changed_ms: None,
            latest,
            summary: String::new(),
            checked: 0,
            failing_items: 0,
            failing_windows: 0,
            items: Vec::new(),
            moving: None,
        }
    }
}

/// A check's established status changing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Change {
    pub check: String,
    pub rule: String,
    /// `None`: the check's first established status.
    pub from: Option<Status>,
    pub to: Status,
    /// When the run of windows that made the change began (the end of its first window):
    /// the fault (or the repair) is at most a window older than this.
    pub began_ms: u64,
    pub summary: String,
    pub checked: usize,
    /// The window's evidence, at most [`EVIDENCE_KEPT`] pieces, and how many there were.
    pub evidence: Vec<Evidence>,
    pub evidence_total: usize,
}

impl Change {
    /// Worth telling someone: every change but a first status that is ok.
    pub fn alerts(&self) -> bool {
        self.from.is_some() || self.to == Status::Fail
    }
}

/// Every change one window made, with the window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    #[serde(rename = "type")]
    pub kind: String,
    /// Numbered from 1 for this history, in order.
    pub seq: u64,
    /// When it was judged (Unix ms).
    pub at_ms: u64,
    pub window: Window,
    /// Flows in the window.
    pub flows: usize,
    pub changes: Vec<Change>,
}

impl Event {
    /// The event without its first-status-ok changes (what an alert receiver is sent),
    /// or `None` when nothing in it alerts.
    pub fn alerting(&self) -> Option<Event> {
        let changes: Vec<Change> = self.changes.iter().filter(|c| c.alerts()).cloned().collect();
        (!changes.is_empty()).then(|| Event {
            changes,
            ..self.clone()
        })
    }
}

/// The distinct flows (or, for fabric-wide evidence, the places) evidence names.
pub fn failing_items(evidence: &[Evidence]) -> BTreeSet<String> {
    evidence
        .iter()
        .map(|e| {
            if e.flow.is_empty() {
                e.at.join(" .. ")
            } else {
                e.flow.clone()
            }
        })
        .collect()
}

/// The checks' states over the windows judged, and the events they made.
#[derive(Clone, Debug)]
pub struct Tracker {
    fail_after: u32,
    checks: BTreeMap<String, CheckState>,
    next_seq: u64,
}

impl Tracker {
    /// `fail_after`: windows in a row a new kind of health must hold (at least 1).
    pub fn new(fail_after: u32) -> Self {
        Self {
            fail_after: fail_after.max(1),
            checks: BTreeMap::new(),
            next_seq: 1,
        }
    }

    /// A tracker that goes on from a history (oldest first): each check's established
    /// status is its last change's, and events are numbered after the last. A check that
    /// was failing when the history ended is still failing until `fail_after` windows
    /// say otherwise: a restart neither repeats its alert nor forgets it.
    pub fn resume<'a>(fail_after: u32, history: impl IntoIterator<Item = &'a Event>) -> Self {
        let mut t = Self::new(fail_after);
        for e in history {
            t.next_seq = t.next_seq.max(e.seq + 1);
            for c in &e.changes {
                let s = t
                    .checks
                    .entry(c.check.clone())
                    .or_insert_with(|| CheckState::new(&c.check, &c.rule, c.to));
                s.status = Some(c.to);
                s.since_ms = Some(c.began_ms);
                s.changed_ms = Some(e.at_ms);
                s.latest = c.to;
                s.summary = c.summary.clone();
                s.checked = c.checked;
                let items = failing_items(&c.evidence);
                s.failing_items = if c.evidence_total > c.evidence.len() {
                    c.evidence_total
                } else {
                    items.len()
                };
                s.items = items.into_iter().take(EVIDENCE_KEPT).collect();
            }
        }
        t
    }

    /// Every check seen, by name.
    pub fn states(&self) -> impl Iterator<Item = &CheckState> {
        self.checks.values()
    }

    /// One window's results: each check's state moves on, and the changes it made are
    /// an event (`None`: nothing changed). A check the window does not judge keeps its
    /// state.
    pub fn window(
        &mut self,
        window: Window,
        at_ms: u64,
        flows: usize,
        results: &[CheckResult],
    ) -> Option<Event> {
        let fail_after = self.fail_after;
        let mut changes = Vec::new();
        for r in results {
            let s = self
                .checks
                .entry(r.check.clone())
                .or_insert_with(|| CheckState::new(&r.check, &r.rule, r.status));
            let items = failing_items(&r.evidence);
            s.rule = r.rule.clone();
            s.latest = r.status;
            s.summary = r.summary.clone();
            s.checked = r.checked;
            s.failing_items = items.len();
            s.items = items.into_iter().take(EVIDENCE_KEPT).collect();
            s.failing_windows = if r.status == Status::Fail {
                s.failing_windows + 1
            } else {
                0
            };
            let h = Health::of(r.status);
            if s.status.is_none() && h == Health::Unjudged {
                // Not judged yet (the collector has not seen the traffic): no status to
                // establish, nothing to count towards one.
                s.moving = None;
                continue;
            }
            if s.status.map(Health::of) == Some(h) {
                // The same kind of health: shown as it is now, not an event.
                s.status = Some(r.status);
                s.moving = None;
                continue;
            }
            let (count, began) = match s.moving {
                Some((m, n, began)) if m == h => (n + 1, began),
                _ => (1, window.end_ms),
            };
            if count < fail_after {
                s.moving = Some((h, count, began));
                continue;
            }
            changes.push(Change {
                check: r.check.clone(),
                rule: r.rule.clone(),
                from: s.status,
                to: r.status,
                began_ms: began,
                summary: r.summary.clone(),
                checked: r.checked,
                evidence: r.evidence.iter().take(EVIDENCE_KEPT).cloned().collect(),
                evidence_total: r.evidence.len(),
            });
            s.status = Some(r.status);
            s.since_ms = Some(began);
            s.changed_ms = Some(at_ms);
            s.moving = None;
        }
        if changes.is_empty() {
            return None;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        Some(Event {
            kind: "verdict_change".into(),
            seq,
            at_ms,
            window,
            flows,
            changes,
        })
    }
}

/// What `/verdicts` answers: how the collector judges, every check's state, and the
/// history of changes (oldest first).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdicts {
    #[serde(rename = "type")]
    pub kind: String,
    /// Whether this collector (in a group: some member) is judging now.
    pub judging: bool,
    /// The policy file judged.
    pub policy: String,
    pub every_ms: u64,
    pub window_ms: u64,
    pub fail_after: u32,
    pub load: crate::checks::Load,
    /// Windows judged since the collector started.
    pub windows: u64,
    pub last_window: Option<Window>,
    pub checks: Vec<CheckState>,
    pub events: Vec<Event>,
}

impl Verdicts {
    /// Only `check` (its state, and its changes in the events that have one), and only
    /// events judged at or after `since_ms`.
    pub fn select(mut self, check: Option<&str>, since_ms: Option<u64>) -> Self {
        if let Some(since) = since_ms {
            self.events.retain(|e| e.at_ms >= since);
        }
        if let Some(name) = check {
            self.checks.retain(|c| c.check == name);
            self.events.retain_mut(|e| {
                e.changes.retain(|c| c.check == name);
                !e.changes.is_empty()
            });
        }
        self
    }
}

/// A stretch of time a check was not ok.
#[derive(Clone, Debug, PartialEq)]
pub struct Stretch {
    pub check: String,
    pub health: Health,
    /// When its run of windows began, and when the run that ended it began (`None`:
    /// still so at the last window).
    pub from_ms: u64,
    pub until_ms: Option<u64>,
    /// The change that began it (its evidence, summary).
    pub began: Change,
}

/// Every stretch in which a check was failing or could not be judged that overlaps
/// `[since_ms, ..)`, in order of their start, from a history (oldest first).
pub fn stretches(events: &[Event], since_ms: u64) -> Vec<Stretch> {
    let mut open: BTreeMap<String, Stretch> = BTreeMap::new();
    let mut out = Vec::new();
    for e in events {
        for c in &e.changes {
            if let Some(mut s) = open.remove(&c.check) {
                s.until_ms = Some(c.began_ms);
                out.push(s);
            }
            let h = Health::of(c.to);
            if h != Health::Ok {
                open.insert(
                    c.check.clone(),
                    Stretch {
                        check: c.check.clone(),
                        health: h,
                        from_ms: c.began_ms,
                        until_ms: None,
                        began: c.clone(),
                    },
                );
            }
        }
    }
    out.extend(open.into_values());
    out.retain(|s| s.until_ms.is_none_or(|u| u >= since_ms));
    out.sort_by(|a, b| (a.from_ms, &a.check).cmp(&(b.from_ms, &b.check)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(check: &str, status: Status, flows: &[&str]) -> CheckResult {
        CheckResult {
            check: check.into(),
            rule: format!("rule of {check}"),
            status,
            checked: 4,
            summary: format!("{} failing", flows.len()),
            evidence: flows
                .iter()
                .map(|f| Evidence {
                    flow: (*f).into(),
                    at: vec!["s1:l1:ingress".into(), "s1:l2:egress".into()],
                    detail: "DSCP 26 -> 0".into(),
                })
                .collect(),
        }
    }

    /// Runs `statuses` of one check (P pass, S skip, F fail, N no data) through a
    /// tracker, a window a second; the events, each as (window index, from, to).
    fn run(fail_after: u32, statuses: &str) -> Vec<(usize, Option<Status>, Status)> {
        let mut t = Tracker::new(fail_after);
        let mut out = Vec::new();
        for (i, c) in statuses.chars().enumerate() {
            let s = match c {
                'P' => Status::Pass,
                'S' => Status::Skip,
                'F' => Status::Fail,
                'N' => Status::NoData,
                _ => panic!("{c}"),
            };
            let flows: &[&str] = if s == Status::Fail { &["a", "b"] } else { &[] };
            let w = Window {
                start_ms: i as u64 * 1000,
                end_ms: (i as u64 + 1) * 1000,
            };
            if let Some(e) = t.window(w, w.end_ms, 4, &[result("data_class", s, flows)]) {
                assert_eq!(e.changes.len(), 1);
                out.push((i, e.changes[0].from, e.changes[0].to));
            }
        }
        out
    }

    use Status::{Fail, NoData, Pass, Skip};

    #[test]
    fn a_check_fails_only_after_fail_after_windows_in_a_row_and_recovers_likewise() {
        assert_eq!(
            run(3, "PPPFFFFPPPP"),
            vec![(2, None, Pass), (5, Some(Pass), Fail), (9, Some(Fail), Pass)]
        );
        // A fault for fewer windows than fail_after, however often it comes back.
        assert_eq!(run(3, "PPPFFPFFPFPFFPPP"), vec![(2, None, Pass)]);
        // A repair that does not hold is not a recovery.
        assert_eq!(
            run(2, "PPFFPFPFFPP"),
            vec![(1, None, Pass), (3, Some(Pass), Fail), (10, Some(Fail), Pass)]
        );
        // fail_after 1: every window counts.
        assert_eq!(
            run(1, "PFP"),
            vec![(0, None, Pass), (1, Some(Pass), Fail), (2, Some(Fail), Pass)]
        );
    }

    #[test]
    fn pass_and_skip_are_one_kind_of_health_no_data_another() {
        assert_eq!(run(2, "PPSSPSPS"), vec![(1, None, Pass)]);
        assert_eq!(
            run(2, "PPNNPP"),
            vec![(1, None, Pass), (3, Some(Pass), NoData), (5, Some(NoData), Pass)]
        );
        // A move to failing that passes through no data restarts its count.
        assert_eq!(run(2, "PPFNFP"), vec![(1, None, Pass)]);
        assert_eq!(run(2, "SS"), vec![(1, None, Skip)]);
        // No data until the traffic is seen: pending, whatever fail_after is.
        assert_eq!(run(2, "NNNNNPP"), vec![(6, None, Pass)]);
        assert_eq!(run(2, "NNPNP"), vec![]);
    }

    #[test]
    fn a_change_says_when_its_run_began_and_carries_the_windows_evidence() {
        let mut t = Tracker::new(2);
        let w = |i: u64| Window {
            start_ms: i * 1000,
            end_ms: i * 1000 + 2000,
        };
        assert!(t.window(w(0), 10, 3, &[result("c", Pass, &[])]).is_none());
        let first = t
            .window(w(1), 11, 3, &[result("c", Pass, &[])])
            .expect("first status");
        assert!(
            first.alerting().is_none(),
            "a first status that is ok alerts nobody"
        );
        assert_eq!(first.seq, 1);
        assert!(t.window(w(2), 12, 3, &[result("c", Fail, &["x"])]).is_none());
        let many: Vec<String> = (0..EVIDENCE_KEPT + 5).map(|i| format!("f{i}")).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        let e = t.window(w(3), 13, 3, &[result("c", Fail, &refs)]).expect("fail");
        assert_eq!(e.seq, 2);
        let c = &e.changes[0];
        assert_eq!((c.from, c.to, c.began_ms), (Some(Pass), Fail, w(2).end_ms));
        assert_eq!(c.evidence.len(), EVIDENCE_KEPT);
        assert_eq!(c.evidence_total, EVIDENCE_KEPT + 5);
        assert!(e.alerting().is_some());
        let s = t.states().next().unwrap();
        assert_eq!(
            (s.status, s.failing_windows, s.failing_items),
            (Some(Fail), 2, EVIDENCE_KEPT + 5)
        );
        assert_eq!(s.changed_ms, Some(13));
    }

    #[test]
    fn a_first_status_that_fails_alerts() {
        let mut t = Tracker::new(1);
        let e = t
            .window(
                Window {
                    start_ms: 0,
                    end_ms: 1,
                },
                1,
                1,
                &[result("c", Fail, &["x"])],
            )
            .unwrap();
        assert!(e.alerting().is_some());
        assert!(
            t.window(
                Window {
                    start_ms: 0,
                    end_ms: 1
                },
                1,
                1,
                &[result("d", NoData, &[])]
            )
            .is_none(),
            "no data before the first judged window is pending, not a status"
        );
        assert_eq!(t.states().find(|s| s.check == "d").unwrap().status, None);
    }

    #[test]
    fn changes_of_one_window_are_one_event_and_alerting_keeps_only_what_alerts() {
        let mut t = Tracker::new(1);
        let w = Window {
            start_ms: 0,
            end_ms: 1,
        };
        t.window(w, 1, 1, &[result("a", Pass, &[])]);
        let e = t
            .window(
                w,
                2,
                1,
                &[
                    result("a", Fail, &["x"]),
                    result("b", Pass, &[]),
                    result("c", Fail, &["y"]),
                ],
            )
            .unwrap();
        assert_eq!(e.changes.len(), 3);
        let a = e.alerting().unwrap();
        let names: Vec<&str> = a.changes.iter().map(|c| c.check.as_str()).collect();
        assert_eq!(names, ["a", "c"]);
    }

    #[test]
    fn a_resumed_tracker_neither_repeats_an_alert_nor_forgets_a_failure() {
        let mut t = Tracker::new(2);
        let mut history = Vec::new();
        for (i, s) in [Pass, Pass, Fail, Fail, Fail].into_iter().enumerate() {
            let w = Window {
                start_ms: i as u64,
                end_ms: i as u64 + 1,
            };
            history.extend(t.window(w, i as u64 + 1, 1, &[result("c", s, &["x"])]));
        }
        assert_eq!(history.len(), 2);
        // Restarted while still failing: no event, however long it fails.
        let mut r = Tracker::resume(2, &history);
        let w = Window {
            start_ms: 9,
            end_ms: 10,
        };
        assert!(r.window(w, 10, 1, &[result("c", Fail, &["x"])]).is_none());
        assert!(r.window(w, 11, 1, &[result("c", Fail, &["x"])]).is_none());
        assert_eq!(r.states().next().unwrap().status, Some(Fail));
        // It recovers: one event, numbered after the history's.
        assert!(r.window(w, 12, 1, &[result("c", Pass, &[])]).is_none());
        let e = r.window(w, 13, 1, &[result("c", Pass, &[])]).unwrap();
        assert_eq!((e.seq, e.changes[0].from, e.changes[0].to), (3, Some(Fail), Pass));
    }

    #[test]
    fn stretches_say_when_each_failure_began_and_ended() {
        let mut t = Tracker::new(1);
        let mut h = Vec::new();
        for (i, (a, b)) in [
            (Pass, Pass),
            (Fail, Pass),
            (Fail, NoData),
            (Pass, NoData),
            (Pass, Pass),
            (Fail, Pass),
        ]
        .into_iter()
        .enumerate()
        {
            let w = Window {
                start_ms: i as u64 * 10,
                end_ms: i as u64 * 10 + 10,
            };
            h.extend(t.window(w, w.end_ms, 1, &[result("a", a, &["x"]), result("b", b, &[])]));
        }
        let s = stretches(&h, 0);
        let got: Vec<(&str, Health, u64, Option<u64>)> = s
            .iter()
            .map(|s| (s.check.as_str(), s.health, s.from_ms, s.until_ms))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", Health::Failing, 20, Some(40)),
                ("b", Health::Unjudged, 30, Some(50)),
                ("a", Health::Failing, 60, None),
            ]
        );
        // Since 45: what ended before it is left out; what was still on is kept.
        let later: Vec<u64> = stretches(&h, 45).iter().map(|s| s.from_ms).collect();
        assert_eq!(later, vec![30, 60]);
        assert_eq!(s[0].began.evidence[0].flow, "x");
    }
}
