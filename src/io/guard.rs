//! Reading files that others wrote: the trust model of trace directories.
//!
//! A trace directory may come from anyone (a bug report, another CI job, a checking service's
//! upload). What ttrace promises when it reads one:
//! * **Nothing outside the directory is read.** Every file named by a manifest is resolved
//!   inside the directory: absolute paths and `..` are refused lexically, and after symbolic
//!   links are resolved the file must still lie inside the directory's own resolved path (a
//!   symlink to a file elsewhere, or a subdirectory linked to `/`, is refused with an error
//!   that names the file, never printing what the outside file holds).
//! * **Only regular files are opened.** FIFOs, sockets, devices (`/dev/zero`) and directories
//!   are refused before anything is read; files are opened non-blocking, so even a FIFO that
//!   appears between the check and the open cannot hang the process.
//! * **Sizes are bounded before anything is allocated**, by the limits in [`limits`].
//!
//! Not covered: a directory that changes while it is read (an attacker racing the checker
//! with write access to it). Check a copy if that matters.

use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// The limits on what ttrace reads from files and arguments, in one place.
pub mod limits {
    pub use crate::limits::*;
}

/// A file error without an I/O cause: `path` and what is wrong with it (the readers' and
/// writers' one constructor of [`Error::File`] for bad contents).
pub(crate) fn ferr(path: &Path, reason: impl Into<String>) -> Error {
    Error::File {
        path: path.display().to_string(),
        reason: reason.into(),
        io: None,
    }
}

/// Open `path` for reading if it is a regular file (after following links), without blocking:
/// FIFOs, devices, sockets and directories are refused with a message.
pub fn open_regular(path: &Path) -> Result<File> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "cannot open", e))?;
    if !meta.is_file() {
        return Err(ferr(path, format!("not a regular file ({})", kind(&meta))));
    }
    let file = open_nonblocking(path).map_err(|e| Error::io(path, "cannot open", e))?;
    // The file opened may not be the one checked (a rename in between): check the handle.
    let meta = file
        .metadata()
        .map_err(|e| Error::io(path, "cannot stat", e))?;
    if !meta.is_file() {
        return Err(ferr(path, format!("not a regular file ({})", kind(&meta))));
    }
    Ok(file)
}

#[cfg(unix)]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    File::open(path)
}

/// What kind of file `meta` describes, for messages.
pub(crate) fn kind(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

/// Read a whole regular file of at most `limit` bytes.
pub fn read_limited(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    let file = open_regular(path)?;
    let size = file
        .metadata()
        .map_err(|e| Error::io(path, "cannot stat", e))?
        .len();
    if size > limit {
        return Err(ferr(
            path,
            format!("{what} of {size} bytes exceeds the limit of {limit} bytes"),
        ));
    }
    let mut out = Vec::with_capacity(size as usize);
    // `take` guards against a file that grows after the size was read.
    file.take(limit + 1)
        .read_to_end(&mut out)
        .map_err(|e| Error::io(path, "cannot read", e))?;
    if out.len() as u64 > limit {
        return Err(ferr(
            path,
            format!("{what} exceeds the limit of {limit} bytes"),
        ));
    }
    Ok(out)
}

/// A directory whose files are read under the trust model above.
#[derive(Debug, Clone)]
pub struct TrustedDir {
    /// As given (for messages).
    dir: PathBuf,
    /// Resolved (symlinks followed, absolute); `None` for a trace held in memory, which
    /// has no files to resolve.
    root: Option<PathBuf>,
}

impl TrustedDir {
    /// `dir` must be a directory.
    pub fn new(dir: &Path) -> Result<TrustedDir> {
        let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, "cannot open", e))?;
        if !meta.is_dir() {
            return Err(ferr(
                dir,
                format!("not a trace directory ({})", kind(&meta)),
            ));
        }
        let root = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, "cannot resolve", e))?;
        Ok(TrustedDir {
            dir: dir.to_path_buf(),
            root: Some(root),
        })
    }

    /// The name of a trace held in memory (no directory: resolving a file in it is refused).
    pub(crate) fn label(label: &Path) -> TrustedDir {
        TrustedDir {
            dir: label.to_path_buf(),
            root: None,
        }
    }

    /// The directory as given.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// `name` (relative, no `..`) inside the directory, as given (for messages) and resolved
    /// (symlinks followed; must stay inside the directory).
    pub fn resolve(&self, name: &str) -> Result<(PathBuf, PathBuf)> {
        let shown = self.dir.join(name);
        let rel = Path::new(name);
        if name.is_empty()
            || rel
                .components()
                .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(ferr(
                &shown,
                "file names must be relative paths inside the trace directory (no '..', no \
                 absolute path)",
            ));
        }
        let Some(root) = &self.root else {
            return Err(ferr(&shown, "a trace held in memory has no files to open"));
        };
        let real =
            std::fs::canonicalize(&shown).map_err(|e| Error::io(&shown, "cannot open", e))?;
        if !real.starts_with(root) {
            return Err(ferr(
                &shown,
                "is a symbolic link (or lies below one) that leaves the trace directory; \
                 refused",
            ));
        }
        Ok((shown, real))
    }

    /// Open `name` inside the directory (see [`TrustedDir::resolve`]), a regular file only:
    /// its path as given, its resolved path and the handle.
    pub fn open(&self, name: &str) -> Result<(PathBuf, PathBuf, File)> {
        let (shown, real) = self.resolve(name)?;
        let file = open_regular(&real).map_err(|e| rename_path(e, &shown))?;
        Ok((shown, real, file))
    }

    /// Read `name` whole, at most `limit` bytes.
    pub fn read(&self, name: &str, limit: u64, what: &str) -> Result<(PathBuf, Vec<u8>)> {
        let (shown, real) = self.resolve(name)?;
        let bytes = read_limited(&real, limit, what).map_err(|e| rename_path(e, &shown))?;
        Ok((shown, bytes))
    }
}

/// Name the path as the user gave it in a file error.
fn rename_path(e: Error, shown: &Path) -> Error {
    match e {
        Error::File { reason, .. } => ferr(shown, reason),
        other => other,
    }
}

/// Parse JSON strictly: like `serde_json::from_slice` into a `Value`, but an object that names
/// a key twice is an error at any depth (a map would silently keep one of the two).
pub fn parse_json_strict(bytes: &[u8]) -> std::result::Result<serde_json::Value, String> {
    let v: Strict = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    Ok(v.0)
}

/// A JSON value parsed strictly (a key named twice in one object is an error, at any depth).
pub(crate) struct Strict(pub(crate) serde_json::Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = serde_json::Value;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_i64<E>(self, v: i64) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> std::result::Result<Self::Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, Into::into))
    }
    fn visit_str<E>(self, v: &str) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_string<E>(self, v: String) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_unit<E>(self) -> std::result::Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_none<E>(self) -> std::result::Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_some<D: serde::Deserializer<'de>>(
        self,
        d: D,
    ) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut a: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = a.next_element()? {
            out.push(v);
        }
        Ok(serde_json::Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut m: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(k) = m.next_key::<String>()? {
            let Strict(v) = m.next_value()?;
            if out.contains_key(&k) {
                return Err(serde::de::Error::custom(format!(
                    "key {} appears twice in one object",
                    crate::io::guard::escape(&k)
                )));
            }
            out.insert(k, v);
        }
        Ok(serde_json::Value::Object(out))
    }
}

/// `s` quoted for a terminal or a log: control characters (escape sequences included), quotes
/// and backslashes escaped, everything else as is.
pub fn escape(s: &str) -> String {
    format!("{s:?}")
}

/// `s` as is when it holds nothing a terminal would interpret (no control characters),
/// otherwise escaped as a Rust string literal — for ids printed in reports.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if s.chars().any(|c| c.is_control() || is_bidi_control(c)) {
        std::borrow::Cow::Owned(escape(s))
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}

/// `text` for a terminal, on one line: every control character but tab (escape sequences and
/// newlines included — a newline in a name from a file could forge a line of a report) and
/// every bidirectional control written as `\u{…}`.
pub fn sanitize(text: &str) -> std::borrow::Cow<'_, str> {
    let bad = |c: char| (c.is_control() && c != '\t') || is_bidi_control(c);
    if !text.chars().any(bad) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .map(|c| {
                if bad(c) {
                    format!("\\u{{{:x}}}", c as u32)
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

/// Unicode bidirectional controls, which reorder what a terminal shows.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200E}' | '\u{200F}')
}
