//! Windows of a collector's view: what happened between two of its reports.

use roce_trace_correlate::{CollectorReport, CountedLoss, FlowReport, MtuAt, Span};

/// `end` less what `start` already held: counters, losses, class changes, CE onsets and
/// trajectories count only what happened in between; flows with nothing new are left
/// out. Paths, classes and sizes are the latest view.
pub fn since(start: &CollectorReport, mut end: CollectorReport) -> CollectorReport {
    use std::collections::HashMap;

    use Span;
    let before: HashMap<&str, &FlowReport> = start.flows.iter().map(|f| (f.id.as_str(), f)).collect();
    let less_counted = |now: &mut Vec<CountedLoss>, was: &[CountedLoss]| {
        for l in now.iter_mut() {
            if let Some(w) = was.iter().find(|w| w.between == l.between) {
                l.packets = l.packets.saturating_sub(w.packets);
            }
        }
        now.retain(|l| l.packets > 0);
    };
    let less = |now: &mut Span, was: Option<&Span>| {
        if let Some(w) = was {
            now.packets = now.packets.saturating_sub(w.packets);
        }
    };
    // A port's MTUs in the window: the one in force at its start and those declared since.
    for p in &mut end.points {
        let Some(was) = start.points.iter().find(|x| x.point() == p.point()) else {
            continue;
        };
        let seen = was.mtu_history.last().map(|m| m.at_ns);
        p.mtu_history.retain(|m| seen.is_none_or(|t| m.at_ns > t));
        if let Some(m) = was.mtu {
            p.mtu_history.insert(
                0,
                MtuAt {
                    at_ns: seen.unwrap_or(0),
                    mtu: m,
                },
            );
        }
    }
    // A port's NIC intervals in the window: those that began after the last one `start`
    // held for it.
    for p in &mut end.nic {
        let seen = start
            .nic
            .iter()
            .find(|q| q.node == p.node && q.iface == p.iface)
            .and_then(|q| q.intervals.last())
            .map(|i| i.end_ns);
        if let Some(t) = seen {
            p.intervals.retain(|i| i.start_ns >= t);
        }
    }
    end.flows.retain_mut(|f| {
        let Some(b) = before.get(f.id.as_str()) else {
            return true;
        };
        for (point, c) in f.counters.iter_mut() {
            if let Some(w) = b.counters.get(point) {
                *c = c.less(w);
            }
        }
        f.counters.retain(|_, c| c.counts.packets > 0);
        f.trajectories = f.trajectories.saturating_sub(b.trajectories);
        for l in &mut f.lost {
            less(
                &mut l.span,
                b.lost.iter().find(|x| x.between == l.between).map(|x| &x.span),
            );
        }
        f.lost.retain(|l| l.span.packets > 0);
        for c in &mut f.class_seen {
            let was = b
                .class_seen
                .iter()
                .find(|x| x.point == c.point && x.cnp == c.cnp && x.dscp == c.dscp && x.pcp == c.pcp);
            less(&mut c.span, was.map(|x| &x.span));
        }
        f.class_seen.retain(|c| c.span.packets > 0);
        for u in &mut f.unobserved {
            let was = b
                .unobserved
                .iter()
                .find(|x| x.between == u.between && x.why == u.why);
            less(&mut u.span, was.map(|x| &x.span));
        }
        f.unobserved.retain(|u| u.span.packets > 0);
        for c in &mut f.class_changes {
            let was = b
                .class_changes
                .iter()
                .find(|x| x.between == c.between && x.from_dscp == c.from_dscp && x.to_dscp == c.to_dscp);
            less(&mut c.span, was.map(|x| &x.span));
        }
        f.class_changes.retain(|c| c.span.packets > 0);
        for o in &mut f.ce_onset {
            let was = b.ce_onset.iter().find(|x| x.after == o.after && x.at == o.at);
            less(&mut o.span, was.map(|x| &x.span));
        }
        f.ce_onset.retain(|o| o.span.packets > 0);
        let seen = b.delivery.iter().map(|x| x.end_ns).max().unwrap_or(0);
        f.delivery.retain(|x| x.end_ns > seen);
        if let (Some(d), Some(w)) = (&mut f.cnp_delivery, &b.cnp_delivery) {
            d.sent = d.sent.saturating_sub(w.sent);
            if let (Some(n), Some(m)) = (&mut d.reached, w.reached) {
                *n = n.saturating_sub(m);
            }
            less_counted(&mut d.lost, &w.lost);
        }
        let a = &mut f.answered_by;
        a.cnps_sent = a.cnps_sent.saturating_sub(b.answered_by.cnps_sent);
        less_counted(&mut a.cnps_lost, &b.answered_by.cnps_lost);
        a.cnps = a.cnps.saturating_sub(b.answered_by.cnps);
        a.ce_marks = a.ce_marks.saturating_sub(b.answered_by.ce_marks);
        a.cnps_per_ce_mark = (a.ce_marks > 0).then(|| a.cnps as f64 / a.ce_marks as f64);
        !f.counters.is_empty() || f.trajectories > 0
    });
    end
}

/// Of a report, only what [`since`] reads of a window's start: per flow its counters,
/// trajectories, losses, classes seen, unobserved, class changes, CE onsets, CNPs and the
/// end of its delivery log; per port its MTUs and its last NIC interval. A continuous
/// judge keeps these between windows instead of whole reports: `since(&base(a), b)` is
/// `since(&a, b)`, at a fraction of the memory (paths, delays, path history and the
/// delivery and NIC logs are most of a report).
pub fn base(r: &CollectorReport) -> CollectorReport {
    let flows = r
        .flows
        .iter()
        .map(|f| FlowReport {
            id: f.id.clone(),
            src_ip: f.src_ip,
            dst_ip: f.dst_ip,
            udp_sport: f.udp_sport,
            dest_qp: f.dest_qp,
            path: Vec::new(),
            hops: Vec::new(),
            class: Vec::new(),
            cnp_class: Vec::new(),
            cnp_delivery: f.cnp_delivery.clone(),
            max_frame: Default::default(),
            class_seen: f.class_seen.clone(),
            delivery: f
                .delivery
                .iter()
                .max_by_key(|d| d.end_ns)
                .cloned()
                .into_iter()
                .collect(),
            class_changes: f.class_changes.clone(),
            ce_onset: f.ce_onset.clone(),
            lost: f.lost.clone(),
            unobserved: f.unobserved.clone(),
            delays: Vec::new(),
            path_history: Vec::new(),
            counters: f.counters.clone(),
            trajectories: f.trajectories,
            answered_by: f.answered_by.clone(),
            probe: None,
        })
        .collect();
    let points = r
        .points
        .iter()
        .map(|p| {
            let mut p = p.clone();
            let keep = p.mtu_history.len().saturating_sub(1);
            p.mtu_history.drain(..keep);
            p
        })
        .collect();
    let nic = r
        .nic
        .iter()
        .map(|p| {
            let mut p = p.clone();
            let keep = p.intervals.len().saturating_sub(1);
            p.intervals.drain(..keep);
            p
        })
        .collect();
    CollectorReport {
        kind: r.kind.clone(),
        stats: r.stats,
        refused_connections: r.refused_connections,
        agents: Vec::new(),
        points,
        health: Vec::new(),
        flows,
        anomalies: Vec::new(),
        nic,
    }
}
