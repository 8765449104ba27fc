//! roce-trace's last stage: pictures. The fabric map (nodes in tiers, links, what was
//! located where), each flow's path with its class at every point, small time series, and
//! the `verify` report — as SVG and HTML text built from the join's report and the judge's
//! verdict. No I/O: the collector serves these strings, `verify --html` writes one.
//!
//! Everything a page needs is in the strings (styles and the little script inline): no
//! CDN, nothing fetched but the collector's own fragments, so it works air-gapped.

pub mod fabric;
pub mod html;
pub mod svg;

pub use fabric::{Fabric, Mark, Place};

/// Text made safe for HTML and SVG, in element content and quoted attributes alike.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// Flows named by one element of a picture, at most (a spine link at fleet scale carries
/// a hundred thousand): the rest are counted, and `/flows` has them all.
pub const MAX_LISTED: usize = 100;

/// A duration in the unit that reads best.
pub fn human_ns(ns: f64) -> String {
    let a = ns.abs();
    if a >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if a >= 1e6 {
        format!("{:.1} ms", ns / 1e6)
    } else if a >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// A rate in bits per second, in the unit that reads best.
pub fn human_bps(bps: f64) -> String {
    if bps >= 1e9 {
        format!("{:.2} Gbit/s", bps / 1e9)
    } else if bps >= 1e6 {
        format!("{:.2} Mbit/s", bps / 1e6)
    } else if bps >= 1e3 {
        format!("{:.1} kbit/s", bps / 1e3)
    } else {
        format!("{bps:.0} bit/s")
    }
}

#[cfg(test)]
mod tests;
