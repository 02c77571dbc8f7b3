//! Our safetensors reader against Hugging Face's `safetensors` crate (issue 17: use the
//! well-kept parser, or show why ours is kept — `docs/safetensors-reader.md`).
//!
//! * Valid files (every dtype we read, empty and scalar tensors, metadata): both readers see
//!   the same names, dtypes, shapes and bytes — the crate is an independent oracle for ours.
//! * Hostile files: ours refuses each with a file error; what the crate does is asserted too,
//!   so the comparison in the docs stays true for the version in `Cargo.lock`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use safetensors::SafeTensors;
use ttrace::io::safetensors as ours;
use ttrace::Tensor;
use ttrace::{Error, Format, Overflow};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-stcrate-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn hf_dtype(f: Format) -> safetensors::Dtype {
    use safetensors::Dtype;
    match f {
        Format::F64 => Dtype::F64,
        Format::F32 => Dtype::F32,
        Format::F16 => Dtype::F16,
        Format::BF16 => Dtype::BF16,
        Format::E4M3 => Dtype::F8_E4M3,
        Format::E5M2 => Dtype::F8_E5M2,
        other => panic!("no safetensors dtype for {other}"),
    }
}

#[test]
fn valid_files_read_alike() {
    let shapes: [&[usize]; 4] = [&[3, 5], &[0, 4], &[], &[2, 1, 7]];
    let formats = [
        Format::F64,
        Format::F32,
        Format::F16,
        Format::BF16,
        Format::E4M3,
        Format::E5M2,
    ];
    let mut tensors = vec![];
    for (i, f) in formats.iter().enumerate() {
        for (j, shape) in shapes.iter().enumerate() {
            let n: usize = shape.iter().product();
            let v: Vec<f64> = (0..n).map(|k| (k as f64 - 3.0) * 0.37 + i as f64).collect();
            let t = Tensor::rounded(shape, v, *f, Overflow::Saturating).unwrap();
            tensors.push((format!("t{i}.{j}"), t));
        }
    }
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut meta = BTreeMap::new();
    meta.insert("producer".to_string(), "ttrace test".to_string());
    let path = tmp("valid.safetensors");
    ours::write(&path, &named, &meta).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let hf = SafeTensors::deserialize(&bytes).unwrap();
    let (_, hf_meta) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        hf_meta
            .metadata()
            .as_ref()
            .unwrap()
            .get("producer")
            .unwrap(),
        "ttrace test"
    );
    let mut mine = ours::SafetensorsFile::open(&path).unwrap();
    assert_eq!(mine.entries().len(), hf.len());
    for (name, t) in &tensors {
        let view = hf.tensor(name).unwrap();
        let entry = mine.entries()[name].clone();
        assert_eq!(view.dtype(), hf_dtype(entry.format), "{name}");
        assert_eq!(view.shape(), &entry.shape[..], "{name}");
        let read = mine.read(name).unwrap();
        assert_eq!(&read, t, "{name}");
        // Our values, encoded back, are the crate's bytes.
        let encoded = ours::encode_values(read.values(), entry.format, name).unwrap();
        assert_eq!(view.data(), &encoded[..], "{name}");
    }
}

/// A file with the given header text and `data` zero bytes after it.
fn file(name: &str, header: &str, data: usize) -> (PathBuf, Vec<u8>) {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend(std::iter::repeat_n(0u8, data));
    let p = tmp(name);
    std::fs::write(&p, &b).unwrap();
    (p, b)
}

#[test]
fn hostile_files_are_refused_and_the_crates_answers_are_as_documented() {
    let ours_refuses = |p: &PathBuf| match ours::SafetensorsFile::open(p) {
        Err(Error::File { reason, .. }) => reason,
        other => panic!("{}: expected a file error, got {other:?}", p.display()),
    };
    let t = |dtype: &str, shape: &str, a: u64, b: u64| {
        format!(r#"{{"dtype":"{dtype}","shape":{shape},"data_offsets":[{a},{b}]}}"#)
    };
    // A name given twice: ours names the problem; the crate keeps one entry and then reports
    // an offset error (safetensors issue #401).
    let (p, b) = file(
        "dup.safetensors",
        &format!(
            r#"{{"x":{},"x":{}}}"#,
            t("F32", "[1]", 0, 4),
            t("F32", "[1]", 4, 8)
        ),
        8,
    );
    assert!(ours_refuses(&p).contains("twice"));
    assert!(matches!(
        SafeTensors::deserialize(&b),
        Err(safetensors::SafeTensorError::InvalidOffset(_))
    ));
    // A field named twice inside an entry: both refuse.
    let (p, b) = file(
        "dupfield.safetensors",
        r#"{"x":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}}"#,
        4,
    );
    assert!(ours_refuses(&p).contains("duplicate field"));
    assert!(matches!(
        SafeTensors::deserialize(&b),
        Err(safetensors::SafeTensorError::InvalidHeaderDeserialization(
            ..
        ))
    ));
    // Overlapping ranges (one tensor's bytes aliased by another): both refuse.
    let (p, b) = file(
        "overlap.safetensors",
        &format!(
            r#"{{"a":{},"b":{}}}"#,
            t("F32", "[2]", 0, 8),
            t("F32", "[2]", 4, 12)
        ),
        12,
    );
    assert!(ours_refuses(&p).contains("overlap"));
    assert!(matches!(
        SafeTensors::deserialize(&b),
        Err(safetensors::SafeTensorError::InvalidOffset(..))
    ));
    // A shape whose byte count overflows, a dtype we do not read, data past the end, a
    // header longer than the file: both refuse.
    for (name, header, data) in [
        (
            "overflow.safetensors",
            t("F32", "[4294967296,4294967296,16]", 0, 4),
            4,
        ),
        ("int.safetensors", t("I64", "[1]", 0, 8), 8),
        ("past.safetensors", t("F32", "[4]", 0, 16), 8),
    ] {
        let (p, b) = file(name, &format!(r#"{{"x":{header}}}"#), data);
        ours_refuses(&p);
        if name != "int.safetensors" {
            assert!(SafeTensors::deserialize(&b).is_err(), "{name}");
        }
    }
    let mut lie = (1u64 << 20).to_le_bytes().to_vec();
    lie.extend_from_slice(b"{}");
    let p = tmp("lie.safetensors");
    std::fs::write(&p, &lie).unwrap();
    ours_refuses(&p);
    assert!(matches!(
        SafeTensors::deserialize(&lie),
        Err(safetensors::SafeTensorError::InvalidHeaderLength)
    ));
    // The crate needs the whole file in one buffer (it checks that the data region covers the
    // buffer exactly): reading only the header, as ours does, is refused by it.
    let (_, whole) = file(
        "ok.safetensors",
        &format!(r#"{{"x":{}}}"#, t("F32", "[4]", 0, 16)),
        16,
    );
    let header_only = &whole[..whole.len() - 16];
    assert!(matches!(
        SafeTensors::read_metadata(header_only),
        Err(safetensors::SafeTensorError::MetadataIncompleteBuffer)
    ));
    // Gaps between tensors (legal for ours, which only forbids overlaps): refused by the crate.
    let (p, b) = file(
        "gap.safetensors",
        &format!(
            r#"{{"a":{},"b":{}}}"#,
            t("F32", "[1]", 0, 4),
            t("F32", "[1]", 8, 12)
        ),
        12,
    );
    assert!(ours::SafetensorsFile::open(&p).is_ok());
    assert!(matches!(
        SafeTensors::deserialize(&b),
        Err(safetensors::SafeTensorError::InvalidOffset(..))
    ));
}
