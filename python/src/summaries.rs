//! The summary traces' bindings: the tracer's one way to write a summary line, and the
//! comparison of two summary traces (`papers/summaries.md`).

use std::collections::HashMap;

use pyo3::prelude::*;

use crate::{guard_detached, invalid, json};

/// Append one rank's step to `directory/summaries.rank{rank}.jsonl`: `line` is the step as
/// JSON text (`format`, `version`, `step`, `rank`, `mesh`, `tensors`), validated as a reader
/// validates it before any byte is written; a torn last line an earlier writer left is cut
/// off, a failed write leaves none, and a step not after the file's last is refused. The GIL
/// is released while writing.
#[pyfunction]
#[pyo3(signature = (directory, line, fsync = false))]
pub fn append_summaries(
    py: Python<'_>,
    directory: std::path::PathBuf,
    line: String,
    fsync: bool,
) -> PyResult<()> {
    guard_detached(py, move || {
        let step = ttrace::io::summary::SummaryStep::parse(
            line.as_bytes(),
            &directory.join("(the line handed to append_summaries)"),
            1,
        )?;
        ttrace::io::summary::append_summary(&directory, &step, fsync)
    })
}

/// Whether `directory` holds a summary trace (`summaries.rank*.jsonl`).
#[pyfunction]
pub fn is_summary_dir(directory: std::path::PathBuf) -> bool {
    ttrace::io::summary::is_summary_dir(&directory)
}

/// Compare two summary traces: (report as JSON, report as the CLI's text). `rtol` is the
/// relative threshold for every tensor without one in `per_id`.
#[pyfunction]
#[pyo3(signature = (reference, candidate, rtol = None, per_id = None))]
pub fn check_summaries(
    py: Python<'_>,
    reference: std::path::PathBuf,
    candidate: std::path::PathBuf,
    rtol: Option<f64>,
    per_id: Option<HashMap<String, f64>>,
) -> PyResult<(String, String)> {
    let per_id = per_id.unwrap_or_default();
    let bad = rtol
        .into_iter()
        .chain(per_id.values().copied())
        .find(|t| !(t.is_finite() && *t >= 0.0));
    if let Some(t) = bad {
        return Err(invalid(
            py,
            "thresholds",
            format!("a relative threshold must be a finite non-negative number (got {t})"),
        ));
    }
    let thresholds = ttrace::check::SummaryThresholds { rtol, per_id };
    guard_detached(py, move || {
        let mut r = ttrace::io::summary::SummaryRun::open(&reference)?;
        let mut c = ttrace::io::summary::SummaryRun::open(&candidate)?;
        let out = ttrace::check::compare_summaries(&mut r, &mut c, &thresholds)?;
        Ok((json(&out)?, ttrace::check::render_summary_check(&out)))
    })
}
