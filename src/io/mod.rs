//! Trace files: safetensors and `.npy` tensors, and the manifest that says what each stored
//! tensor is (see `papers/trace-format.md`).

pub(crate) mod guard;
pub(crate) mod manifest;
pub mod npy;
pub mod safetensors;

pub mod summary;

pub use guard::{limits, printable, read_limited, sanitize};
pub use manifest::{
    merge_fragments, read_manifest, write_manifest, write_trace_dir, DpLoss, InferredLayout,
    Manifest, ManifestEntry, ModuleArith, ModuleInfo, Pipeline, TraceDir, VERSION, VERSIONS,
};

/// Write `contents` to `path` atomically: into a temporary file beside it (same directory, so
/// the same file system), flushed to disk, then renamed over `path`. A reader — or a run that
/// is interrupted — sees either the old file (or none) or the complete new one, never a
/// half-written file; on an error the temporary file is removed and `path` is untouched.
///
/// Hostile surroundings: the temporary name is unpredictable and created exclusively (an
/// existing file or a planted symbolic link at that name makes the creation fail, never
/// receives the data); a `path` that is itself a symbolic link is replaced, not followed. A
/// `path` that is a FIFO or a character device (`/dev/stdout`, a pipe) is written in place —
/// opened without blocking, so a FIFO nobody reads is an error, not a hang — and never
/// replaced; a directory, a block device or a socket is refused.
pub fn write_atomic(path: &std::path::Path, contents: &[u8]) -> crate::error::Result<()> {
    write_atomic_parts(path, &[contents], true)
}

/// [`write_atomic`] of the concatenation of `parts`, without joining them in memory first.
/// With `fsync` false the data is not forced to the device before the rename: readers still
/// see the old file or the whole new one while the system runs, but after a power loss the
/// new file may be empty or cut short (which the readers refuse as a truncated file). Trace
/// writers that must keep pace with training use that; reports keep `fsync`.
pub fn write_atomic_parts(
    path: &std::path::Path,
    parts: &[&[u8]],
    fsync: bool,
) -> crate::error::Result<()> {
    use std::io::Write;
    let fail = |reason: String| crate::error::Error::File {
        path: path.display().to_string(),
        reason,
        io: None,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        let t = meta.file_type();
        if !t.is_file() && !t.is_symlink() {
            return write_in_place(path, &meta, parts);
        }
    }
    let name = path
        .file_name()
        .ok_or_else(|| fail("not a file path".into()))?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let tmp = dir.join(format!(
        ".{}.{:016x}.tmp",
        name.to_string_lossy(),
        unpredictable()
    ));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o644);
    }
    let mut file = options
        .open(&tmp)
        .map_err(|e| fail(format!("creating a temporary file beside it: {e}")))?;
    let written = parts
        .iter()
        .try_for_each(|p| file.write_all(p))
        .and_then(|_| if fsync { file.sync_all() } else { Ok(()) })
        .and_then(|_| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        fail(format!("writing: {e}"))
    })
}

/// A FIFO or a character device named as the output: written in place (see [`write_atomic`]).
fn write_in_place(
    path: &std::path::Path,
    meta: &std::fs::Metadata,
    parts: &[&[u8]],
) -> crate::error::Result<()> {
    use std::io::Write;
    let fail = |reason: String| crate::error::Error::File {
        path: path.display().to_string(),
        reason,
        io: None,
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
        use std::os::unix::io::AsRawFd;
        let t = meta.file_type();
        if t.is_fifo() || t.is_char_device() {
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(path)
                .map_err(|e| fail(format!("cannot open for writing: {e}")))?;
            // Opened: back to blocking writes (a full pipe waits for its reader).
            // SAFETY: fcntl on a descriptor this function owns, with flags read just before.
            let ok = unsafe {
                let fd = file.as_raw_fd();
                let flags = libc::fcntl(fd, libc::F_GETFL);
                flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) >= 0
            };
            if !ok {
                return Err(fail("cannot set blocking mode".into()));
            }
            return parts
                .iter()
                .try_for_each(|p| file.write_all(p))
                .and_then(|_| file.flush())
                .map_err(|e| fail(format!("writing: {e}")));
        }
    }
    Err(fail(format!(
        "is {}; refusing to replace it with a report",
        guard::kind(meta)
    )))
}

/// 64 unpredictable bits for temporary names (the standard library's per-process random
/// hash keys, mixed with the time and a counter).
fn unpredictable() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish()
}
