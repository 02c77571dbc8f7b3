//! The file system: links that leave the directory, FIFOs and devices, reports that would clobber inputs, write errors, open-file limits.

use super::*;

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
