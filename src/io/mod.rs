//! Trace files: safetensors and `.npy` tensors, and the manifest that says what each stored
//! tensor is (see `papers/trace-format.md`).

pub mod guard;
pub mod manifest;
pub mod npy;
pub mod safetensors;

pub use manifest::{read_manifest, write_trace_dir, Manifest, ManifestEntry, ModuleInfo, TraceDir};
pub use safetensors::SafetensorsFile;

/// Write `contents` to `path` atomically: into a temporary file beside it (same directory, so
/// the same file system), flushed to disk, then renamed over `path`. A reader — or a run that
/// is interrupted — sees either the old file (or none) or the complete new one, never a
/// half-written file; on an error the temporary file is removed and `path` is untouched.
pub fn write_atomic(path: &std::path::Path, contents: &[u8]) -> crate::error::Result<()> {
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let fail = |reason: String| crate::error::Error::File {
        path: path.display().to_string(),
        reason,
    };
    let name = path
        .file_name()
        .ok_or_else(|| fail("not a file path".into()))?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(contents).and_then(|_| f.sync_all()))
        .and_then(|_| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        fail(format!("writing: {e}"))
    })
}
