//! Prometheus exposition for the agent's and the collector's `/metrics`, written with the
//! `prometheus-client` crate (OpenMetrics text). Each scrape builds a registry of the
//! values as they are now: the figures live in the join and the agent's counters, and a
//! scrape reads them, never the other way round.

use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// A metric's labels: name and value pairs.
pub type Labels = Vec<(String, String)>;

/// The labels `pairs`, owned.
pub fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// One scrape's metrics.
#[derive(Default)]
pub struct Scrape {
    reg: Registry,
    /// Families with no series yet (nothing counted): the crate writes nothing for them,
    /// so their `# HELP` and `# TYPE` are written here — a dashboard or an alert can be
    /// checked against every name the binary exports, counted or not.
    empty: Vec<String>,
}

impl Scrape {
    /// A counter family `name` (written `name_total`), one series per row.
    pub fn counter(&mut self, name: &str, help: &str, rows: impl IntoIterator<Item = (Labels, u64)>) {
        let family = Family::<Labels, Counter>::default();
        let mut any = false;
        for (l, v) in rows {
            family.get_or_create(&l).inc_by(v);
            any = true;
        }
        if !any {
            self.note_empty(name.trim_end_matches("_total"), help, "counter");
            return;
        }
        self.reg.register(
            name.trim_end_matches("_total"),
            help.trim_end_matches('.'),
            family,
        );
    }

    /// A counter of one series without labels.
    pub fn counter1(&mut self, name: &str, help: &str, v: u64) {
        let c = Counter::<u64>::default();
        c.inc_by(v);
        self.reg
            .register(name.trim_end_matches("_total"), help.trim_end_matches('.'), c);
    }

    /// A gauge family, one series per row.
    pub fn gauge(&mut self, name: &str, help: &str, rows: impl IntoIterator<Item = (Labels, u64)>) {
        let family = Family::<Labels, Gauge>::default();
        let mut any = false;
        for (l, v) in rows {
            family.get_or_create(&l).set(i64::try_from(v).unwrap_or(i64::MAX));
            any = true;
        }
        if !any {
            self.note_empty(name, help, "gauge");
            return;
        }
        self.reg.register(name, help.trim_end_matches('.'), family);
    }

    fn note_empty(&mut self, name: &str, help: &str, kind: &str) {
        self.empty.push(format!(
            "# HELP {name} {}.\n# TYPE {name} {kind}\n",
            help.trim_end_matches('.')
        ));
    }

    /// A gauge of one series without labels.
    pub fn gauge1(&mut self, name: &str, help: &str, v: u64) {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(v).unwrap_or(i64::MAX));
        self.reg.register(name, help.trim_end_matches('.'), g);
    }

    /// The OpenMetrics text, each family's series in label order (the crate keeps them
    /// in a hash map: a scrape, a golden and a diff of two scrapes read alike).
    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut text, &self.reg);
        let mut out = String::with_capacity(text.len());
        let mut run: Vec<&str> = Vec::new();
        for line in text.lines() {
            if line.starts_with('#') {
                run.sort_unstable();
                for l in run.drain(..) {
                    out.push_str(l);
                    out.push('\n');
                }
                out.push_str(line);
                out.push('\n');
            } else {
                run.push(line);
            }
        }
        run.sort_unstable();
        for l in run {
            out.push_str(l);
            out.push('\n');
        }
        // The families without series, before the closing `# EOF`.
        if !self.empty.is_empty() {
            let at = out.rfind("# EOF").unwrap_or(out.len());
            out.insert_str(at, &self.empty.concat());
        }
        out
    }
}

/// The content type of [`Scrape::render`]'s text. (The crate ends each help text with a
/// full stop: ours are written without one there.)
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    /// A family with nothing counted yet is still named, with its help and type, inside
    /// the exposition (before `# EOF`), and has no sample line.
    #[test]
    fn a_family_without_series_is_still_named() {
        let mut m = Scrape::default();
        m.counter("a_total", "Counted.", [(labels(&[("k", "v")]), 3)]);
        m.gauge("b_lost", "Nothing yet.", Vec::new());
        m.counter("c_total", "Nothing either.", Vec::new());
        let t = m.render();
        assert!(
            t.contains("# HELP b_lost Nothing yet.\n# TYPE b_lost gauge\n"),
            "{t}"
        );
        assert!(t.contains("# HELP c Nothing either.\n# TYPE c counter\n"), "{t}");
        assert!(t.trim_end().ends_with("# EOF"), "{t}");
        assert!(
            !t.lines()
                .any(|l| l.starts_with("b_lost") || l.starts_with("c_total")),
            "{t}"
        );
        assert!(t.contains("a_total{k=\"v\"} 3"), "{t}");
    }

    /// Series come out in label order whatever order they were made in, families whole,
    /// counters with `_total` and help texts with one full stop.
    #[test]
    fn a_scrape_is_ordered_and_well_formed() {
        let rows = |order: &[&str]| -> Vec<(Labels, u64)> {
            order
                .iter()
                .map(|k| (labels(&[("kind", k)]), k.len() as u64))
                .collect()
        };
        let kinds = ["path_change", "lost", "class_change", "ce_onset", "a", "zz"];
        let mut rev = kinds;
        rev.reverse();
        let render = |order: &[&str]| {
            let mut m = Scrape::default();
            m.counter1("x_seen_total", "Seen.", 3);
            m.gauge("x_anomalies", "Anomalies, by kind.", rows(order));
            m.render()
        };
        let a = render(&kinds);
        assert_eq!(a, render(&rev));
        let series: Vec<&str> = a.lines().filter(|l| l.starts_with("x_anomalies{")).collect();
        let mut sorted = series.clone();
        sorted.sort_unstable();
        assert_eq!(series, sorted);
        assert!(
            a.contains("# HELP x_seen Seen.\n# TYPE x_seen counter\nx_seen_total 3\n"),
            "{a}"
        );
        assert!(a.contains("# HELP x_anomalies Anomalies, by kind.\n"), "{a}");
        assert!(a.ends_with("# EOF\n"), "{a}");
    }

    /// A label value is an agent's own words (its node name): quotes, backslashes and
    /// line ends are escaped, so no name can end its series early or forge another.
    #[test]
    fn label_values_cannot_break_out_of_their_series() {
        let mut m = Scrape::default();
        let evil = "n1\"} 1\nforged_total 999\n# EOF\n\\";
        m.gauge("x_connected", "Agents.", [(labels(&[("node", evil)]), 1)]);
        let text = m.render();
        assert!(
            text.contains(r#"x_connected{node="n1\"} 1\nforged_total 999\n# EOF\n\\"} 1"#),
            "{text}"
        );
        assert!(!text.lines().any(|l| l.starts_with("forged_total")), "{text}");
        assert_eq!(
            text.matches("# EOF").count(),
            2,
            "the forged one stays inside the label: {text}"
        );
        assert!(text.ends_with("\n# EOF\n"));
    }
}
