//! The bindings of an online check (`Tracer(..., online=REFERENCE)`): a traced step held in
//! memory by every rank — its own shards and what it fetched from the others — checked as
//! the written step would be (`ttrace.tracer.online` moves the bytes over torch.distributed).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use ttrace::io::safetensors::{SafetensorsFile, StoredTensor};
use ttrace::io::TraceDir;
use ttrace::Format;

use crate::{guard, invalid, json, pricing_mode, trace_guard};

/// The safetensors header of a rank's step (`tensors`: (key, format, shape, uint8 array of
/// its bytes), in the order the file would hold them): what the other ranks need to read the
/// shards they fetch. `file` names it in errors.
#[pyfunction]
pub fn encode_header<'py>(
    py: Python<'py>,
    file: String,
    tensors: Vec<(String, String, Vec<usize>, PyReadonlyArrayDyn<'py, u8>)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut parsed = Vec::with_capacity(tensors.len());
    for (name, fmt, shape, bytes) in &tensors {
        let format: Format = guard(py, || fmt.parse())?;
        let slice = bytes.as_slice().ok().filter(|_| bytes.is_c_contiguous());
        let slice = slice.ok_or_else(|| {
            invalid(
                py,
                "array",
                format!("tensor '{name}': the byte array must be C-contiguous"),
            )
        })?;
        parsed.push(StoredTensor {
            name,
            format,
            shape,
            bytes: slice,
        });
    }
    let header = guard(py, || {
        ttrace::io::safetensors::encode_header(file.as_ref(), &parsed, &BTreeMap::new())
    })?;
    Ok(PyBytes::new(py, &header))
}

/// A traced step held in memory: every rank's manifest fragment and file header, and the
/// bytes of the tensors this process holds.
#[pyclass(module = "ttrace._ttrace")]
pub struct OnlineTrace {
    label: PathBuf,
    fragments: Vec<String>,
    headers: Vec<(String, Vec<u8>)>,
    held: HashMap<String, BTreeMap<String, Arc<Vec<u8>>>>,
    /// (rank, file, key) of every shard, by id.
    entries: HashMap<String, Vec<(usize, String, String)>>,
}

impl OnlineTrace {
    fn trace(&self) -> ttrace::Result<TraceDir> {
        let mut files = HashMap::new();
        for (name, header) in &self.headers {
            let held = self.held.get(name).cloned().unwrap_or_default();
            let f = SafetensorsFile::in_memory(&self.label.join(name), header, held)?;
            files.insert(name.clone(), f);
        }
        TraceDir::from_fragments(&self.label, &self.fragments, files)
    }
}

#[pymethods]
impl OnlineTrace {
    /// The step of `fragments` (each rank's manifest fragment as the tracer builds it, in rank
    /// order) and `headers` ((file, header) of each rank's file), named `label` in messages;
    /// validated as a trace directory is. It holds no tensor yet.
    #[new]
    fn new(
        py: Python<'_>,
        label: PathBuf,
        fragments: Vec<String>,
        headers: Vec<(String, Vec<u8>)>,
    ) -> PyResult<Self> {
        let fragments = fragments
            .iter()
            .enumerate()
            .map(|(r, f)| {
                let p = label.join(format!("manifest.rank{r}.json"));
                guard(py, || crate::writing::completed(f, &p))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let mut t = OnlineTrace {
            label,
            fragments,
            headers,
            held: HashMap::new(),
            entries: HashMap::new(),
        };
        let trace = trace_guard(py, || t.trace())?;
        for e in &trace.manifest().tensors {
            t.entries.entry(e.id.clone()).or_default().push((
                e.rank,
                e.file.clone(),
                e.key.clone(),
            ));
        }
        Ok(t)
    }

    /// Hold the bytes of tensor `key` of `file` (copied).
    fn hold(
        &mut self,
        file: String,
        key: String,
        data: PyReadonlyArrayDyn<'_, u8>,
    ) -> PyResult<()> {
        let bytes = match data.as_slice() {
            Ok(s) => s.to_vec(),
            Err(_) => data.as_array().iter().copied().collect(),
        };
        self.held
            .entry(file)
            .or_default()
            .insert(key, Arc::new(bytes));
        Ok(())
    }

    /// Whether tensor `key` of `file` is held.
    fn holds(&self, file: &str, key: &str) -> bool {
        self.held.get(file).is_some_and(|m| m.contains_key(key))
    }

    /// Bytes of tensor data held.
    #[getter]
    fn held_bytes(&self) -> u64 {
        self.held
            .values()
            .flat_map(|m| m.values())
            .map(|b| b.len() as u64)
            .sum()
    }

    /// (rank, file, key) of each shard of `id`.
    fn entries(&self, id: &str) -> Vec<(usize, String, String)> {
        self.entries.get(id).cloned().unwrap_or_default()
    }

    /// The ids the check's set-up reads and this process does not hold (see
    /// `ttrace::check::setup_needs`).
    fn needs(&self, py: Python<'_>, reference: PathBuf) -> PyResult<Vec<String>> {
        trace_guard(py, || {
            ttrace::check::setup_needs(&TraceDir::open(&reference)?, &self.trace()?)
        })
    }

    /// Which checker rank checks each of the reference's ids: (id, rank), in its order.
    fn owners(
        &self,
        py: Python<'_>,
        reference: PathBuf,
        ranks: usize,
    ) -> PyResult<Vec<(String, usize)>> {
        trace_guard(py, || {
            let r = TraceDir::open(&reference)?;
            let owners = ttrace::check::share_owners(&r, &self.trace()?, ranks)?;
            Ok(r.ids().iter().cloned().zip(owners).collect())
        })
    }

    /// Checker rank `rank` of `ranks`'s share (it must hold every shard of its tensors).
    fn check_share<'py>(
        &self,
        py: Python<'py>,
        reference: PathBuf,
        rank: usize,
        ranks: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = trace_guard(py, || {
            let r = TraceDir::open(&reference)?;
            ttrace::check::check_share(&r, &self.trace()?, rank, ranks, &|| {})
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// The report from every checker rank's share: (JSON, text), as `ttrace check` gives for
    /// the written step.
    fn combine(
        &self,
        py: Python<'_>,
        reference: PathBuf,
        pricing: &str,
        shares: Vec<Vec<u8>>,
    ) -> PyResult<(String, String)> {
        let mode = pricing_mode(py, pricing)?;
        trace_guard(py, || {
            let r = TraceDir::open(&reference)?;
            let out = ttrace::check::combine_shares(&r, &self.trace()?, mode, &shares)?;
            Ok((json(&out)?, ttrace::check::render_dir_check(&out)))
        })
    }
}
