//! roce-trace's judge: each policy rule applied to a collector report, with the flows,
//! points and hops that break it as evidence ([`checks`]); baselines ([`baseline`]) say
//! what changed, drills ([`drill`]) measure a failure from the reports taken through it,
//! [`window`] cuts a report to what happened between two, and [`output`] renders the
//! verdict (table, JSON, JUnit). A pure function of reports and timestamps: no I/O, no
//! async runtime, no kernel — where the reports come from is the binary's business.

pub mod baseline;
pub mod checks;
pub mod drill;
pub mod output;
pub mod policy;
pub mod window;

use roce_trace_correlate::CollectorReport;

/// Text that is not a collector report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{name} is not a roce-trace collector report")]
    NotJson {
        name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{name} is not a collector report (type `{kind}`)")]
    WrongType { name: String, kind: String },
}

/// A collector report read from its JSON (`collect --report`, `/report`); `name` (where
/// it came from) is quoted in errors.
pub fn parse_report(text: &str, name: &str) -> Result<CollectorReport, ReportError> {
    let r: CollectorReport = serde_json::from_str(text).map_err(|source| ReportError::NotJson {
        name: name.into(),
        source,
    })?;
    if r.kind != "collector_report" {
        return Err(ReportError::WrongType {
            name: name.into(),
            kind: r.kind,
        });
    }
    Ok(r)
}

#[cfg(test)]
mod tests;
