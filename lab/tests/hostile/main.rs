//! Hostile input (issue 17): trace directories and arguments that try to escape the directory,
//! clobber files, hang, exhaust memory or pass when they must fail. Every case runs the real
//! binary (or the library) and asserts the documented behaviour: exit code 2 naming the file
//! and the problem, or a failing verdict with a reason — never a panic, a hang, an escape, a
//! clobbered file or a vacuous PASS.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod filesystem;
mod input;
mod verdicts;

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
