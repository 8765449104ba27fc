//! roce-trace's judge: each policy rule applied to a collector report, with the flows,
//! points and hops that break it as evidence ([`checks`]); baselines ([`baseline`]) say
//! what changed, drills ([`drill`]) measure a failure from the reports taken through it,
//! [`window`] cuts a report to what happened between two, and [`output`] renders the
//! verdict (table, JSON, JUnit). A pure function of reports and timestamps: no I/O, no
//! async runtime, no kernel — where the reports come from is the binary's business.

pub mod baseline;
pub mod checks;
pub mod continuous;
pub mod drill;
pub mod nic;
pub mod output;
pub mod policy;
pub mod window;

use roce_trace_correlate::CollectorReport;

/// A file that is not what it should be: not JSON of that shape, or another roce-trace
/// document (its `type`).
#[derive(Debug, thiserror::Error)]
pub enum DocumentError {
    #[error("{name} is not a roce-trace {what}")]
    NotJson {
        name: String,
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("{name} is not a {what} (type `{kind}`)")]
    WrongType {
        name: String,
        what: &'static str,
        kind: String,
    },
}

/// A roce-trace JSON document of type `want`; `name` (where it came from) and `what`
/// (what it should be) are quoted in errors, `wrong` when it is another document.
pub(crate) fn document<T: serde::de::DeserializeOwned>(
    text: &str,
    name: &str,
    (what, wrong, want): (&'static str, &'static str, &str),
    kind: impl Fn(&T) -> &str,
) -> Result<T, DocumentError> {
    let d: T = serde_json::from_str(text).map_err(|source| DocumentError::NotJson {
        name: name.into(),
        what,
        source,
    })?;
    if kind(&d) != want {
        return Err(DocumentError::WrongType {
            name: name.into(),
            what: wrong,
            kind: kind(&d).into(),
        });
    }
    Ok(d)
}

/// A collector report read from its JSON (`collect --report`, `/report`); `name` (where
/// it came from) is quoted in errors.
pub fn parse_report(text: &str, name: &str) -> Result<CollectorReport, DocumentError> {
    document(
        text,
        name,
        ("collector report", "collector report", "collector_report"),
        |r: &CollectorReport| &r.kind,
    )
}

#[cfg(test)]
mod tests;
