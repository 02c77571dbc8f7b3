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
/// relative threshold for every tensor without one in `per_id` or in `report`, the text of a
/// full check's JSON report (parsed as the command line parses `--thresholds`: strictly).
#[pyfunction]
#[pyo3(signature = (reference, candidate, rtol = None, per_id = None, report = None))]
pub fn check_summaries(
    py: Python<'_>,
    reference: std::path::PathBuf,
    candidate: std::path::PathBuf,
    rtol: Option<f64>,
    per_id: Option<HashMap<String, f64>>,
    report: Option<String>,
) -> PyResult<(String, String)> {
    let mut per_id = per_id.unwrap_or_default();
    if let Some(text) = report {
        let from = crate::guard(py, || {
            ttrace::check::SummaryThresholds::from_check_report(&text)
        })?;
        per_id.extend(from.per_id);
    }
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

/// The statistics of a tensor given as a one-dimensional uint8 array of its little-endian
/// bit patterns in `format`, in one pass (GIL released, the array read in place when
/// contiguous): `[nan, +inf, -inf, Σx, Σx², Σ|x|, top…, bottom…]`, the `min(k, elements)`
/// largest values padded with −∞ and the smallest padded with +∞ where fewer are finite (the
/// layout of the tracer's device path).
#[pyfunction]
pub fn summarize(
    py: Python<'_>,
    array: numpy::PyReadonlyArrayDyn<'_, u8>,
    format: &str,
    k: usize,
) -> PyResult<Vec<f64>> {
    let f: ttrace::Format = format
        .parse()
        .map_err(|e: ttrace::Error| invalid(py, "format", e.to_string()))?;
    let view = array.as_array();
    let owned: Vec<u8>;
    let bytes: &[u8] = match view.as_slice() {
        Some(b) => b,
        None => {
            owned = view.iter().copied().collect();
            &owned
        }
    };
    let width = ttrace::io::safetensors::element_size(f);
    let n = bytes.len() / width.max(1);
    let s = py.detach(|| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ttrace::io::summary::summarize(bytes, f, k)
        }))
    });
    let s = crate::guard(py, || match s {
        Ok(r) => r,
        Err(p) => std::panic::resume_unwind(p),
    })?;
    let kept = k.min(n);
    let mut out = vec![
        s.nan as f64,
        s.pinf as f64,
        s.ninf as f64,
        s.sum,
        s.sum_sq,
        s.sum_abs,
    ];
    out.extend(&s.top);
    out.extend(std::iter::repeat_n(f64::NEG_INFINITY, kept - s.top.len()));
    out.extend(&s.bottom);
    out.extend(std::iter::repeat_n(f64::INFINITY, kept - s.bottom.len()));
    Ok(out)
}
