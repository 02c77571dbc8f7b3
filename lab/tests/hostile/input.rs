//! Text and structure from files and arguments: strict parsing, extreme decimals, bounded manifests, shapes and meshes, escaped names, layouts on axes of size one.

use super::*;

#[test]
fn sizes_from_arguments_are_bounded() {
    for p in ["18446744073709551615", "1000000000"] {
        let cand = format!("--cand=in=bf16,acc=f32,out=f32,order=splitk:{p}:f32:tree");
        let (code, _, err) = ttrace(&["threshold", "matmul", &cand]);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("'parts'"), "{err}");
    }
    for arg in ["--seeds", "--samples"] {
        let (code, _, err) = ttrace(&["validate", arg, "18446744073709551615"]);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains(arg), "{err}");
    }
    // Groups × parts that overflow: a typed error from the library, not a panic.
    use ttrace::trace::{Axis, Layout, Mesh, Placement};
    let mesh = Mesh::megatron(2, 1, 1, false).unwrap();
    let t = ttrace::Tensor::zeros(&[4, 4], ttrace::Format::F32);
    let mut layout = Layout::replicated();
    layout.set(
        Axis::TP,
        Placement::Split {
            dim: 0,
            groups: usize::MAX,
        },
    );
    assert!(matches!(
        ttrace::trace::shard(&t, &layout, &mesh, "t"),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
}

/// Ids come from files: escape sequences in them never reach the terminal, in the verdict
/// table, the first-failure line or the localization line of `ttrace check`.
#[test]
fn ids_are_escaped_when_printed() {
    let b = base("escape");
    let evil = "evil\u{1b}[2J\u{1b}]0;title\u{7}|fwd.output.0";
    let (r, c) = (b.join("reference"), b.join("candidate"));
    write_f32_trace(&r, &[(evil, vec![1.0, 2.0])], &[]);
    write_f32_trace(&c, &[(evil, vec![1.0, 3.0])], &[]);
    let (code, out, err) = check(&r, &c);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        !out.contains('\u{1b}') && !out.contains('\u{7}') && !err.contains('\u{1b}'),
        "{out:?}"
    );
    assert!(out.contains("evil") && out.contains("FAIL"), "{out}");
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn strict_parsing_refuses_duplicates_and_wrong_types() {
    let b = base("strict");
    let (r, c) = dump(&b.join("run"), &[]);
    // A manifest naming "version" twice.
    let text = std::fs::read_to_string(c.join("manifest.json")).unwrap();
    let twice = text.replacen('{', "{\"version\": 2, ", 1);
    std::fs::write(c.join("manifest.json"), &twice).unwrap();
    let (code, _, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("twice"), "{err}");
    // A nested duplicate in a tensor entry.
    let dup = text.replacen("\"dtype\":", "\"dtype\": \"f32\", \"dtype\":", 1);
    std::fs::write(c.join("manifest.json"), &dup).unwrap();
    let (code, _, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("twice"), "{err}");
    std::fs::write(c.join("manifest.json"), &text).unwrap();
    // A safetensors header with a nested duplicate key.
    let header = br#"{"a":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 4]);
    let p = b.join("dup.safetensors");
    std::fs::write(&p, &bytes).unwrap();
    let e = ttrace::io::safetensors::SafetensorsFile::open(&p).unwrap_err();
    assert!(matches!(e, ttrace::Error::File { .. }), "{e}");
    assert!(e.to_string().contains("duplicate field `dtype`"), "{e}");
    // npy headers: fortran_order must be True or False; descr only as a key.
    let npy = |dict: &str| {
        let mut h = dict.to_string();
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(' ');
        }
        h.push('\n');
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend_from_slice(&(h.len() as u16).to_le_bytes());
        bytes.extend_from_slice(h.as_bytes());
        bytes.extend_from_slice(&[0; 4]);
        let p = b.join("t.npy");
        std::fs::write(&p, &bytes).unwrap();
        ttrace::io::npy::read(&p, None)
    };
    assert!(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }").is_ok());
    for bad in [
        "{'descr': '<f4', 'fortran_order': 1, 'shape': (1,), }",
        "{'note': \"'descr': '<f4'\", 'fortran_order': False, 'shape': (1,), }",
        "{'descr': '<f4', 'descr': '<f8', 'fortran_order': False, 'shape': (1,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), } trailing",
    ] {
        let e = npy(bad).unwrap_err();
        assert!(matches!(e, ttrace::Error::File { .. }), "{bad}: {e}");
    }
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn extreme_decimal_text_rounds_correctly() {
    use ttrace::{Format, Overflow};
    // 0.111… (a million ones, written as an integer with exponent −1,000,000) and 0.1 written
    // with a million zeros and exponent +1,000,000: Rust's parser saturates such exponents.
    let ones = format!("{}e-1000000", "1".repeat(1_000_000));
    let tenth = format!("0.{}1e1000000", "0".repeat(1_000_000));
    for (text, value) in [(&ones, 1.0 / 9.0), (&tenth, 0.1)] {
        let start = Instant::now();
        let f64_ = Format::F64
            .round_decimal(text, Overflow::NonSaturating)
            .unwrap();
        assert_eq!(f64_, value);
        let bf = Format::BF16
            .round_decimal(text, Overflow::NonSaturating)
            .unwrap();
        assert_eq!(bf, half::bf16::from_f64(value).to_f64());
        let f32_ = Format::F32
            .round_decimal(text, Overflow::NonSaturating)
            .unwrap();
        assert_eq!(f32_, value as f32 as f64);
        assert!(start.elapsed() < Duration::from_secs(10));
    }
    // Exponents beyond any integer type: zero and overflow, not errors.
    let tiny = Format::F32.round_decimal("1e-99999999999999999999999", Overflow::NonSaturating);
    assert_eq!(tiny.unwrap(), 0.0);
    let huge = Format::BF16.round_decimal("-1e99999999999999999999", Overflow::NonSaturating);
    assert_eq!(huge.unwrap(), f64::NEG_INFINITY);
    // The CLI prints the same.
    let path = base("decimal").join("in.txt");
    std::fs::write(&path, format!("{ones}\n{tenth}\n")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_ttrace"))
        .args(["round", "--format", "f64"])
        .stdin(std::fs::File::open(&path).unwrap())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["0.1111111111111111", "0.1"]
    );
}

/// A trace of one 256 MiB FP8 tensor (a sparse file of zeros) checked against itself under an
/// address-space limit of 1.5 GiB: tensors stay in their stored format (decoded to `f64` on
/// both sides, this pair once took 4.9 GB). Then a manifest over the 512 MiB limit (sparse
/// too): refused by its size, before it is read.
#[test]
fn narrow_formats_stay_narrow_and_manifests_are_bounded() {
    let b = base("narrow");
    let n: u64 = 1 << 28;
    for side in ["reference", "candidate"] {
        let d = b.join(side);
        std::fs::create_dir_all(&d).unwrap();
        let mut header = format!(
            r#"{{"x|fwd.output.0":{{"dtype":"F8_E4M3","shape":[16384,16384],"data_offsets":[0,{n}]}}}}"#
        );
        while header.len() % 8 != 0 {
            header.push(' ');
        }
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        let f = d.join("rank0.safetensors");
        std::fs::write(&f, &bytes).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
        file.set_len(bytes.len() as u64 + n).unwrap();
        let manifest = serde_json::json!({
            "format": "ttrace-trace", "version": 1,
            "mesh": {"tp": 1, "cp": 1, "dp": 1, "sp": false},
            "tensors": [{"id": "x|fwd.output.0", "rank": 0, "file": "rank0.safetensors",
                "key": "x|fwd.output.0", "dtype": "e4m3",
                "layout": {"dp": {"kind": "replicate"}, "cp": {"kind": "replicate"},
                           "tp": {"kind": "replicate"}}}]
        });
        write_manifest(&d, &manifest);
    }
    let (r, c) = (b.join("reference"), b.join("candidate"));
    // 1.5 GiB of address space.
    let (code, out, err) = check_limited("-v 1572864", &r, &c);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("PASS"), "{out}");
    let m = c.join("manifest.json");
    let file = std::fs::OpenOptions::new().write(true).open(&m).unwrap();
    file.set_len(600 << 20).unwrap();
    let (code, _, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("manifest.json") && err.contains("limit"),
        "{err}"
    );
    std::fs::remove_dir_all(&b).unwrap();
}

/// Sizes from files use checked arithmetic: shards whose merged element count overflows are an
/// error (they used to wrap to an empty shape that "matched" an empty reference); a manifest
/// of 5,000 ids on an incomplete 2^20-rank mesh is refused at once, without an allocation per
/// rank and id.
#[test]
fn overflowing_shapes_and_huge_meshes_are_refused() {
    use ttrace::trace::{merge, Axis, Layout, Mesh, Placement};
    let mesh = Mesh::megatron(4, 1, 1, false).unwrap();
    let t = ttrace::Tensor::zeros(&[1 << 62, 0], ttrace::Format::F32);
    let layout = Layout::replicated().with(Axis::TP, Placement::split(0));
    let shards = vec![t.clone(), t.clone(), t.clone(), t];
    let e = merge(&shards, &layout, &mesh, "x", None).unwrap_err();
    assert!(matches!(e, ttrace::Error::Layout { .. }), "{e}");

    let b = base("mesh");
    let (r, c) = dump(&b.join("run"), &[]);
    let mut m = manifest(&c);
    let first = m["tensors"][0].clone();
    m["mesh"] = serde_json::json!({"tp": 1 << 20, "cp": 1, "dp": 1, "sp": false});
    m["tensors"] = (0..5000)
        .map(|k| {
            let mut e = first.clone();
            e["id"] = serde_json::json!(format!("m{k}|fwd.output.0"));
            e
        })
        .collect();
    write_manifest(&c, &m);
    // 1 GiB of address space.
    let (code, _, err) = check_limited("-v 1048576", &r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no shard for rank 1"), "{err}");
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn newlines_in_names_from_a_file_forge_no_report_line() {
    // A tensor id and a module kind holding a newline (and an escape sequence) followed by a
    // verdict line: every report and error line stays one line, escaped.
    let b = base("forge");
    let run = b.join("run");
    let args = [
        "simulate",
        "--tp",
        "2",
        "--bug",
        "row-bias-on-every-rank",
        "--dump",
    ];
    let (code, _, err) = ttrace(&[&args[..], &[run.to_str().unwrap()]].concat());
    assert_eq!(code, Some(1), "{err}");
    let (r, c) = (run.join("reference"), run.join("candidate"));
    let forged = "\nPASS: all 9 tensors within their thresholds \u{1b}[32m";
    for dir in [&r, &c] {
        let mut m = manifest(dir);
        for t in m["tensors"].as_array_mut().unwrap() {
            let id = t["id"].as_str().unwrap().to_string();
            t["id"] = serde_json::Value::String(id.replacen('|', &format!("{forged}|"), 1));
        }
        write_manifest(dir, &m);
    }
    let (code, out, err) = check(&r, &c);
    assert_eq!(code, Some(1), "{out}{err}");
    let text = format!("{out}{err}");
    assert!(!text.contains('\u{1b}'), "{text}");
    assert!(
        text.lines().all(|l| !l.starts_with("PASS: all 9")),
        "{text}"
    );
    // A module kind that is no kind: the error names it on one escaped line.
    let mut m = manifest(&c);
    m["tensors"][0]["module"] = serde_json::json!({"kind": format!("linear{forged}")});
    write_manifest(&c, &m);
    let (code, out, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{out}{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        !err.contains('\u{1b}') && err.contains("\\u{a}PASS"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&b);
}

#[test]
fn layouts_on_an_axis_of_size_one_are_validated_too() {
    // The reference's mesh is one rank: its placements cut nothing, but one no mesh could use
    // (a split of dimension 99, or of 0 or 2^64 − 1 groups) is refused as at tp = 2.
    let b = base("size1");
    let (r, c) = dump(&b.join("run"), &[]);
    let original = manifest(&r);
    let cases = [
        (
            serde_json::json!({"kind": "split", "dim": 99, "groups": 1}),
            "dimension 99",
        ),
        (
            serde_json::json!({"kind": "split", "dim": 0, "groups": 0}),
            "0 group(s)",
        ),
        (
            serde_json::json!({"kind": "split", "dim": 0, "groups": u64::MAX}),
            "group(s)",
        ),
        (
            serde_json::json!({"kind": "cp_chunks", "dim": 70}),
            "dimension 70",
        ),
    ];
    for (placement, said) in cases {
        let mut m = original.clone();
        m["tensors"][0]["layout"]["tp"] = placement.clone();
        write_manifest(&r, &m);
        let (code, out, err) = check(&r, &c);
        assert_eq!(code, Some(2), "{placement}: {out}{err}");
        assert!(
            err.contains(said) && err.contains("layout along tp"),
            "{err}"
        );
    }
    // A dimension within the limits that the tensor lacks: refused when it is merged.
    let mut m = original.clone();
    m["tensors"][0]["layout"]["tp"] = serde_json::json!({"kind": "split", "dim": 9, "groups": 1});
    write_manifest(&r, &m);
    let (code, out, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(err.contains("dimension 9"), "{err}");
    let _ = std::fs::remove_dir_all(&b);
}

#[test]
fn a_key_named_twice_is_refused_inside_fields_ttrace_does_not_know() {
    // "A key named twice is an error at any depth": in an unknown top-level field, in an
    // unknown field of an entry, in an unknown field of a module. Unknown fields themselves
    // are read past (a newer writer's), named once.
    let b = base("twice");
    let (r, c) = dump(&b.join("run"), &[]);
    let text = std::fs::read_to_string(c.join("manifest.json")).unwrap();
    let first_entry = text.find("\"id\"").unwrap();
    let kind = text.find("\"module\":{").unwrap() + "\"module\":{".len();
    let cases = [
        (
            text.replacen(
                "\"format\"",
                "\"extra\": {\"a\": 1, \"a\": 2},\n\"format\"",
                1,
            ),
            true,
        ),
        (
            text.replacen(
                "\"format\"",
                "\"extra\": {\"a\": 1, \"b\": 2},\n\"format\"",
                1,
            ),
            false,
        ),
        (
            format!(
                "{}\"note\": [{{\"x\": 1, \"x\": 1}}], {}",
                &text[..first_entry],
                &text[first_entry..]
            ),
            true,
        ),
        (
            format!(
                "{}\"hint\": {{\"y\": 0, \"y\": 0}}, {}",
                &text[..kind],
                &text[kind..]
            ),
            true,
        ),
    ];
    for (manifest, twice) in cases {
        std::fs::write(c.join("manifest.json"), &manifest).unwrap();
        let (code, out, err) = check(&r, &c);
        if twice {
            assert_eq!(code, Some(2), "{out}{err}");
            assert!(err.contains("appears twice"), "{err}");
        } else {
            assert_eq!(code, Some(0), "{out}{err}");
        }
    }
    let _ = std::fs::remove_dir_all(&b);
}
