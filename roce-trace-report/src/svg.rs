//! SVG: the fabric map, a flow's path hop by hop, and small time series.

use std::fmt::Write as _;

use roce_trace_correlate::report::{FlowReport, Point};

use crate::{
    MAX_LISTED, esc,
    fabric::{Fabric, Mark, Marks, Place, worst},
    human_ns,
};

const NODE_W: f64 = 104.0;
const NODE_H: f64 = 34.0;
const COL: f64 = 128.0;
const ROW: f64 = 120.0;
const MARGIN: f64 = 40.0;

/// Space-separated names of the marks, worst first.
fn mark_names(m: &Marks) -> String {
    m.keys().map(|k| k.name()).collect::<Vec<_>>().join(" ")
}

/// The flows of a place to list: those a mark names first (what a person clicking came
/// for), then the others; at most [`MAX_LISTED`].
fn place_flows<'a>(all: &'a std::collections::BTreeSet<String>, marks: &'a Marks) -> String {
    let mut seen = std::collections::BTreeSet::new();
    listed(
        marks
            .values()
            .flatten()
            .chain(all.iter())
            .filter(move |f| seen.insert(f.as_str())),
    )
}

/// Per mark, ` data-flows-<mark>="…"`: the flows it names at this place (at most
/// [`MAX_LISTED`]), so the list a click opens says each flow's state here.
fn mark_flows(m: &Marks) -> String {
    m.iter()
        .map(|(k, flows)| format!(r#" data-flows-{}="{}""#, k.name(), listed(flows.iter())))
        .collect()
}

/// At most [`MAX_LISTED`] flow ids, space-separated (ids hold no spaces).
fn listed<'a>(flows: impl Iterator<Item = &'a String>) -> String {
    flows
        .take(MAX_LISTED)
        .map(|s| esc(s))
        .collect::<Vec<_>>()
        .join(" ")
}

fn marks_title(m: &Marks) -> String {
    let mut t = String::new();
    for (k, flows) in m {
        let _ = write!(t, "\n{}: {} flow(s)", k.words(), flows.len());
    }
    t
}

/// The fabric map: tiers bottom (hosts) to top, links between, each node and link
/// coloured by the worst mark located on it and carrying, as data attributes, its
/// marks and (up to [`MAX_LISTED`]) the flows through it. `highlight`: places drawn
/// thicker (the report's failing checks).
pub fn map(f: &Fabric) -> String {
    let tiers = f.tiers();
    let widest = tiers.iter().map(|(_, v)| v.len()).max().unwrap_or(1).max(1);
    let legend: f64 = Mark::ALL.iter().map(|m| legend_width(*m)).sum();
    let w = (MARGIN * 2.0 + widest as f64 * COL).max(MARGIN * 2.0 + legend);
    let h = MARGIN * 2.0 + tiers.len().max(1) as f64 * ROW - (ROW - NODE_H) + 24.0;
    // Centre of each node: rows from the top, the highest tier first.
    let mut at = std::collections::BTreeMap::new();
    for (row, (_, nodes)) in tiers.iter().rev().enumerate() {
        let x0 = (w - nodes.len() as f64 * COL) / 2.0 + COL / 2.0;
        for (i, n) in nodes.iter().enumerate() {
            at.insert(
                n.name.as_str(),
                (x0 + i as f64 * COL, MARGIN + row as f64 * ROW + NODE_H / 2.0),
            );
        }
    }
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" class="fabric-map" viewBox="0 0 {w:.0} {h:.0}" width="{w:.0}" height="{h:.0}" role="img" aria-label="fabric map">"#
    );
    s.push_str(r#"<g class="links">"#);
    let most = f.links.values().map(|l| l.flows.len()).max().unwrap_or(1).max(1) as f64;
    for l in f.links.values() {
        let (Some(&(x1, y1)), Some(&(x2, y2))) = (at.get(l.a.as_str()), at.get(l.b.as_str())) else {
            continue;
        };
        let colour = worst(&l.marks).map_or("#90a4ae", Mark::colour);
        // Width by flows through it, 1.5 to 7 px.
        let width = 1.5 + 5.5 * (l.flows.len() as f64).ln_1p() / most.ln_1p();
        let ifaces = format!(
            "{}:{} — {}:{}",
            l.a,
            l.a_ifaces.iter().cloned().collect::<Vec<_>>().join(","),
            l.b,
            l.b_ifaces.iter().cloned().collect::<Vec<_>>().join(",")
        );
        let _ = write!(
            s,
            r#"<g class="link{}" data-a="{}" data-b="{}" data-marks="{}" data-flow-count="{}" data-flows="{}"{}><line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{colour}" stroke-width="{width:.1}"/><line class="hit" x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}"/><title>{}
{} flow(s){}</title></g>"#,
            if l.marks.is_empty() { "" } else { " marked" },
            esc(&l.a),
            esc(&l.b),
            mark_names(&l.marks),
            l.flows.len(),
            place_flows(&l.flows, &l.marks),
            mark_flows(&l.marks),
            esc(&ifaces),
            l.flows.len(),
            esc(&marks_title(&l.marks)),
        );
    }
    s.push_str("</g><g class=\"nodes\">");
    for (tier, nodes) in &tiers {
        for n in nodes {
            let (x, y) = at[n.name.as_str()];
            let fill = worst(&n.marks).map_or("#eceff1", Mark::colour);
            let text = if n.marks.is_empty() { "#263238" } else { "#fff" };
            let _ = write!(
                s,
                r##"<g class="node{}" data-node="{}" data-tier="{}" data-marks="{}" data-flow-count="{}" data-flows="{}"{}><rect x="{:.1}" y="{:.1}" width="{NODE_W}" height="{NODE_H}" rx="6" fill="{fill}" stroke="#455a64"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" fill="{text}">{}</text><title>{}{}
{} flow(s), {} point(s){}</title></g>"##,
                if n.marks.is_empty() { "" } else { " marked" },
                esc(&n.name),
                tier.map_or("none".to_string(), |t| t.to_string()),
                mark_names(&n.marks),
                n.flows.len(),
                place_flows(&n.flows, &n.marks),
                mark_flows(&n.marks),
                x - NODE_W / 2.0,
                y - NODE_H / 2.0,
                y + 5.0,
                esc(&n.name),
                esc(&n.name),
                tier.map_or(" (on no path yet)".to_string(), |t| format!(" (tier {t})")),
                n.flows.len(),
                n.points.len(),
                esc(&marks_title(&n.marks)),
            );
        }
    }
    s.push_str("</g>");
    // The legend: what each colour means.
    let mut x = MARGIN;
    let y = h - 12.0;
    for m in Mark::ALL {
        let _ = write!(
            s,
            r#"<g class="legend"><rect x="{x:.0}" y="{:.0}" width="12" height="12" fill="{}"/><text x="{:.0}" y="{y:.0}">{}</text></g>"#,
            y - 10.0,
            m.colour(),
            x + 16.0,
            esc(m.words())
        );
        x += legend_width(m);
    }
    s.push_str("</svg>");
    s
}

/// The room one legend entry takes: its swatch and its words at about 6.5 px a letter.
fn legend_width(m: Mark) -> f64 {
    16.0 + 6.5 * m.words().chars().count() as f64 + 14.0
}

/// What happened between two consecutive points of a flow's path.
#[derive(Default)]
struct Hop {
    marks: Vec<(Mark, String)>,
    delay: Option<String>,
}

/// A flow's path, point by point, with the class (DSCP, ECN, PCP) each point saw, and
/// between points the one-way delay, where the class changed, where CE marking began
/// and where packets were lost.
pub fn flow_path(f: &FlowReport) -> String {
    let n = f.path.len();
    let (bw, gap) = (150.0, 70.0);
    let w = MARGIN + n.max(1) as f64 * (bw + gap) - gap + MARGIN;
    let h = 150.0;
    let mut hops: Vec<Hop> = (0..n.saturating_sub(1)).map(|_| Hop::default()).collect();
    let index = |p: &Point| f.path.iter().position(|q| q == p);
    let hop_of = |a: &Point, b: &Point| match (index(a), index(b)) {
        (Some(i), Some(j)) if j == i + 1 => Some(i),
        _ => None,
    };
    for c in &f.class_changes {
        if let Some(i) = hop_of(&c.between[0], &c.between[1]) {
            hops[i].marks.push((
                Mark::ClassChange,
                format!("DSCP {}→{} ({} pkts)", c.from_dscp, c.to_dscp, c.span.packets),
            ));
        }
    }
    for l in &f.lost {
        if let Some(i) = hop_of(&l.between[0], &l.between[1]) {
            hops[i]
                .marks
                .push((Mark::Lost, format!("lost {}", l.span.packets)));
        }
    }
    for d in &f.delays {
        if let Some(i) = hop_of(&d.between[0], &d.between[1])
            && d.delay.n > 0
        {
            hops[i].delay = Some(human_ns(d.delay.sum_ns as f64 / d.delay.n as f64));
        }
    }
    let onset: Vec<usize> = f.ce_onset.iter().filter_map(|c| index(&c.at)).collect();
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" class="flow-path" viewBox="0 0 {w:.0} {h:.0}" width="{w:.0}" height="{h:.0}" role="img" aria-label="path of {}">"#,
        esc(&f.id)
    );
    for (i, p) in f.path.iter().enumerate() {
        let x = MARGIN + i as f64 * (bw + gap);
        let class = f.class.iter().find(|c| &c.point == p);
        let class_text = class.map_or("class not seen".to_string(), |c| {
            format!(
                "DSCP {} ECN {} PCP {}",
                c.dscp,
                c.ecn,
                c.pcp.map_or("–".to_string(), |p| p.to_string())
            )
        });
        let ce = onset.contains(&i);
        let _ = write!(
            s,
            r##"<g class="point{}" data-point="{}" data-dscp="{}"><rect x="{x:.0}" y="40" width="{bw}" height="56" rx="6" fill="{}" stroke="#455a64"/><text x="{:.0}" y="58" text-anchor="middle" font-weight="bold">{}</text><text x="{:.0}" y="74" text-anchor="middle">{}</text><text x="{:.0}" y="90" text-anchor="middle">{}</text></g>"##,
            if ce { " ce-onset" } else { "" },
            esc(&p.to_string()),
            class.map_or(String::new(), |c| c.dscp.to_string()),
            if ce { Mark::CeOnset.colour() } else { "#eceff1" },
            x + bw / 2.0,
            esc(&p.node),
            x + bw / 2.0,
            esc(&format!(
                "{} {}",
                p.iface,
                p.direction.map_or(String::new(), |d| d.to_string())
            )),
            x + bw / 2.0,
            esc(&class_text),
        );
        if let Some(hop) = hops.get(i) {
            let (x1, x2) = (x + bw, x + bw + gap);
            let colour = hop
                .marks
                .iter()
                .map(|(m, _)| *m)
                .min()
                .map_or("#607d8b", Mark::colour);
            let _ = write!(
                s,
                r#"<g class="hop{}" data-from="{}" data-to="{}" data-marks="{}"><line x1="{x1:.0}" y1="68" x2="{:.0}" y2="68" stroke="{colour}" stroke-width="{}"/><polygon points="{:.0},62 {x2:.0},68 {:.0},74" fill="{colour}"/>"#,
                if hop.marks.is_empty() { "" } else { " marked" },
                esc(&p.to_string()),
                esc(&f.path[i + 1].to_string()),
                hop.marks
                    .iter()
                    .map(|(m, _)| m.name())
                    .collect::<Vec<_>>()
                    .join(" "),
                x2 - 8.0,
                if hop.marks.is_empty() { 2 } else { 4 },
                x2 - 8.0,
                x2 - 8.0,
            );
            if let Some(d) = &hop.delay {
                let _ = write!(
                    s,
                    r#"<text x="{:.0}" y="56" text-anchor="middle" class="delay">{}</text>"#,
                    (x1 + x2) / 2.0,
                    esc(d)
                );
            }
            for (k, (_, t)) in hop.marks.iter().enumerate() {
                let _ = write!(
                    s,
                    r#"<text x="{:.0}" y="{}" text-anchor="middle" class="hop-mark">{}</text>"#,
                    (x1 + x2) / 2.0,
                    112 + 14 * k,
                    esc(t)
                );
            }
            s.push_str("</g>");
        }
    }
    s.push_str("</svg>");
    s
}

/// A small time series: `points` as (Unix ns, value), oldest first, drawn as a line
/// with its latest, least and greatest values written beside it.
pub fn sparkline(title: &str, fmt: fn(f64) -> String, points: &[(u64, f64)]) -> String {
    let (w, h, pad) = (260.0, 64.0, 4.0);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<figure class="series" data-series="{}"><figcaption>{}</figcaption>"#,
        esc(title),
        esc(title)
    );
    if points.is_empty() {
        s.push_str("<p class=\"none\">no intervals yet</p></figure>");
        return s;
    }
    let (t0, t1) = (points[0].0, points[points.len() - 1].0.max(points[0].0 + 1));
    let lo = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min).min(0.0);
    let hi = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let span = if hi > lo { hi - lo } else { 1.0 };
    let xy: Vec<String> = points
        .iter()
        .map(|&(t, v)| {
            let x = pad + (w - 2.0 * pad) * (t - t0) as f64 / (t1 - t0) as f64;
            let y = h - pad - (h - 2.0 * pad) * (v - lo) / span;
            format!("{x:.1},{y:.1}")
        })
        .collect();
    let last = points[points.len() - 1].1;
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}"><rect width="{w}" height="{h}" fill="#fafafa" stroke="#cfd8dc"/><polyline fill="none" stroke="#1565c0" stroke-width="1.5" points="{}"/></svg><p>now {} · max {} · {} s</p></figure>"##,
        xy.join(" "),
        fmt(last),
        fmt(hi),
        (t1 - t0) / 1_000_000_000,
    );
    s
}

/// A plain number, to a precision that suits its size.
pub fn fmt_value(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// The place, as a short label.
pub fn place_label(p: &Place) -> String {
    match p {
        Place::Node(n) => n.clone(),
        Place::Link(a, b) => format!("{a} — {b}"),
    }
}
