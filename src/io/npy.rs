//! NumPy `.npy` files (format versions 1.0–3.0): magic `\x93NUMPY`, version, a little-endian
//! header length (2 bytes in 1.0, 4 in 2.0/3.0), a Python-literal dict
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }`, then C-order data.
//!
//! Element types read: `<f8`, `<f4`, `<f2` (their own formats), and the bit-pattern carriers
//! `<u2` / `<i2` (BF16, which NumPy lacks — `x.view(np.uint16)`) and `|u1` / `<u1` / `|i1`
//! (FP8 E4M3 or E5M2), whose format the caller names (the manifest's dtype). Fortran order,
//! big-endian data and other types are refused with a message.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};
use crate::format::codec::{element_size, encode_values};
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

/// Parse the header dict strictly, as NumPy's own reader does: exactly the keys `descr` (a
/// string), `fortran_order` (`True` or `False`) and `shape` (a tuple of non-negative integers),
/// each once; Python string quotes `'` or `"`; a trailing comma allowed; nothing after the
/// closing brace but spaces and the newline.
fn parse_header(text: &str, path: &Path) -> Result<(String, bool, Vec<usize>)> {
    let bad = |why: &str| err(path, format!("npy header: {why}"));
    let b = text.as_bytes();
    let mut i = 0;
    let skip = |i: &mut usize| {
        while *i < b.len() && matches!(b[*i], b' ' | b'\t' | b'\n' | b'\r') {
            *i += 1;
        }
    };
    let expect = |i: &mut usize, c: u8, what: &str| -> Result<()> {
        skip(i);
        if b.get(*i) == Some(&c) {
            *i += 1;
            Ok(())
        } else {
            Err(bad(&format!("expected {what}")))
        }
    };
    let string = |i: &mut usize| -> Result<String> {
        skip(i);
        let q = *b.get(*i).ok_or_else(|| bad("unexpected end"))?;
        if q != b'\'' && q != b'"' {
            return Err(bad("expected a quoted string"));
        }
        let from = *i + 1;
        let len = b[from..]
            .iter()
            .position(|&c| c == q || c == b'\\')
            .ok_or_else(|| bad("unterminated string"))?;
        if b[from + len] == b'\\' {
            return Err(bad("escapes in strings are not supported"));
        }
        *i = from + len + 1;
        Ok(text[from..from + len].to_string())
    };
    expect(&mut i, b'{', "'{'")?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    loop {
        skip(&mut i);
        if b.get(i) == Some(&b'}') {
            i += 1;
            break;
        }
        let key = string(&mut i)?;
        expect(&mut i, b':', "':' after a key")?;
        skip(&mut i);
        match key.as_str() {
            "descr" if descr.is_none() => descr = Some(string(&mut i)?),
            "fortran_order" if fortran.is_none() => {
                fortran = Some(if text[i..].starts_with("True") {
                    i += 4;
                    true
                } else if text[i..].starts_with("False") {
                    i += 5;
                    false
                } else {
                    return Err(bad("'fortran_order' must be True or False"));
                });
            }
            "shape" if shape.is_none() => {
                expect(&mut i, b'(', "a tuple for 'shape'")?;
                let mut dims = Vec::new();
                loop {
                    skip(&mut i);
                    if b.get(i) == Some(&b')') {
                        i += 1;
                        break;
                    }
                    let from = i;
                    while i < b.len() && b[i].is_ascii_digit() {
                        i += 1;
                    }
                    let d = text[from..i]
                        .parse::<usize>()
                        .map_err(|_| bad("'shape' must be a tuple of non-negative integers"))?;
                    if dims.len() == crate::io::guard::limits::DIMS {
                        return Err(bad("'shape' has too many dimensions"));
                    }
                    dims.push(d);
                    skip(&mut i);
                    match b.get(i) {
                        Some(b',') => i += 1,
                        Some(b')') => {}
                        _ => return Err(bad("'shape' must be a tuple of non-negative integers")),
                    }
                }
                shape = Some(dims);
            }
            "descr" | "fortran_order" | "shape" => {
                return Err(bad(&format!("key '{key}' appears twice")))
            }
            other => {
                return Err(bad(&format!(
                    "unexpected key {} (an npy header has descr, fortran_order and shape)",
                    crate::io::guard::escape(other)
                )))
            }
        }
        skip(&mut i);
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => {}
            _ => return Err(bad("expected ',' or '}' after a value")),
        }
    }
    if text[i..]
        .bytes()
        .any(|c| !matches!(c, b' ' | b'\n' | b'\0'))
    {
        return Err(bad("text after the closing brace"));
    }
    match (descr, fortran, shape) {
        (Some(d), Some(f), Some(s)) => Ok((d, f, s)),
        _ => Err(bad("missing one of descr, fortran_order, shape")),
    }
}

/// The format a descr holds, given the format the manifest says for bit-pattern carriers.
fn descr_format(descr: &str, declared: Option<Format>, path: &Path) -> Result<Format> {
    let needs = |want: &[Format], what: &str| -> Result<Format> {
        match declared {
            Some(f) if want.contains(&f) => Ok(f),
            Some(f) => Err(err(
                path,
                format!("{descr} carries {what} bit patterns, not {f}"),
            )),
            None => Err(err(
                path,
                format!("{descr} carries {what} bit patterns: the manifest must name the dtype"),
            )),
        }
    };
    match descr {
        "<f8" => Ok(Format::F64),
        "<f4" => Ok(Format::F32),
        "<f2" => Ok(Format::F16),
        "<u2" | "<i2" => needs(&[Format::BF16, Format::F16], "16-bit"),
        "|u1" | "<u1" | "|i1" => needs(&[Format::E4M3, Format::E5M2], "8-bit"),
        other => Err(err(
            path,
            format!(
                "unsupported npy dtype {} (little-endian f8, f4, f2, or u2/u1 bit patterns)",
                crate::io::guard::escape(other)
            ),
        )),
    }
}

/// Read a `.npy` file; `declared` is the stored format the manifest names (needed for BF16
/// and FP8 bit patterns; when given it must agree with a float descr).
pub fn read(path: &Path, declared: Option<Format>) -> Result<Tensor> {
    read_from(path, crate::io::guard::open_regular(path)?, declared)
}

/// [`read`] from a file already opened (`path` names it in errors).
pub fn read_from(path: &Path, f: File, declared: Option<Format>) -> Result<Tensor> {
    Ok(read_stored_from(path, f, declared)?.decode())
}

/// [`read_from`] keeping the patterns as stored.
pub(crate) fn read_stored_from(
    path: &Path,
    mut f: File,
    declared: Option<Format>,
) -> Result<Stored> {
    let size = f
        .metadata()
        .map_err(|e| Error::io(path, "cannot stat", e))?
        .len();
    let mut pre = [0u8; 10];
    f.read_exact(&mut pre)
        .map_err(|_| err(path, "truncated: no npy preamble"))?;
    if &pre[..6] != b"\x93NUMPY" {
        return Err(err(path, "not an npy file (bad magic)"));
    }
    let (hlen, start) = match pre[6] {
        1 => (u16::from_le_bytes([pre[8], pre[9]]) as u64, 10u64),
        2 | 3 => {
            let mut more = [0u8; 2];
            f.read_exact(&mut more)
                .map_err(|_| err(path, "truncated npy preamble"))?;
            (
                u32::from_le_bytes([pre[8], pre[9], more[0], more[1]]) as u64,
                12u64,
            )
        }
        v => return Err(err(path, format!("unsupported npy version {v}"))),
    };
    if hlen > crate::io::guard::limits::NPY_HEADER_BYTES || start + hlen > size {
        return Err(err(
            path,
            format!("npy header length {hlen} exceeds the file ({size} bytes)"),
        ));
    }
    let mut h = vec![0u8; hlen as usize];
    f.read_exact(&mut h)
        .map_err(|e| Error::io(path, "reading the npy header", e))?;
    let text = String::from_utf8(h).map_err(|_| err(path, "npy header is not UTF-8"))?;
    let (descr, fortran, shape) = parse_header(&text, path)?;
    if fortran {
        return Err(err(
            path,
            "Fortran-order npy data is not supported (save with C order)",
        ));
    }
    let format = descr_format(&descr, declared, path)?;
    if let Some(d) = declared {
        if matches!(descr.as_str(), "<f8" | "<f4" | "<f2") && d != format {
            return Err(err(
                path,
                format!("file holds {descr} but the manifest says {d}"),
            ));
        }
    }
    let count = crate::tensor::element_count(&shape).ok_or_else(|| {
        err(
            path,
            format!("npy shape {shape:?} is too large for an array"),
        )
    })? as u64;
    let bytes = count
        .checked_mul(element_size(format) as u64)
        .ok_or_else(|| err(path, "npy shape overflows"))?;
    if size - start - hlen != bytes {
        return Err(err(
            path,
            format!(
                "npy data is {} bytes but shape {shape:?} of {descr} needs {bytes}: truncated or extra data",
                size - start - hlen
            ),
        ));
    }
    let mut data = vec![0u8; bytes as usize];
    f.read_exact(&mut data)
        .map_err(|e| Error::io(path, "reading npy data", e))?;
    // The size check above tied the data's length to the shape and the format.
    Ok(Stored::from_parts_unchecked(&shape, format, data))
}

/// Write a tensor as a version 1.0 `.npy` file (BF16 as `<u2`, FP8 as `|u1` bit patterns).
pub fn write(path: &Path, t: &Tensor) -> Result<()> {
    let descr = match t.format() {
        Format::F64 => "<f8",
        Format::F32 => "<f4",
        Format::F16 => "<f2",
        Format::BF16 => "<u2",
        Format::E4M3 | Format::E5M2 => "|u1",
        Format::TF32 => return Err(err(path, "TF32 has no npy dtype")),
    };
    let shape = match t.shape() {
        [] => "()".to_string(),
        [n] => format!("({n},)"),
        s => format!(
            "({})",
            s.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&encode_values(t.values(), t.format(), "npy")?);
    crate::io::write_atomic(path, &out)
}
