//! The `ttrace` binary, run as a process: `formats` and `round` here; `threshold`, the lab's
//! subcommands and `check` in their modules.

use std::io::Write;
use std::process::{Command, Output, Stdio};

mod check;
mod lab;
mod threshold;

fn ttrace(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ttrace"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    // The process may exit before reading (e.g. on a bad argument): ignore a broken pipe.
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    child.wait_with_output().unwrap()
}

/// A clean TP 2 dump of the simulator under a fresh temporary directory named after `tag`:
/// (the directory, the dump holding `reference/` and `candidate/`).
fn simulated_tp2_dump(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let base = std::env::temp_dir().join(format!("ttrace-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let d = base.join("dump");
    let o = ttrace(
        &["simulate", "--tp", "2", "--dump", d.to_str().unwrap()],
        "",
    );
    assert_eq!(o.status.code(), Some(0));
    (base, d)
}

fn stdout_lines(o: &Output) -> Vec<String> {
    String::from_utf8(o.stdout.clone())
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn formats_json_has_every_format_with_u_and_eps_apart() {
    let o = ttrace(&["formats", "--json"], "");
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let arr = v.as_array().unwrap();
    let names: Vec<&str> = arr.iter().map(|f| f["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["f64", "f32", "tf32", "f16", "bf16", "e4m3", "e5m2"]);
    for f in arr {
        let p = f["precision"].as_i64().unwrap() as i32;
        assert_eq!(f["unit_roundoff"].as_f64().unwrap(), 2f64.powi(-p));
        assert_eq!(f["machine_epsilon"].as_f64().unwrap(), 2f64.powi(1 - p));
    }
    let e4m3 = &arr[5];
    assert_eq!(e4m3["max_finite"].as_f64().unwrap(), 448.0);
    assert!(!e4m3["has_infinity"].as_bool().unwrap());
    assert_eq!(
        arr[4]["machine_epsilon"].as_f64().unwrap(),
        0.0078125,
        "BF16 eps is 2^-7"
    );
}

#[test]
fn formats_table_prints() {
    let o = ttrace(&["formats"], "");
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    for name in [
        "f64",
        "f32",
        "tf32",
        "f16",
        "bf16",
        "e4m3",
        "e5m2",
        "u=2^-p",
        "eps=2^(1-p)",
    ] {
        assert!(text.contains(name), "table lacks {name}");
    }
}

#[test]
fn round_prints_shortest_round_trip_text() {
    // 1e10 lies in [2^33, 2^34) where BF16's spacing is 2^26; 1e10 / 2^26 = 149.01, so 149·2^26.
    // 3.0e38 / 2^120 = 225.68, so 226·2^120 = 3.00405527047391e38.
    let input = "1\n1.00390625\n1.00390625000000000001\n-0\n-1e-50\n0.1\n1e10\n3.0e38\ninf\n-inf\nnan\n65519\n";
    let o = ttrace(&["round", "--format", "bf16"], input);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines = stdout_lines(&o);
    assert_eq!(
        lines,
        [
            "1",
            "1",
            "1.0078125",
            "-0",
            "-0",
            "0.10009765625",
            "9999220736",
            "3.00405527047391e38",
            "inf",
            "-inf",
            "NaN",
            "65536"
        ]
    );
    // Every printed value reads back as a BF16 value (shortest round trip).
    for l in &lines {
        let v: f64 = l.parse().unwrap();
        assert!(v.is_nan() || half::bf16::from_f64(v).to_f64() == v);
    }
}

#[test]
fn round_fp8_overflow_modes() {
    let input = "448\n464\n465\n1e9\n-1e9\n0.0009765625\n0.00146484375\n";
    let o = ttrace(&["round", "--format", "e4m3"], input);
    assert_eq!(
        stdout_lines(&o),
        ["448", "448", "NaN", "NaN", "NaN", "0", "0.001953125"]
    );
    let o = ttrace(&["round", "--format", "e4m3", "--saturate"], input);
    assert_eq!(
        stdout_lines(&o),
        ["448", "448", "448", "448", "-448", "0", "0.001953125"]
    );
    let o = ttrace(&["round", "--format", "e5m2"], "61439\n61440\n");
    assert_eq!(stdout_lines(&o), ["57344", "inf"]);
}

#[test]
fn round_rejects_a_bad_line_with_its_number() {
    let o = ttrace(&["round", "--format", "f16"], "1.5\n2.5\nseven\n4\n");
    assert!(!o.status.success());
    assert_eq!(stdout_lines(&o), ["1.5", "2.5"]);
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.contains("line 3") && err.contains("seven"), "{err}");
}

#[test]
fn round_rejects_an_unknown_format() {
    let o = ttrace(&["round", "--format", "fp7"], "1\n");
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.contains("fp7") && err.contains("bf16"), "{err}");
}
