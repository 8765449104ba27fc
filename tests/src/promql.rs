//! Prometheus text and PromQL, as far as the tests check dashboards and alert rules
//! against what the binaries export.

use std::collections::{BTreeMap, BTreeSet};

/// Metric names and the label names their series carry, from Prometheus text (counters'
/// `# TYPE` lines name the family without `_total`).
pub fn exported(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut m: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(t) = line.strip_prefix("# TYPE ") {
            let mut w = t.split_whitespace();
            let (name, kind) = (w.next().unwrap(), w.next().unwrap_or(""));
            let name = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            m.entry(name).or_default();
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            let labels = m.entry(line[..end].to_string()).or_default();
            if let Some(inner) = line[end..].strip_prefix('{').and_then(|r| r.split_once('}')) {
                for kv in inner.0.split(',') {
                    if let Some((k, _)) = kv.split_once('=') {
                        labels.insert(k.to_string());
                    }
                }
            }
        }
    }
    m
}

/// Every roce-trace metric each query (PromQL) names is in `names`, and every label it
/// groups or filters by is one those metrics' series carry (`instance` and `job` are
/// Prometheus's own). How many queries, or what is wrong.
pub fn check_exprs(exprs: &[String], names: &BTreeMap<String, BTreeSet<String>>) -> Result<usize, String> {
    if exprs.is_empty() {
        return Err("no queries".into());
    }
    for e in exprs {
        let used: Vec<&str> = e
            .match_indices("roce_trace_")
            .map(|(i, _)| {
                let rest = &e[i..];
                &rest[..rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len())]
            })
            .collect();
        if used.is_empty() {
            return Err(format!("`{e}` queries no roce-trace metric"));
        }
        let mut labels: BTreeSet<String> = ["instance", "job"].map(String::from).into();
        for u in &used {
            let l = names
                .get(*u)
                .ok_or_else(|| format!("`{e}` queries `{u}`, which no binary exports"))?;
            labels.extend(l.iter().cloned());
        }
        // Labels after `by (` and inside `{…}` selectors.
        let mut named = Vec::new();
        for part in e.split("by (").skip(1) {
            named.extend(
                part.split(')')
                    .next()
                    .unwrap()
                    .split(',')
                    .map(|l| l.trim().to_string()),
            );
        }
        for part in e.split('{').skip(1) {
            for kv in part.split('}').next().unwrap().split(',') {
                if let Some((k, _)) = kv.split_once(['=', '!']) {
                    named.push(k.trim().to_string());
                }
            }
        }
        for l in named {
            // A family seen without series (nothing to count yet) shows no labels: only
            // families with series are held to theirs.
            let known = used.iter().all(|u| names[*u].is_empty());
            if !known && !labels.contains(&l) {
                return Err(format!("`{e}` uses label `{l}`, which {used:?} do not carry"));
            }
        }
    }
    Ok(exprs.len())
}

/// The `expr:` of every rule in a Prometheus rules file (one line each, as ours are
/// written).
pub fn rule_exprs(yaml: &str) -> Vec<String> {
    yaml.lines()
        .filter_map(|l| l.trim_start().strip_prefix("expr:"))
        .map(|e| e.trim().to_string())
        .collect()
}
