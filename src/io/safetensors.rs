//! The safetensors file format (Hugging Face): an 8-byte little-endian header length N, N
//! bytes of JSON — `{"name": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [b, e]}, …,
//! "__metadata__": {"k": "v"}}` — then the data, offsets relative to its start, little endian.
//!
//! Reading validates everything a hostile file could lie about before any tensor is touched:
//! the header length against the file size (and a 100 MB cap), the JSON, every dtype, that each
//! tensor's byte range equals its shape times its element size (with overflow checks) and lies
//! inside the data region. Only the header is read on open; a tensor's bytes are read when it is
//! asked for, so a trace larger than memory can be checked tensor by tensor.
//!
//! Dtypes and the formats they hold exactly: F64, F32, F16, BF16, F8_E4M3, F8_E5M2 (bit
//! patterns decoded by [`Format::decode`], so BF16 and FP8 are read as stored).

use std::collections::BTreeMap;
use std::fs::File;

use crate::io::guard::{limits, printable};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::Format;
use crate::tensor::Tensor;
use crate::trace::stored::Stored;

fn err(path: &Path, reason: impl Into<String>) -> Error {
    Error::File {
        path: path.display().to_string(),
        reason: reason.into(),
        io: None,
    }
}

/// The safetensors dtype name of a format.
pub fn dtype_name(f: Format) -> Option<&'static str> {
    Some(match f {
        Format::F64 => "F64",
        Format::F32 => "F32",
        Format::F16 => "F16",
        Format::BF16 => "BF16",
        Format::E4M3 => "F8_E4M3",
        Format::E5M2 => "F8_E5M2",
        Format::TF32 => return None,
    })
}

/// The format of a safetensors dtype name.
pub fn dtype_format(name: &str) -> Option<Format> {
    Some(match name {
        "F64" => Format::F64,
        "F32" => Format::F32,
        "F16" => Format::F16,
        "BF16" => Format::BF16,
        "F8_E4M3" => Format::E4M3,
        "F8_E5M2" => Format::E5M2,
        _ => return None,
    })
}

pub use crate::format::codec::{
    decode_values, decode_values_into, element_size, encode_values, encode_values_into,
};

/// One tensor's entry as the header gives it (serde refuses a field named twice; unknown
/// fields are ignored).
#[derive(serde::Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: Vec<u64>,
}

/// A header item: the `__metadata__` map or a tensor.
enum Item {
    Metadata(Vec<(String, String)>),
    Tensor(RawTensor),
}

/// A string-to-string map whose keys must differ.
struct StringMap(Vec<(String, String)>);

impl<'de> serde::Deserialize<'de> for StringMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = StringMap;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of strings to strings")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<StringMap, A::Error> {
                let mut out: Vec<(String, String)> = Vec::new();
                let mut seen = std::collections::HashSet::new();
                while let Some((k, v)) = m.next_entry::<String, String>()? {
                    if !seen.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format!(
                            "__metadata__ names {} twice",
                            crate::io::guard::escape(&k)
                        )));
                    }
                    out.push((k, v));
                }
                Ok(StringMap(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// The header's items in file order; a name given twice is an error (a map would silently
/// keep one of the two). Typed, so memory stays near the size of the entries.
struct Members(Vec<(String, Item)>);

impl<'de> serde::Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Members, A::Error> {
                let mut out = Vec::new();
                let mut seen = std::collections::HashSet::new();
                while let Some(k) = m.next_key::<String>()? {
                    if !seen.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format!(
                            "header names {} twice (which entry would be meant?)",
                            crate::io::guard::escape(&k)
                        )));
                    }
                    let item = if k == "__metadata__" {
                        Item::Metadata(m.next_value::<StringMap>()?.0)
                    } else {
                        Item::Tensor(m.next_value::<RawTensor>()?)
                    };
                    out.push((k, item));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// One tensor's entry in the header.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Stored format.
    pub format: Format,
    /// Shape.
    pub shape: Vec<usize>,
    /// Byte range within the data region.
    pub range: (u64, u64),
}

/// An open safetensors file: its validated header; tensors are read on demand.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    /// The open handle; `None` after [`SafetensorsFile::release`] (reopened per read).
    file: Option<File>,
    /// Where to reopen it (resolved), and its size when the header was validated.
    reopen: Option<(PathBuf, u64)>,
    data_start: u64,
    entries: std::sync::Arc<BTreeMap<String, Entry>>,
    metadata: std::sync::Arc<BTreeMap<String, String>>,
    /// Read buffer reused across reads (no fresh pages per tensor).
    scratch: Vec<u8>,
    /// The tensors' bytes held in memory, by name, for a file that was never written (see
    /// [`SafetensorsFile::in_memory`]); a tensor it does not hold cannot be read.
    memory: Option<HeldBytes>,
}

/// Tensor bytes held in memory, by name.
type HeldBytes = std::sync::Arc<BTreeMap<String, std::sync::Arc<Vec<u8>>>>;

impl SafetensorsFile {
    /// Open and validate the header (see the module docs).
    /// Only a regular file is opened (a FIFO or a device is refused, never blocks).
    pub fn open(path: &Path) -> Result<SafetensorsFile> {
        Self::from_file(path, crate::io::guard::open_regular(path)?)
    }

    /// [`SafetensorsFile::open`] on a file already opened (`path` names it in errors).
    pub fn from_file(path: &Path, mut file: File) -> Result<SafetensorsFile> {
        let size = file
            .metadata()
            .map_err(|e| Error::io(path, "cannot stat", e))?
            .len();
        let mut f = Self::from_reader(path, &mut file, Some(size))?;
        f.file = Some(file);
        Ok(f)
    }

    /// A file that was never written (a traced step checked online): its header as
    /// [`encode_header`] makes it (the length and the JSON, no data), validated as a file's
    /// is, and the bytes of the tensors this process holds, by name — each must be one the
    /// header declares, with its byte count. Reading a tensor not held is an error.
    ///
    /// # Errors
    ///
    /// [`Error::File`] (naming `label`) for a header a file would be refused for, or held
    /// bytes the header does not declare or whose length differs.
    pub fn in_memory(
        label: &Path,
        header: &[u8],
        held: BTreeMap<String, std::sync::Arc<Vec<u8>>>,
    ) -> Result<SafetensorsFile> {
        let mut f = Self::from_reader(label, &mut &header[..], None)?;
        for (name, bytes) in &held {
            let e = f.entries.get(name).ok_or_else(|| {
                err(
                    label,
                    format!(
                        "holds tensor '{}', which its header does not declare",
                        printable(name)
                    ),
                )
            })?;
            if e.range.1 - e.range.0 != bytes.len() as u64 {
                return Err(err(
                    label,
                    format!(
                        "tensor '{}': {} bytes held, its header says {}",
                        printable(name),
                        bytes.len(),
                        e.range.1 - e.range.0
                    ),
                ));
            }
        }
        f.memory = Some(std::sync::Arc::new(held));
        Ok(f)
    }

    /// The header read from `file` (`size` bytes in all when known: a file's data region must
    /// hold every tensor; unknown for a header held in memory without its data).
    fn from_reader(
        path: &Path,
        file: &mut impl Read,
        size: Option<u64>,
    ) -> Result<SafetensorsFile> {
        let size = size.unwrap_or(u64::MAX);
        if size < 8 {
            return Err(err(
                path,
                format!("truncated: {size} bytes, no header length"),
            ));
        }
        let mut len = [0u8; 8];
        file.read_exact(&mut len)
            .map_err(|e| Error::io(path, "reading the header length", e))?;
        let n = u64::from_le_bytes(len);
        if n > limits::SAFETENSORS_HEADER_BYTES || n > size - 8 {
            return Err(err(
                path,
                format!("header length {n} exceeds the file ({size} bytes) or the 100 MB cap"),
            ));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header)
            .map_err(|e| Error::io(path, "reading the header", e))?;
        // Strict and typed: a name or a field given twice is refused.
        let obj: Members = serde_json::from_slice(&header).map_err(|e| {
            err(
                path,
                format!("header is not valid JSON for safetensors: {e}"),
            )
        })?;
        let obj = obj.0;
        let data_start = 8 + n;
        let data_len = size - data_start;
        let mut entries = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, item) in obj {
            let v = match item {
                Item::Metadata(m) => {
                    metadata.extend(m);
                    continue;
                }
                Item::Tensor(t) => t,
            };
            let bad = |why: &str| err(path, format!("tensor {}: {why}", printable(&name)));
            let dtype = v.dtype.as_str();
            let format = dtype_format(dtype).ok_or_else(|| {
                bad(&format!(
                    "unsupported dtype {} (F64, F32, F16, BF16, F8_E4M3, F8_E5M2)",
                    crate::io::guard::escape(dtype)
                ))
            })?;
            if v.shape.len() > crate::io::guard::limits::DIMS {
                return Err(bad("shape has too many dimensions"));
            }
            let shape: Vec<usize> = v
                .shape
                .iter()
                .map(|&x| usize::try_from(x).ok())
                .collect::<Option<_>>()
                .ok_or_else(|| bad("shape entries must fit the platform's sizes"))?;
            let offs = &v.data_offsets;
            let [b, e] = offs[..] else {
                return Err(bad("data_offsets must have two entries"));
            };
            let count = crate::tensor::element_count(&shape)
                .ok_or_else(|| bad(&format!("shape {shape:?} is too large for an array")))?
                as u64;
            let bytes = count
                .checked_mul(element_size(format) as u64)
                .ok_or_else(|| bad("shape overflows"))?;
            if e < b || e - b != bytes {
                return Err(bad(&format!(
                    "data_offsets [{b}, {e}] do not hold {count} {dtype} elements ({bytes} bytes)"
                )));
            }
            if size != u64::MAX && e > data_len {
                return Err(bad(&format!(
                    "data_offsets end {e} lies past the data ({data_len} bytes): truncated file?"
                )));
            }
            entries.insert(
                name,
                Entry {
                    format,
                    shape,
                    range: (b, e),
                },
            );
        }
        // Byte ranges must not overlap (a lying header could alias one tensor's data to
        // another's); empty tensors occupy nothing.
        let mut ranges: Vec<(u64, u64, &String)> = entries
            .iter()
            .map(|(n, e)| (e.range.0, e.range.1, n))
            .filter(|(b, e, _)| e > b)
            .collect();
        ranges.sort();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(err(
                    path,
                    format!(
                        "tensors '{}' [{}, {}] and '{}' [{}, {}] overlap",
                        w[0].2, w[0].0, w[0].1, w[1].2, w[1].0, w[1].1
                    ),
                ));
            }
        }
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            file: None,
            reopen: None,
            data_start,
            entries: std::sync::Arc::new(entries),
            metadata: std::sync::Arc::new(metadata),
            scratch: Vec::new(),
            memory: None,
        })
    }

    /// Close the handle and reopen `real` (the resolved path it was opened from) for every
    /// read, closing it again after: a trace of many ranks then holds no file open between
    /// reads. A reopened file whose size changed since its header was validated is refused.
    pub fn release(&mut self, real: &Path) -> Result<()> {
        let size = match &self.file {
            Some(f) => f
                .metadata()
                .map_err(|e| Error::io(&self.path, "cannot stat", e))?
                .len(),
            None => return Ok(()),
        };
        self.file = None;
        self.reopen = Some((real.to_path_buf(), size));
        Ok(())
    }

    /// A second reader of a released file (see [`SafetensorsFile::release`]) sharing its
    /// validated header: no copy of the entries, its own read buffer. `None` while the file
    /// holds an open handle.
    pub fn share(&self) -> Option<SafetensorsFile> {
        if self.file.is_some() {
            return None;
        }
        Some(SafetensorsFile {
            path: self.path.clone(),
            file: None,
            reopen: self.reopen.clone(),
            data_start: self.data_start,
            entries: self.entries.clone(),
            metadata: self.metadata.clone(),
            scratch: Vec::new(),
            memory: self.memory.clone(),
        })
    }

    /// Whether tensor `name`'s bytes can be read: any tensor the header declares of a file,
    /// only those held of a file in memory.
    pub fn holds(&self, name: &str) -> bool {
        match &self.memory {
            Some(h) => h.contains_key(name),
            None => self.entries.contains_key(name),
        }
    }

    /// Tensor names and entries.
    pub fn entries(&self) -> &BTreeMap<String, Entry> {
        &self.entries
    }

    /// The `__metadata__` map.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Read one tensor.
    pub fn read(&mut self, name: &str) -> Result<Tensor> {
        self.read_reusing(name, Vec::new())
    }

    /// [`SafetensorsFile::read`] decoding into `buffer` (its capacity is reused; its contents
    /// are replaced).
    pub fn read_reusing(&mut self, name: &str, mut buffer: Vec<f64>) -> Result<Tensor> {
        let mut bytes = std::mem::take(&mut self.scratch);
        let read = self.read_into(name, &mut bytes);
        let decoded = read.and_then(|e| {
            decode_values_into(&bytes, e.format, &mut buffer)?;
            // Decoded patterns are values of the format by construction.
            Ok(Tensor::from_parts_unchecked(&e.shape, buffer, e.format))
        });
        self.scratch = bytes;
        decoded
    }

    /// One tensor as stored (its patterns not decoded), read into `buffer` (its capacity is
    /// reused; its contents are replaced).
    pub(crate) fn read_stored(&mut self, name: &str, mut buffer: Vec<u8>) -> Result<Stored> {
        let e = self.read_into(name, &mut buffer)?;
        // The header's validation tied the byte range to the shape and the format.
        Ok(Stored::from_parts_unchecked(&e.shape, e.format, buffer))
    }

    /// Elements `start..end` of a tensor as stored (a block of a larger read), into `buffer`.
    pub(crate) fn read_stored_range(
        &mut self,
        name: &str,
        start: usize,
        end: usize,
        mut buffer: Vec<u8>,
    ) -> Result<Stored> {
        let e = self.read_range_into(name, Some((start, end)), &mut buffer)?;
        Ok(Stored::from_parts_unchecked(
            &[end - start],
            e.format,
            buffer,
        ))
    }

    /// Read a tensor's bytes into `bytes` (resized to them); its entry.
    fn read_into(&mut self, name: &str, bytes: &mut Vec<u8>) -> Result<Entry> {
        self.read_range_into(name, None, bytes)
    }

    /// [`SafetensorsFile::read_into`], of elements `start..end` only when a range is given.
    fn read_range_into(
        &mut self,
        name: &str,
        elements: Option<(usize, usize)>,
        bytes: &mut Vec<u8>,
    ) -> Result<Entry> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| err(&self.path, format!("no tensor named '{name}'")))?
            .clone();
        let size = element_size(e.format) as u64;
        let (from, to) = match elements {
            None => e.range,
            Some((a, b)) => {
                let (ba, bb) = (a as u64 * size, b as u64 * size);
                if ba > bb || bb > e.range.1 - e.range.0 {
                    return Err(err(
                        &self.path,
                        format!("elements {a}..{b} lie outside tensor '{name}'"),
                    ));
                }
                (e.range.0 + ba, e.range.0 + bb)
            }
        };
        let len = usize::try_from(to - from)
            .map_err(|_| err(&self.path, format!("tensor '{name}' is too large to read")))?;
        if let Some(held) = &self.memory {
            let data = held.get(name).ok_or_else(|| {
                err(
                    &self.path,
                    format!("tensor '{}' is not held by this process", printable(name)),
                )
            })?;
            let at = usize::try_from(from - e.range.0).unwrap_or(usize::MAX);
            let piece = data.get(at..at.saturating_add(len)).ok_or_else(|| {
                err(
                    &self.path,
                    format!("tensor '{}' is held short", printable(name)),
                )
            })?;
            bytes.clear();
            bytes.extend_from_slice(piece);
            return Ok(e);
        }
        let mut reopened = None;
        let file = match (&mut self.file, &self.reopen) {
            (Some(f), _) => f,
            (None, Some((real, size))) => {
                let f = crate::io::guard::open_regular(real).map_err(|e| match e {
                    Error::File { reason, .. } => err(&self.path, reason),
                    other => other,
                })?;
                let now = f
                    .metadata()
                    .map_err(|e| Error::io(&self.path, "cannot stat", e))?
                    .len();
                if now != *size {
                    return Err(err(
                        &self.path,
                        format!("changed while it was read ({size} bytes, now {now})"),
                    ));
                }
                reopened.insert(f)
            }
            (None, None) => return Err(err(&self.path, "file is closed")),
        };
        // Read into the buffer's spare capacity: no zeroing of bytes about to be overwritten.
        // A buffer too small is replaced, not grown (growing would copy its stale bytes).
        bytes.clear();
        if bytes.capacity() < len {
            *bytes = Vec::new();
        }
        bytes.reserve_exact(len);
        file.seek(SeekFrom::Start(self.data_start + from))
            .and_then(|_| file.take(len as u64).read_to_end(bytes))
            .and_then(|got| {
                if got == len {
                    Ok(())
                } else {
                    Err(std::io::ErrorKind::UnexpectedEof.into())
                }
            })
            .map_err(|er| Error::io(&self.path, format!("reading '{name}'"), er))?;
        Ok(e)
    }
}

/// Write tensors (name, tensor stored in its own format) and metadata to `path`.
pub fn write(
    path: &Path,
    tensors: &[(&str, &Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let encoded = tensors
        .iter()
        .map(|(name, t)| encode_values(t.values(), t.format(), name))
        .collect::<Result<Vec<_>>>()?;
    let stored: Vec<StoredTensor<'_>> = tensors
        .iter()
        .zip(&encoded)
        .map(|((name, t), bytes)| StoredTensor {
            name,
            format: t.format(),
            shape: t.shape(),
            bytes,
        })
        .collect();
    write_stored(path, &stored, metadata, true)
}

/// One tensor as stored: its element patterns, little-endian, in row-major order.
#[derive(Debug, Clone, Copy)]
pub struct StoredTensor<'a> {
    /// The name (key) in the file.
    pub name: &'a str,
    /// The element format.
    pub format: Format,
    /// The shape.
    pub shape: &'a [usize],
    /// `element_size(format) · Π shape` bytes.
    pub bytes: &'a [u8],
}

/// Write tensors given as their stored bytes (no decoding, no copy) and metadata to `path`,
/// atomically ([`write_atomic_parts`](crate::io::write_atomic_parts)): readers see the old file
/// or the whole new one; `fsync` forces the data to the device before the rename.
///
/// # Errors
///
/// [`Error::File`] for a format without a safetensors dtype, a byte count that does not match
/// the shape, a name given twice, or a failed write.
pub fn write_stored(
    path: &Path,
    tensors: &[StoredTensor<'_>],
    metadata: &BTreeMap<String, String>,
    fsync: bool,
) -> Result<()> {
    let header = encode_header(path, tensors, metadata)?;
    let mut parts: Vec<&[u8]> = Vec::with_capacity(1 + tensors.len());
    parts.push(&header);
    parts.extend(tensors.iter().map(|t| t.bytes));
    crate::io::write_atomic_parts(path, &parts, fsync)
}

/// The header of a safetensors file holding `tensors` (in order) and `metadata`: the 8-byte
/// length and the JSON, padded with spaces to a multiple of 8 as the reference implementation
/// does. The file is this followed by the tensors' bytes. `path` names the file in errors.
///
/// # Errors
///
/// As [`write_stored`], without the write.
pub fn encode_header(
    path: &Path,
    tensors: &[StoredTensor<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for t in tensors {
        let name = t.name;
        let dtype = dtype_name(t.format).ok_or_else(|| {
            err(
                path,
                format!("tensor '{name}': {} has no safetensors dtype", t.format),
            )
        })?;
        let expected = crate::tensor::element_count(t.shape)
            .and_then(|n| n.checked_mul(element_size(t.format)));
        if expected != Some(t.bytes.len()) {
            return Err(err(
                path,
                format!(
                    "tensor '{name}': {} bytes for shape {:?} of {}",
                    t.bytes.len(),
                    t.shape,
                    t.format
                ),
            ));
        }
        let end = offset + t.bytes.len();
        let entry =
            serde_json::json!({"dtype": dtype, "shape": t.shape, "data_offsets": [offset, end]});
        if header.insert(name.to_string(), entry).is_some() || name == "__metadata__" {
            return Err(err(
                path,
                format!("tensor name '{name}' given twice or reserved"),
            ));
        }
        offset = end;
    }
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let h = serde_json::to_vec(&serde_json::Value::Object(header))
        .map_err(|e| err(path, e.to_string()))?;
    let padded = h.len().div_ceil(8) * 8;
    let mut out = Vec::with_capacity(8 + padded);
    out.extend_from_slice(&(padded as u64).to_le_bytes());
    out.extend_from_slice(&h);
    // Padded with spaces to a multiple of 8 (as the reference implementation does).
    out.resize(8 + padded, b' ');
    Ok(out)
}
