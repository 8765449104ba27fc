//! HTML: the collector's web view (a page shell, and the fragments its script fetches)
//! and `verify --html`'s self-contained report.

use std::fmt::Write as _;

use roce_trace_correlate::report::{AgentInfo, Anomaly, CollectorReport, DeliveryAt, FlowReport, Point};
use roce_trace_verify::{checks::Status, continuous::Verdicts, output::Verdict};

use crate::{
    MAX_LISTED, esc,
    fabric::{Fabric, Mark},
    human_bps, human_ns, svg,
};

/// Styles shared by the web view and the report.
pub const CSS: &str = include_str!("assets/style.css");
/// The web view's script: fetches the fragments, refreshes them, follows `#flow=…`.
pub const APP_JS: &str = include_str!("assets/app.js");

/// The pages' icon, inline (a browser asks for `/favicon.ico` otherwise).
pub const ICON: &str = "data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 16 16'%3E%3Crect width='16' height='16' rx='3' fill='%23263238'/%3E%3Cpath d='M3 12 L8 4 L13 12' stroke='%23f9a825' stroke-width='2' fill='none'/%3E%3C/svg%3E";

/// How often the web view refreshes itself.
pub const REFRESH_MS: u64 = 5_000;

/// The web view's page: styles, an empty frame and the script that fills it from
/// `/ui/main` and `/ui/flow?id=…`. No data: it is served without the bearer token the
/// fragments ask for (the script asks the user for it once when they answer 401).
pub fn app_page() -> String {
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>roce-trace — fabric</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="{ICON}">
<style>{CSS}</style></head>
<body data-refresh-ms="{REFRESH_MS}">
<header><h1>roce-trace</h1><span id="status">loading…</span></header>
<main>
<section id="main"></section>
<aside id="panel" hidden></aside>
<section id="flow" hidden></section>
</main>
<script>{APP_JS}</script>
</body></html>
"#
    )
}

/// `/ui/main`: the map, the anomalies and the agents.
pub fn main_fragment(r: &CollectorReport) -> String {
    main_parts(&Fabric::of(r), r.flows.len(), &r.anomalies, &r.agents, None)
}

/// [`main_fragment`] of a fabric built flow by flow (a table too large to hold every
/// report at once); `note`: what the map leaves out, said above it.
pub fn main_parts(
    f: &Fabric,
    flows: usize,
    anomalies: &[Anomaly],
    agents: &[AgentInfo],
    note: Option<&str>,
) -> String {
    let mut s = String::new();
    let marked = f.nodes.values().filter(|n| !n.marks.is_empty()).count()
        + f.links.values().filter(|l| !l.marks.is_empty()).count();
    let _ = write!(
        s,
        r#"<section id="map"><h2>Fabric</h2><p class="summary">{} node(s), {} link(s), {} flow(s); {} place(s) marked. Click a node or link for its flows.</p>{}</section>"#,
        f.nodes.len(),
        f.links.len(),
        flows,
        marked,
        note.map_or(String::new(), |n| format!(r#"<p class="note">{}</p>"#, esc(n))) + &svg::map(f)
    );
    s.push_str(&anomalies_table(anomalies));
    s.push_str(&agents_table(agents));
    s
}

fn flow_link(id: &str) -> String {
    format!(
        r##"<a class="flow" href="#flow={}">{}</a>"##,
        esc(&percent_encode(id)),
        esc(id)
    )
}

/// `id` as a URL fragment or query value keeps it (ids hold `:`, `>`, `/`, `[`).
pub fn percent_encode(s: &str) -> String {
    let mut o = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~:/".contains(&b) {
            o.push(b as char);
        } else {
            let _ = write!(o, "%{b:02X}");
        }
    }
    o
}

fn points(v: &[Point]) -> String {
    v.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(" → ")
}

fn anomalies_table(a: &[Anomaly]) -> String {
    let mut s = format!(r#"<section id="anomalies"><h2>Anomalies ({})</h2>"#, a.len());
    if a.is_empty() {
        s.push_str("<p class=\"none\">none</p></section>");
        return s;
    }
    s.push_str("<table><thead><tr><th>kind</th><th>flow</th><th>where</th><th>packets</th><th>detail</th></tr></thead><tbody>");
    for x in a.iter().take(MAX_LISTED * 10) {
        let _ = write!(
            s,
            r#"<tr class="anomaly" data-kind="{}"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            x.kind,
            x.kind,
            flow_link(&x.flow),
            esc(&points(&x.between)),
            x.packets,
            esc(&x.detail)
        );
    }
    if a.len() > MAX_LISTED * 10 {
        let _ = write!(
            s,
            "<tr><td colspan=\"5\">… {} more in /anomalies</td></tr>",
            a.len() - MAX_LISTED * 10
        );
    }
    s.push_str("</tbody></table></section>");
    s
}

fn agents_table(a: &[AgentInfo]) -> String {
    let mut s = format!(
        r#"<section id="agents"><h2>Agents ({} connected of {})</h2>"#,
        a.iter().filter(|x| x.connected).count(),
        a.len()
    );
    s.push_str("<table><thead><tr><th>node</th><th>state</th><th>peer</th><th>observations</th><th>counter deltas</th><th>dropped</th><th>clock</th><th>last disconnect</th></tr></thead><tbody>");
    for x in a {
        let _ = write!(
            s,
            r#"<tr class="agent {}" data-node="{}"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            if x.connected { "up" } else { "down" },
            esc(&x.node),
            esc(&x.node),
            if x.connected { "connected" } else { "disconnected" },
            esc(&x.peer),
            x.observations,
            x.counter_deltas,
            x.dropped_observations + x.dropped_counters,
            if x.clock_synced { "synced" } else { "not synced" },
            esc(x.last_disconnect.as_deref().unwrap_or("–")),
        );
    }
    s.push_str("</tbody></table></section>");
    s
}

/// A time series: (Unix ns, value), oldest first.
type Series = Vec<(u64, f64)>;

/// Bits per second, CE-marked share and packets per second of a delivery log.
fn series(d: &[DeliveryAt]) -> (Series, Series, Series) {
    let mut rate = Vec::new();
    let mut ce = Vec::new();
    let mut pps = Vec::new();
    for x in d {
        let secs = x.end_ns.saturating_sub(x.start_ns) as f64 / 1e9;
        if secs <= 0.0 {
            continue;
        }
        rate.push((x.end_ns, x.bytes as f64 * 8.0 / secs));
        pps.push((x.end_ns, x.packets as f64 / secs));
        if x.packets > 0 {
            ce.push((x.end_ns, 100.0 * x.ce as f64 / x.packets as f64));
        }
    }
    (rate, ce, pps)
}

/// `/ui/flow?id=…`: one flow drawn — its path with the class at each point, what
/// happened between points, the CNPs that answered it, its path changes and its rate,
/// CE share and CNPs over time. `cnp_flows`: the reverse flows carrying its CNPs.
pub fn flow_fragment(f: &FlowReport, cnp_flows: &[&FlowReport]) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<article class="flow-page" data-flow="{}"><h2>Flow {}</h2><p>{} → {} · UDP source port {} · QP 0x{:x} · {} trajectories</p>"#,
        esc(&f.id),
        esc(&f.id),
        f.src_ip,
        f.dst_ip,
        f.udp_sport,
        f.dest_qp,
        f.trajectories
    );
    if f.path.is_empty() {
        s.push_str("<p class=\"none\">no complete trajectory yet: its path is not known</p>");
    } else {
        s.push_str(&svg::flow_path(f));
    }
    // The class at each point, as a table too (what the picture shows, copyable).
    s.push_str("<h3>Class at each point</h3><table class=\"classes\"><thead><tr><th>point</th><th>DSCP</th><th>ECN</th><th>PCP</th></tr></thead><tbody>");
    for c in &f.class {
        let _ = write!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&c.point.to_string()),
            c.dscp,
            c.ecn,
            c.pcp.map_or("–".into(), |p| p.to_string())
        );
    }
    s.push_str("</tbody></table>");
    // What happened between points.
    let mut events = Vec::new();
    for c in &f.class_changes {
        events.push((
            Mark::ClassChange,
            format!(
                "DSCP {} → {} between {} ({} sampled packets)",
                c.from_dscp,
                c.to_dscp,
                points(&c.between),
                c.span.packets
            ),
        ));
    }
    for c in &f.ce_onset {
        events.push((
            Mark::CeOnset,
            format!(
                "CE marking begins at {}{} ({} sampled packets)",
                c.at,
                c.after.as_ref().map_or(String::new(), |a| format!(" after {a}")),
                c.span.packets
            ),
        ));
    }
    for l in &f.lost {
        events.push((
            Mark::Lost,
            format!(
                "{} sampled packet(s) lost between {}{}",
                l.span.packets,
                points(&l.between),
                l.largest_frame
                    .map_or(String::new(), |b| format!(", the largest {b} bytes"))
            ),
        ));
    }
    s.push_str("<h3>Events</h3>");
    if events.is_empty() {
        s.push_str("<p class=\"none\">no class change, CE onset or loss</p>");
    } else {
        s.push_str("<ul class=\"events\">");
        for (m, t) in events {
            let _ = write!(
                s,
                r#"<li class="event" data-mark="{}"><span class="swatch" style="background:{}"></span>{}</li>"#,
                m.name(),
                m.colour(),
                esc(&t)
            );
        }
        s.push_str("</ul>");
    }
    // One-way delays.
    if !f.delays.is_empty() {
        s.push_str("<h3>One-way delays</h3><table><thead><tr><th>between</th><th>min</th><th>mean</th><th>max</th><th>samples</th></tr></thead><tbody>");
        for d in &f.delays {
            let n = d.delay.n.max(1) as f64;
            let _ = write!(
                s,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&points(&d.between)),
                human_ns(d.delay.min_ns as f64),
                human_ns(d.delay.sum_ns as f64 / n),
                human_ns(d.delay.max_ns as f64),
                d.delay.n
            );
        }
        s.push_str("</tbody></table>");
    }
    // CNPs that answered it.
    let a = &f.answered_by;
    let _ = write!(
        s,
        "<h3>CNPs</h3><p class=\"cnps\">{} CE-marked packet(s) reached the receiver; {} CNP(s) sent back, {} reached the sender{}{}.</p>",
        a.ce_marks,
        a.cnps_sent,
        a.cnps,
        a.cnps_per_ce_mark
            .map_or(String::new(), |r| format!(" ({r:.2} per CE mark)")),
        a.ce_to_cnp
            .as_ref()
            .filter(|d| d.n > 0)
            .map_or(String::new(), |d| format!(
                ", CE to CNP {} on average",
                human_ns(d.sum_ns as f64 / d.n as f64)
            )),
    );
    if !a.cnps_lost.is_empty() {
        s.push_str("<ul class=\"events\">");
        for l in &a.cnps_lost {
            let _ = write!(
                s,
                r#"<li class="event" data-mark="lost">{} CNP(s) vanished between {}</li>"#,
                l.packets,
                esc(&points(&l.between))
            );
        }
        s.push_str("</ul>");
    }
    if !a.flows.is_empty() {
        s.push_str("<p>carried by ");
        s.push_str(
            &a.flows
                .iter()
                .map(|x| flow_link(x))
                .collect::<Vec<_>>()
                .join(", "),
        );
        s.push_str("</p>");
    }
    // Path changes.
    s.push_str("<h3>Path over time</h3>");
    if f.path_history.is_empty() {
        s.push_str("<p class=\"none\">one path all along</p>");
    } else {
        s.push_str("<table class=\"history\"><thead><tr><th>since</th><th>path</th></tr></thead><tbody>");
        for p in &f.path_history {
            let _ = write!(
                s,
                "<tr><td>{}</td><td>{}</td></tr>",
                unix_time(p.since_ns),
                esc(&points(&p.path))
            );
        }
        s.push_str("</tbody></table>");
    }
    // Time series.
    let (rate, ce, _) = series(&f.delivery);
    let mut cnps: std::collections::BTreeMap<u64, f64> = std::collections::BTreeMap::new();
    for c in cnp_flows {
        for (t, v) in series(&c.delivery).2 {
            // Each CNP flow's intervals end at its own agent's readings: a second's
            // bucket is the sum of what ended in it.
            *cnps.entry(t / 1_000_000_000 * 1_000_000_000).or_default() += v;
        }
    }
    let cnps: Vec<(u64, f64)> = cnps.into_iter().collect();
    let last_rate = rate.last().map_or(0.0, |r| r.1);
    s.push_str("<h3>Over time</h3><div class=\"series-row\">");
    s.push_str(&svg::sparkline(
        &format!("rate ({})", human_bps(last_rate)),
        human_bps,
        &rate,
    ));
    s.push_str(&svg::sparkline(
        "CE-marked %",
        |v| format!("{} %", svg::fmt_value(v)),
        &ce,
    ));
    s.push_str(&svg::sparkline(
        "CNPs/s",
        |v| format!("{}/s", svg::fmt_value(v)),
        &cnps,
    ));
    s.push_str("</div></article>");
    s
}

/// Unix ns as UTC `HH:MM:SS.mmm` (the day is the report's).
pub fn unix_time(ns: u64) -> String {
    let ms = ns / 1_000_000;
    let (s, ms) = (ms / 1000, ms % 1000);
    format!(
        "{:02}:{:02}:{:02}.{ms:03} UTC",
        s / 3600 % 24,
        s / 60 % 60,
        s % 60
    )
}

/// `main` (a [`main_fragment`]) with the continuously judged checks after its map,
/// before the anomalies: the map stays the first thing seen.
pub fn main_with_verdicts(main: &str, v: &Verdicts) -> String {
    let checks = verdicts_section(v);
    let end = "</section>";
    match main
        .find(r#"<section id="map">"#)
        .and_then(|i| main[i..].find(end).map(|j| i + j + end.len()))
    {
        Some(at) => format!("{}{checks}{}", &main[..at], &main[at..]),
        None => checks + main,
    }
}

/// Changes listed under the continuously judged checks, newest first.
pub const CHANGES_LISTED: usize = 10;

/// The checks a collector judges all the time (`collect --policy`), for the web view
/// above its map: each check's established status (after `--fail-after` windows agree, or
/// pending), since when, the last window's own status and summary and how many flows or
/// items fail it, and the latest changes.
pub fn verdicts_section(v: &Verdicts) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<section id="verdicts"><h2>Checks, judged continuously</h2><p class="summary">{} every {} s over the last {} s, a change after {} window(s) agree; {} window(s) judged{}.</p>"#,
        esc(&v.policy),
        v.every_ms as f64 / 1000.0,
        v.window_ms as f64 / 1000.0,
        v.fail_after,
        v.windows,
        if v.judging { "" } else { "; not judging now" }
    );
    s.push_str(r#"<table><thead><tr><th>check</th><th>status</th><th>since</th><th>last window</th><th>failing</th><th>rule</th></tr></thead><tbody>"#);
    for c in &v.checks {
        let (class, name) = c
            .status
            .map_or(("pending", "PENDING"), |st| (status_class(st), st.name()));
        let _ = write!(
            s,
            r#"<tr class="check {class}" data-check="{}" data-status="{class}"><td>{}</td><td>{name}</td><td>{}</td><td>{}: {}</td><td>{}</td><td>{}</td></tr>"#,
            esc(&c.check),
            esc(&c.check),
            c.since_ms.map_or("–".into(), |t| unix_time(t * 1_000_000)),
            c.latest.name(),
            esc(&c.summary),
            c.failing_items,
            esc(&c.rule)
        );
    }
    s.push_str("</tbody></table>");
    let changes: Vec<_> = v
        .events
        .iter()
        .rev()
        .flat_map(|e| e.changes.iter().map(move |c| (e.at_ms, c)))
        .take(CHANGES_LISTED)
        .collect();
    if !changes.is_empty() {
        s.push_str(r#"<h3>Latest changes</h3><ul class="events changes">"#);
        for (at, c) in changes {
            let _ = write!(
                s,
                r#"<li class="change {}" data-check="{}">{} <b>{}</b> {} → {} (its windows from {}): {}</li>"#,
                status_class(c.to),
                esc(&c.check),
                unix_time(at * 1_000_000),
                esc(&c.check),
                c.from.map_or("–", |f| f.name()),
                c.to.name(),
                unix_time(c.began_ms * 1_000_000),
                esc(&c.summary)
            );
        }
        s.push_str("</ul>");
    }
    s.push_str("</section>");
    s
}

/// The flows carrying `f`'s CNPs, from the report.
pub fn cnp_flows<'a>(r: &'a CollectorReport, f: &FlowReport) -> Vec<&'a FlowReport> {
    r.flows
        .iter()
        .filter(|x| f.answered_by.flows.contains(&x.id))
        .collect()
}

/// `verify --html`: one self-contained file (no network) — the verdict, the checks, the
/// fabric map with the places a failing check names marked, and each failing check's
/// evidence with its flows drawn. `report`: what was judged, when it is at hand.
pub fn verify_report(v: &Verdict, report: Option<&CollectorReport>) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>roce-trace verify: {}</title>
<link rel="icon" href="{ICON}">
<style>{CSS}</style></head><body class="report">
<header><h1>roce-trace verify</h1><span class="verdict {}" id="verdict">{}</span></header><main>
<p>{} · {} flow(s) · load {:?}</p>"#,
        v.status.name(),
        status_class(v.status),
        v.status.name(),
        esc(&v.source),
        v.flows,
        v.load
    );
    s.push_str(r#"<section id="checks"><h2>Checks</h2><table><thead><tr><th>check</th><th>status</th><th>checked</th><th>summary</th><th>rule</th></tr></thead><tbody>"#);
    for c in &v.checks {
        let _ = write!(
            s,
            r##"<tr class="check {}" data-check="{}"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"##,
            status_class(c.status),
            esc(&c.check),
            if c.status == Status::Fail {
                format!(r##"<a href="#check-{}">{}</a>"##, esc(&c.check), esc(&c.check))
            } else {
                esc(&c.check)
            },
            c.status.name(),
            c.checked,
            esc(&c.summary),
            esc(&c.rule)
        );
    }
    s.push_str("</tbody></table></section>");
    if let Some(r) = report {
        let mut f = Fabric::of(r);
        for c in v.checks.iter().filter(|c| c.status == Status::Fail) {
            for e in &c.evidence {
                let at: Vec<Point> = e.at.iter().map(|x| x.parse().expect("infallible")).collect();
                if let Some(place) = f.place_of(&at) {
                    f.mark(&place, Mark::CheckFailed, &e.flow);
                }
            }
        }
        let _ = write!(
            s,
            r#"<section id="map"><h2>Fabric</h2><p class="summary">Places a failing check names are marked "{}".</p>{}</section>"#,
            Mark::CheckFailed.words(),
            svg::map(&f)
        );
    }
    for c in v.checks.iter().filter(|c| c.status == Status::Fail) {
        let _ = write!(
            s,
            r#"<section class="failure" id="check-{}"><h2>{} — FAIL</h2><p>{}</p><p class="rule">{}</p><table><thead><tr><th>flow</th><th>at</th><th>detail</th></tr></thead><tbody>"#,
            esc(&c.check),
            esc(&c.check),
            esc(&c.summary),
            esc(&c.rule)
        );
        for e in &c.evidence {
            let _ = write!(
                s,
                "<tr class=\"evidence\"><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&e.flow),
                esc(&e.at.join(", ")),
                esc(&e.detail)
            );
        }
        s.push_str("</tbody></table>");
        if let Some(r) = report {
            let mut drawn = std::collections::BTreeSet::new();
            for e in &c.evidence {
                if drawn.len() >= 20 || drawn.contains(e.flow.as_str()) {
                    continue;
                }
                if let Some(fl) = r.flows.iter().find(|x| x.id == e.flow)
                    && !fl.path.is_empty()
                {
                    drawn.insert(e.flow.as_str());
                    let _ = write!(
                        s,
                        r#"<figure class="evidence-flow" data-flow="{}"><figcaption>{}</figcaption>{}</figure>"#,
                        esc(&fl.id),
                        esc(&fl.id),
                        svg::flow_path(fl)
                    );
                }
            }
            let more = c
                .evidence
                .iter()
                .filter(|e| !e.flow.is_empty())
                .map(|e| e.flow.as_str())
                .collect::<std::collections::BTreeSet<_>>()
                .len();
            if more > drawn.len() {
                let _ = write!(
                    s,
                    "<p>{} more flow(s) in the table, not drawn.</p>",
                    more - drawn.len()
                );
            }
        }
        s.push_str("</section>");
    }
    s.push_str("</main></body></html>\n");
    s
}

fn status_class(s: Status) -> &'static str {
    match s {
        Status::Pass => "pass",
        Status::Fail => "fail",
        Status::Skip => "skip",
        Status::NoData => "nodata",
    }
}
