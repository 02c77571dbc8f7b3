//! Hostile input (issue 17): trace directories and arguments that try to escape the directory,
//! clobber files, hang, exhaust memory or pass when they must fail. Every case runs the real
//! binary (or the library) and asserts the documented behaviour: exit code 2 naming the file
//! and the problem, or a failing verdict with a reason — never a panic, a hang, an escape, a
//! clobbered file or a vacuous PASS.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Run the binary with a deadline: a hang is a test failure, not a stuck CI job.
fn run(args: &[&str], stdout: Stdio) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ttrace"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("ttrace {args:?} did not finish within 60 s (a hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ttrace(args: &[&str]) -> (Option<i32>, String, String) {
    let o = run(args, Stdio::piped());
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

fn base(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-hostile-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A clean pair of traces (TP 2) under `dir`: (reference, candidate).
fn dump(dir: &Path, extra: &[&str]) -> (PathBuf, PathBuf) {
    let mut args = vec!["simulate", "--tp", "2", "--dump", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    let (code, _, err) = ttrace(&args);
    assert_eq!(code, Some(0), "{err}");
    (dir.join("reference"), dir.join("candidate"))
}

fn check(r: &Path, c: &Path) -> (Option<i32>, String, String) {
    ttrace(&["check", r.to_str().unwrap(), c.to_str().unwrap()])
}

/// `ttrace check REF CAND` under a shell `ulimit` (e.g. `-v 1048576`): exit code, stdout,
/// stderr.
fn check_limited(limit: &str, r: &Path, c: &Path) -> (Option<i32>, String, String) {
    let script = format!(
        "ulimit {limit} && exec {} check {} {}",
        env!("CARGO_BIN_EXE_ttrace"),
        r.display(),
        c.display()
    );
    let o = Command::new("sh").arg("-c").arg(&script).output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

fn write_manifest(dir: &Path, m: &serde_json::Value) {
    std::fs::write(dir.join("manifest.json"), serde_json::to_string(m).unwrap()).unwrap();
}

#[test]
fn symlinks_that_leave_the_trace_directory_are_refused() {
    let b = base("escape");
    let (r, c) = dump(&b.join("run"), &[]);
    // A rank file that is a link to a copy outside: refused (it used to be read and checked).
    let outside = b.join("outside.safetensors");
    std::fs::copy(c.join("rank1.safetensors"), &outside).unwrap();
    std::fs::remove_file(c.join("rank1.safetensors")).unwrap();
    std::os::unix::fs::symlink(&outside, c.join("rank1.safetensors")).unwrap();
    let (code, _, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("rank1.safetensors") && err.contains("leaves the trace directory"),
        "{err}"
    );
    // A link that stays inside the directory is fine.
    std::fs::remove_file(c.join("rank1.safetensors")).unwrap();
    std::fs::rename(&outside, c.join("data1.bin")).unwrap();
    std::os::unix::fs::symlink("data1.bin", c.join("rank1.safetensors")).unwrap();
    let (code, out, err) = check(&r, &c);
    assert_eq!(code, Some(0), "{out}{err}");
    // A subdirectory linked to / and a manifest path through it: refused, nothing of the
    // outside file printed.
    std::os::unix::fs::symlink("/", c.join("sub")).unwrap();
    let mut m = manifest(&c);
    m["tensors"][0]["file"] = "sub/etc/passwd.npy".into();
    write_manifest(&c, &m);
    let (code, out, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(!err.contains("root:") && !out.contains("root:"), "{err}");
    m["tensors"][0]["file"] = "sub/etc/passwd".into();
    m["tensors"][0]["dtype"] = "f32".into();
    write_manifest(&c, &m);
    let (code, _, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("leaves the trace directory"), "{err}");
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn fifos_and_devices_are_refused_without_hanging() {
    let b = base("fifo");
    let (r, c) = dump(&b.join("run"), &[]);
    // A rank file that is a FIFO (nobody writes to it): refused at once.
    std::fs::rename(c.join("rank0.safetensors"), b.join("saved")).unwrap();
    mkfifo(&c.join("rank0.safetensors"));
    let (code, _, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("rank0.safetensors") && err.contains("FIFO"),
        "{err}"
    );
    std::fs::remove_file(c.join("rank0.safetensors")).unwrap();
    std::fs::rename(b.join("saved"), c.join("rank0.safetensors")).unwrap();
    // A manifest that is a FIFO.
    std::fs::rename(c.join("manifest.json"), b.join("saved.json")).unwrap();
    mkfifo(&c.join("manifest.json"));
    let (code, _, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("manifest.json") && err.contains("FIFO"),
        "{err}"
    );
    // A manifest that is a link to /dev/zero (read forever, before): refused.
    std::fs::remove_file(c.join("manifest.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", c.join("manifest.json")).unwrap();
    let (code, _, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("manifest.json"), "{err}");
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn reports_never_clobber_inputs_or_devices() {
    let b = base("report");
    let (r, c) = dump(&b.join("run"), &[]);
    let rm = r.join("manifest.json");
    let before = std::fs::read(&rm).unwrap();
    // The reference's own manifest as the report path: refused, the manifest intact.
    let (code, _, err) = ttrace(&[
        "check",
        r.to_str().unwrap(),
        c.to_str().unwrap(),
        "--json",
        rm.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("inside the trace directory"), "{err}");
    assert_eq!(std::fs::read(&rm).unwrap(), before);
    // A FIFO nobody reads: an error at once, not a hang, and the FIFO stays a FIFO.
    let fifo = b.join("report.fifo");
    mkfifo(&fifo);
    let json = |p: &Path| {
        ttrace(&[
            "check",
            r.to_str().unwrap(),
            c.to_str().unwrap(),
            "--json",
            p.to_str().unwrap(),
        ])
    };
    let (code, _, err) = json(&fifo);
    assert_eq!(code, Some(2), "{err}");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    // /dev/null: written in place, still a character device afterwards.
    let (code, _, err) = json(Path::new("/dev/null"));
    assert_eq!(code, Some(0), "{err}");
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
    // A report path that is a link: the link is replaced, its target untouched.
    let target = b.join("precious.txt");
    std::fs::write(&target, "keep me").unwrap();
    let link = b.join("report.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let (code, _, err) = json(&link);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
    let meta = std::fs::symlink_metadata(&link).unwrap();
    assert!(meta.file_type().is_file());
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&link).unwrap()).unwrap();
    assert!(report.get("report").is_some());
    // No temporary file left beside it.
    let left: Vec<_> = std::fs::read_dir(&b)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(left.is_empty());
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn write_errors_on_stdout_exit_2() {
    let b = base("stdout");
    let (r, c) = dump(&b.join("run"), &[]);
    let full = || Stdio::from(std::fs::File::create("/dev/full").unwrap());
    for args in [
        vec!["check", r.to_str().unwrap(), c.to_str().unwrap()],
        vec!["bugs"],
        vec!["threshold", "matmul", "--m", "4", "--k", "64", "--n", "4"],
        vec!["simulate", "--tp", "2"],
        vec!["formats"],
    ] {
        let o = run(&args, full());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("No space left"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn vacuous_and_overflowing_comparisons_fail() {
    use ttrace::check::{apply_threshold, compare_tensor};
    use ttrace::Format;
    use ttrace::Tensor;
    let b = base("vacuous");
    let (r, c) = dump(&b.join("run"), &[]);
    // A reference with no tensors: an error, not "PASS: all 0 tensors".
    let mut m = manifest(&r);
    m["tensors"] = serde_json::json!([]);
    write_manifest(&r, &m);
    let (code, out, err) = check(&r, &c);
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(err.contains("no tensors"), "{err}");
    // FP64 values whose difference overflows: fail, under any threshold.
    let x = Tensor::from_vec(&[2], vec![1e200, 1e308], Format::F64).unwrap();
    let y = Tensor::from_vec(&[2], vec![-1e200, -1e308], Format::F64).unwrap();
    for th in [0.0, 1e300, f64::MAX, f64::INFINITY] {
        let v = compare_tensor("t", &x, &y, th, 1e-16);
        assert!(!v.passed, "{th}: {v:?}");
    }
    // Large but representable norms are measured, not overflowed: 1e200 against 1e200 + ulp.
    let z = Tensor::from_vec(&[1], vec![1e200], Format::F64).unwrap();
    let w = Tensor::from_vec(&[1], vec![1e200 * (1.0 + f64::EPSILON)], Format::F64).unwrap();
    let v = compare_tensor("t", &z, &w, 1e185, 1e-16);
    assert!(
        v.passed && v.rel_error > 0.0 && v.rel_error.is_finite(),
        "{v:?}"
    );
    // A differing tensor never passes on an infinite threshold; an identical one does.
    let mut v = compare_tensor("t", &z, &w, 0.0, 1e-16);
    apply_threshold(&mut v, 1.0, 1e200, f64::INFINITY);
    assert!(!v.passed && v.problem.is_some());
    let mut v = compare_tensor("t", &z, &z, 0.0, 1e-16);
    apply_threshold(&mut v, 0.0, 1e200, f64::INFINITY);
    assert!(v.passed);
    std::fs::remove_dir_all(&b).unwrap();
}

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
    use ttrace::trace::{Layout, Mesh, Placement};
    let mesh = Mesh::new(2, 1, 1, false).unwrap();
    let t = ttrace::Tensor::zeros(&[4, 4], ttrace::Format::F32);
    let mut layout = Layout::replicated();
    layout.tp = Placement::Split {
        dim: 0,
        groups: usize::MAX,
    };
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
fn many_ranks_check_within_a_small_open_file_limit() {
    let b = base("nofile");
    let dir = b.join("run");
    let (code, _, err) = ttrace(&[
        "simulate",
        "--tp",
        "4",
        "--dp",
        "4",
        "--dump",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{err}");
    // 16 rank files per side (32 open at once used to be needed, 3 times over); 16
    // descriptors, stdin/out/err included, are enough when files are opened one at a time.
    let (code, _, err) = check_limited("-n 16", &dir.join("reference"), &dir.join("candidate"));
    assert_eq!(code, Some(0), "{err}");
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

/// Scale the candidate's tensor `key` by `factor` (rounded to its format) in every rank file.
fn scale_candidate(c: &Path, key: &str, factor: f64) {
    use ttrace::io::safetensors::{write, SafetensorsFile};
    for entry in std::fs::read_dir(c).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let mut f = SafetensorsFile::open(&path).unwrap();
        let meta = f.metadata().clone();
        let names: Vec<String> = f.entries().keys().cloned().collect();
        let mut tensors = vec![];
        for n in &names {
            let mut t = f.read(n).unwrap();
            if n == key {
                let fmt = t.format();
                let v = t
                    .values()
                    .iter()
                    .map(|x| fmt.round(x * factor, ttrace::Overflow::NonSaturating))
                    .collect();
                t = ttrace::Tensor::from_vec(t.shape(), v, fmt).unwrap();
            }
            tensors.push(t);
        }
        drop(f);
        let list: Vec<(&str, &ttrace::Tensor)> =
            names.iter().map(String::as_str).zip(&tensors).collect();
        write(&path, &list, &meta).unwrap();
    }
}

/// A consumed tensor (a module's input, an arriving gradient) carries its difference into its
/// module's threshold: inflating it in the candidate must not widen that threshold unnoticed.
/// One passed between traced modules may differ no more than the tensor it equals in the
/// reference; one made by untraced code (autograd's sum of gradients) is judged on a rule the
/// candidate does not control.
#[test]
fn consumed_tensors_cannot_widen_thresholds() {
    let b = base("inflate");
    for (key, output) in [
        (
            "layers.1.mlp.fc2|fwd.input.0",
            Some("layers.1.mlp.fc2|fwd.output.0"),
        ),
        ("layers.0.resid1|grad.output.0", None),
    ] {
        let (r, c) = dump(&b.join(key.replace('|', "_")), &[]);
        scale_candidate(&c, key, 1.05);
        if let Some(o) = output {
            // The module's output wrong by as much: "explained" by the inflated input.
            scale_candidate(&c, o, 1.05);
        }
        for pricing in ["local", "auto"] {
            let json = b.join("report.json");
            let (code, out, err) = ttrace(&[
                "check",
                "--pricing",
                pricing,
                "--json",
                json.to_str().unwrap(),
                r.to_str().unwrap(),
                c.to_str().unwrap(),
            ]);
            assert_eq!(code, Some(1), "{key} {pricing}: {out}{err}");
            let j: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
            assert_eq!(j["report"]["first_failure"], key, "{pricing}: {out}");
        }
    }
    std::fs::remove_dir_all(&b).unwrap();
}

/// Write a one-rank trace of `(id, values)` in F32 (module kinds where given) under `dir`.
fn write_f32_trace(dir: &Path, tensors: &[(&str, Vec<f64>)], kinds: &[(&str, &str)]) {
    use ttrace::trace::{Layout, Mesh};
    use ttrace::Tensor;
    let entries: Vec<(String, Layout, Vec<Tensor>)> = tensors
        .iter()
        .map(|(id, v)| {
            let t = Tensor::from_vec(&[v.len()], v.clone(), ttrace::Format::F32).unwrap();
            (id.to_string(), Layout::replicated(), vec![t])
        })
        .collect();
    let modules = kinds
        .iter()
        .map(|(id, k)| {
            let kind = serde_json::from_value(serde_json::json!(k)).unwrap();
            (id.to_string(), kind)
        })
        .collect();
    ttrace::io::write_trace_dir(
        dir,
        &Mesh::single(),
        None,
        &entries,
        &modules,
        &Default::default(),
    )
    .unwrap();
}

/// Thresholds never become infinite from what a trace claims, and an input never silences its
/// module's verdict unless it failed itself: an id of layer 30,000 (Megatron's 1.03^L
/// overflows) with a difference fails with a reason, never passes on an infinite threshold; an
/// all-zero reference input that the candidate changes leaves its module judged, and fails
/// itself.
#[test]
fn fallback_thresholds_and_zero_inputs_never_pass_vacuously() {
    let b = base("fallback");
    let (r, c) = (b.join("deep/reference"), b.join("deep/candidate"));
    write_f32_trace(&r, &[("layers.30000.w", vec![1.0, 2.0])], &[]);
    write_f32_trace(&c, &[("layers.30000.w", vec![1.0, 2.5])], &[]);
    let (code, out, err) = check(&r, &c);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains("layers.30000.w") && out.contains("threshold"),
        "{out}"
    );
    // The same ids, identical (a copy: the directory itself is refused): pass.
    let same = b.join("deep/same");
    write_f32_trace(&same, &[("layers.30000.w", vec![1.0, 2.0])], &[]);
    let (code, out, err) = check(&r, &same);
    assert_eq!(code, Some(0), "{out}{err}");

    let (r, c) = (b.join("zero/reference"), b.join("zero/candidate"));
    let ids = [
        "embedding|fwd.output.0",
        "act|fwd.input.0",
        "act|fwd.output.0",
    ];
    let kinds = [
        ("embedding|fwd.output.0", "embedding"),
        ("act|fwd.output.0", "activation"),
    ];
    let (x, y) = (vec![1.0, -1.0, 0.5, 2.0], vec![0.0; 4]);
    write_f32_trace(
        &r,
        &[
            (ids[0], x.clone()),
            (ids[1], y.clone()),
            (ids[2], y.clone()),
        ],
        &kinds,
    );
    write_f32_trace(
        &c,
        &[
            (ids[0], x),
            (ids[1], vec![0.0, 0.0, 0.0, 0.5f64.powi(10)]),
            (ids[2], y),
        ],
        &kinds,
    );
    let json = b.join("zero/report.json");
    let (code, out, err) = ttrace(&[
        "check",
        "--pricing",
        "local",
        "--json",
        json.to_str().unwrap(),
        r.to_str().unwrap(),
        c.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(1), "{out}{err}");
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(j["report"]["first_failure"], ids[1], "{out}");
    let pricing: Vec<&str> = j["pricing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(!pricing.contains(&"input_failed"), "{pricing:?}");
    std::fs::remove_dir_all(&b).unwrap();
}

/// Sizes from files use checked arithmetic: shards whose merged element count overflows are an
/// error (they used to wrap to an empty shape that "matched" an empty reference); a manifest
/// of 5,000 ids on an incomplete 2^20-rank mesh is refused at once, without an allocation per
/// rank and id.
#[test]
fn overflowing_shapes_and_huge_meshes_are_refused() {
    use ttrace::trace::{merge, Layout, Mesh, Placement};
    let mesh = Mesh::new(4, 1, 1, false).unwrap();
    let t = ttrace::Tensor::zeros(&[1 << 62, 0], ttrace::Format::F32);
    let layout = Layout {
        tp: Placement::split(0),
        ..Layout::replicated()
    };
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
fn a_trace_compared_with_itself_is_refused() {
    // The same directory under two names, or a link to it, would pass whatever it holds.
    let b = base("itself");
    let (r, c) = dump(&b.join("run"), &[]);
    let link = b.join("link");
    std::os::unix::fs::symlink(&c, &link).unwrap();
    for (x, y) in [(&c, &c), (&c, &link), (&r, &r)] {
        let (code, out, err) = check(x, y);
        assert_eq!(code, Some(2), "{out}{err}");
        assert!(err.contains("compared with itself"), "{err}");
        assert!(!out.contains("PASS"), "{out}");
    }
    // Two different directories still check (the clean pair passes).
    assert_eq!(check(&r, &c).0, Some(0));
    let _ = std::fs::remove_dir_all(&b);
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
