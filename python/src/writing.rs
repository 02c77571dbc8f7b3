//! The trace writer's bindings: one rank's step written through the Rust core (the one
//! writer of the trace format), fragments merged, files written atomically.

use std::collections::BTreeMap;

use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use ttrace::{Error, Format};

use crate::{guard, guard_detached, invalid};

/// One stored tensor as the tracer hands it: (name, format, shape, uint8 array of its bytes).
type StepTensor<'py> = (String, String, Vec<usize>, PyReadonlyArrayDyn<'py, u8>);

/// A plain file name (no directory part, not `.` or `..`): what a step writes into its
/// directory.
fn plain_name(py: Python<'_>, name: &str, what: &'static str) -> PyResult<()> {
    let plain =
        !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0']);
    if plain {
        Ok(())
    } else {
        Err(invalid(
            py,
            what,
            format!("'{}' must be a plain file name", ttrace::io::sanitize(name)),
        ))
    }
}

/// Write one rank's step — the one writer of the trace format for the Python tracer: its
/// tensors into `directory/file` (the directory exists) (a safetensors file, atomically, with `metadata`; `fsync`
/// forces the data to the device before the rename), then the manifest fragment
/// `directory/manifest_name`, atomically and last, so that an interrupted step leaves no
/// manifest naming missing files. `manifest` is the step's header and entries as JSON text
/// (`mesh`, `run`, optional `recipe` and `dp_loss`, `tensors`) without `format` and `version`,
/// which the core adds; it is built into the library's typed manifest and validated as every
/// reader validates one — and each entry must name `file` and a key stored in it — before any
/// byte is written. Tensors of equal format, shape and bytes are stored once, under the first
/// one's name (the entries of the others name it). The GIL is released while writing; the
/// arrays are read in place. Returns the bytes of tensor data written.
#[pyfunction]
#[pyo3(signature = (directory, file, tensors, metadata, manifest_name, manifest, fsync = true))]
#[allow(clippy::too_many_arguments)]
pub fn write_step(
    py: Python<'_>,
    directory: std::path::PathBuf,
    file: String,
    tensors: Vec<StepTensor<'_>>,
    metadata: BTreeMap<String, String>,
    manifest_name: String,
    manifest: &str,
    fsync: bool,
) -> PyResult<u64> {
    plain_name(py, &file, "file")?;
    plain_name(py, &manifest_name, "manifest_name")?;
    let manifest_path = directory.join(&manifest_name);
    let built = guard(py, || {
        ttrace::io::Manifest::parse(&completed(manifest, &manifest_path)?, &manifest_path)
    })?;
    let mut parsed = Vec::with_capacity(tensors.len());
    for (name, fmt, shape, bytes) in &tensors {
        let f: Format = guard(py, || fmt.parse())?;
        let slice = bytes
            .as_slice()
            .ok()
            .filter(|_| bytes.is_c_contiguous())
            .ok_or_else(|| {
                invalid(
                    py,
                    "array",
                    format!("tensor '{name}': the byte array must be C-contiguous"),
                )
            })?;
        parsed.push((name.as_str(), f, shape.as_slice(), slice));
    }
    // The borrowed slices stay valid while the GIL is released: `tensors` holds the arrays
    // (with rust-numpy's read-only borrow flag set) until this function returns. Comparing
    // contents reads every byte: without the GIL too.
    let mut built = built;
    guard_detached(py, || {
        // Equal contents are stored once (a tensor handed on unchanged, copied again on a
        // CUDA device rather than compared there): each later copy's entries name the first.
        let kept = first_of_equals(&parsed);
        for e in built.tensors.iter_mut() {
            if e.file == file {
                if let Some(k) = parsed.iter().position(|p| p.0 == e.key) {
                    e.key = parsed[kept[k]].0.to_string();
                }
            }
        }
        let stored: Vec<ttrace::io::safetensors::StoredTensor<'_>> = parsed
            .iter()
            .enumerate()
            .filter(|&(i, _)| kept[i] == i)
            .map(
                |(_, &(name, format, shape, bytes))| ttrace::io::safetensors::StoredTensor {
                    name,
                    format,
                    shape,
                    bytes,
                },
            )
            .collect();
        for e in &built.tensors {
            if e.file != file || !stored.iter().any(|t| t.name == e.key) {
                return Err(Error::InvalidParameter {
                    name: "manifest",
                    reason: format!(
                        "entry '{}' names '{}' in '{}', which this step does not store",
                        ttrace::io::sanitize(&e.id),
                        ttrace::io::sanitize(&e.key),
                        ttrace::io::sanitize(&e.file)
                    ),
                });
            }
        }
        ttrace::io::safetensors::write_stored(&directory.join(&file), &stored, &metadata, fsync)?;
        ttrace::io::write_manifest(&manifest_path, &built)?;
        Ok(stored.iter().map(|t| t.bytes.len() as u64).sum())
    })
}

/// The tracer's manifest text (header and entries, without `format` and `version`) with the
/// format and version the core writes: a manifest's text, to be parsed and validated.
pub(crate) fn completed(manifest: &str, path: &std::path::Path) -> ttrace::Result<String> {
    let mut v: serde_json::Value = serde_json::from_str(manifest).map_err(|e| Error::File {
        path: path.display().to_string(),
        reason: format!("the tracer's manifest is not JSON: {e}"),
        io: None,
    })?;
    let header = v.as_object_mut().ok_or_else(|| Error::File {
        path: path.display().to_string(),
        reason: "the tracer's manifest is not a JSON object".into(),
        io: None,
    })?;
    header.insert("format".into(), "ttrace-trace".into());
    header.insert("version".into(), ttrace::io::VERSION.into());
    Ok(v.to_string())
}

/// For each tensor, the index of the first tensor with the same format, shape and bytes (its
/// own index when it is the first). Only tensors of one format and shape are compared, byte
/// for byte, each with the distinct ones before it: different tensors differ within their
/// first bytes, so a comparison costs a pass over the bytes only where they are equal (and
/// stored once).
fn first_of_equals(tensors: &[(&str, Format, &[usize], &[u8])]) -> Vec<usize> {
    let mut distinct: std::collections::HashMap<(Format, &[usize]), Vec<usize>> =
        Default::default();
    let mut out = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let same = distinct.entry((t.1, t.2)).or_default();
        match same.iter().copied().find(|&j| tensors[j].3 == t.3) {
            Some(j) => out.push(j),
            None => {
                same.push(i);
                out.push(i);
            }
        }
    }
    out
}

/// Merge the `manifest.rank*.json` fragments of `directory` into `manifest.json` (rank
/// order; they must agree on the mesh, recipe and loss normalization). Returns its path.
#[pyfunction]
pub fn merge_manifests(py: Python<'_>, directory: std::path::PathBuf) -> PyResult<String> {
    let path = guard_detached(py, move || ttrace::io::merge_fragments(&directory))?;
    Ok(path.display().to_string())
}

/// Write `contents` to `path` atomically (readers see the old file or the whole new one).
#[pyfunction]
pub fn write_atomic(py: Python<'_>, path: std::path::PathBuf, contents: Vec<u8>) -> PyResult<()> {
    guard_detached(py, move || ttrace::io::write_atomic(&path, &contents))
}
