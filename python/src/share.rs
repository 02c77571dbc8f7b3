//! The bindings of a check shared among checker ranks (`ttrace.check(..., group=…)`): one
//! rank's share as bytes, and the report from every rank's.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::{json, pricing_mode, trace_guard};

/// Checker rank `rank` of `ranks`'s share of checking `candidate` against `reference` (the
/// tensors assigned to it read, merged and compared), as bytes for `combine_shares`. The GIL
/// is released while it reads.
#[pyfunction]
pub fn check_share<'py>(
    py: Python<'py>,
    reference: std::path::PathBuf,
    candidate: std::path::PathBuf,
    rank: usize,
    ranks: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let bytes = trace_guard(py, move || {
        ttrace::check::check_share_paths(&reference, &candidate, rank, ranks, &|| {})
    })?;
    Ok(PyBytes::new(py, &bytes))
}

/// The report of a check from every checker rank's share (`shares[r]` from rank `r`): (report
/// as JSON, report as the CLI's text), the single-machine check's.
#[pyfunction]
pub fn combine_shares(
    py: Python<'_>,
    reference: std::path::PathBuf,
    candidate: std::path::PathBuf,
    pricing: &str,
    shares: Vec<Vec<u8>>,
) -> PyResult<(String, String)> {
    let mode = pricing_mode(py, pricing)?;
    trace_guard(py, move || {
        let out = ttrace::check::combine_share_paths(&reference, &candidate, mode, &shares)?;
        Ok((json(&out)?, ttrace::check::render_dir_check(&out)))
    })
}

/// Which checker rank reads each tensor when `ranks` ranks share the check: (id, rank, bytes
/// of both traces), in the reference's order.
#[pyfunction]
pub fn share_owners(
    py: Python<'_>,
    reference: std::path::PathBuf,
    candidate: std::path::PathBuf,
    ranks: usize,
) -> PyResult<Vec<(String, usize, u64)>> {
    trace_guard(py, move || {
        let (r, c) = ttrace::check::resolve_steps(&reference, &candidate)?;
        let (r, c) = (
            ttrace::io::TraceDir::open(&r)?,
            ttrace::io::TraceDir::open(&c)?,
        );
        let owners = ttrace::check::share_owners(&r, &c, ranks)?;
        Ok(r.ids()
            .iter()
            .zip(owners)
            .map(|(id, o)| (id.clone(), o, r.stored_bytes(id) + c.stored_bytes(id)))
            .collect())
    })
}
