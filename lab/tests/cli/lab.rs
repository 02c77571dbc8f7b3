//! `ttrace validate`, `ttrace simulate` and `ttrace bugs`: the lab subcommands.

use super::*;

#[test]
fn validate_runs_a_small_sweep_and_writes_json_and_svg() {
    let dir = std::env::temp_dir().join(format!("ttrace-validate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("report.json");
    let o = ttrace(
        &[
            "validate",
            "--recipe",
            "bf16",
            "--seeds",
            "1",
            "--samples",
            "8",
            "--json",
            json.to_str().unwrap(),
        ],
        "",
    );
    let text = String::from_utf8(o.stdout.clone()).unwrap();
    assert!(
        o.status.success(),
        "exit {:?}: {text}{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        text.contains("false alarms") && text.contains("all"),
        "{text}"
    );
    // It ends with a one-line verdict.
    let last = text
        .lines()
        .rev()
        .find(|l| !l.is_empty() && !l.starts_with("report:"));
    assert!(
        last.is_some_and(|l| l.starts_with("verdict: PASS — 0 false alarms in ")),
        "{last:?}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 20, "one run per mesh");
    assert_eq!(v["total"]["false_alarms"].as_u64(), Some(0));
    // Every run compares the same produced tensors.
    let n = runs[0]["tensors"].as_array().unwrap().len();
    assert!(runs
        .iter()
        .all(|r| r["tensors"].as_array().unwrap().len() == n));
    let svg = std::fs::read_to_string(json.with_extension("svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<circle"));
    // No temporary file left behind.
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn validate_rejects_bad_arguments_with_exit_code_2() {
    for args in [
        &["validate", "--seeds", "0"][..],
        &["validate", "--recipe", "fp7"][..],
        &[
            "validate",
            "--samples",
            "1",
            "--recipe",
            "fp32",
            "--seeds",
            "1",
        ][..],
        &[
            "validate", "--delta", "2", "--recipe", "fp32", "--seeds", "1",
        ][..],
        &["validate", "--threads", "0"][..],
        // The size study is one run per recipe: no seeds, no full sweep, no bug runs.
        &["validate", "--large", "--full"][..],
        &["validate", "--large", "--seeds", "2"][..],
        &["validate", "--large", "--no-bugs"][..],
        &["validate", "--large", "--recipe", "fp7"][..],
    ] {
        let o = ttrace(args, "");
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(o.stderr).unwrap();
        // Our errors, or clap's for a value or a combination it refuses (an unknown recipe,
        // bug or algorithm; --large with --full).
        assert!(
            err.starts_with("ttrace: error:")
                || err.starts_with("error: invalid value")
                || err.starts_with("error: the argument '--large' cannot be used with"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn bugs_lists_the_catalog() {
    let o = ttrace(&["bugs", "--json"], "");
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let arr = v.as_array().unwrap();
    assert!(arr.len() >= 14);
    for b in arr {
        assert!(!b["models"].as_str().unwrap().is_empty());
        assert!(!b["needs"].as_str().unwrap().is_empty());
    }
    let text = String::from_utf8(ttrace(&["bugs"], "").stdout).unwrap();
    assert!(text.contains("sp-norm-grad-not-reduced") && text.contains("Megatron-LM #1446"));
}

#[test]
fn simulate_reports_a_bug_and_its_module_with_exit_code_1() {
    let o = ttrace(
        &[
            "simulate",
            "--tp",
            "2",
            "--sp",
            "--recipe",
            "bf16",
            "--bug",
            "sp-norm-grad-not-reduced",
        ],
        "",
    );
    let text = String::from_utf8(o.stdout).unwrap();
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(
        text.contains("FAIL") && text.contains("replicas disagree"),
        "{text}"
    );
    assert!(
        text.contains("localized: module final_ln (Norm) backward"),
        "{text}"
    );
    // The same configuration without the bug passes.
    let o = ttrace(&["simulate", "--tp", "2", "--sp", "--recipe", "bf16"], "");
    let text = String::from_utf8(o.stdout).unwrap();
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert!(text.contains("PASS"), "{text}");
    // JSON carries the verdicts.
    let o = ttrace(
        &[
            "simulate",
            "--cp",
            "2",
            "--tp",
            "1",
            "--bug",
            "cp-chunk-order-not-inverted",
            "--json",
        ],
        "",
    );
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["localization"]["module"], "layers.0.attn.core");
    assert!(v["check"]["failures"].as_u64().unwrap() > 0);
}

#[test]
fn simulate_rejects_bad_arguments_with_exit_code_2() {
    for args in [
        &["simulate", "--bug", "no-such-bug"][..],
        &["simulate", "--recipe", "fp7"][..],
        &["simulate", "--tp", "0"][..],
        &["simulate", "--tp", "3"][..],
        &["simulate", "--algorithm", "star"][..],
    ] {
        let o = ttrace(args, "");
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(o.stderr).unwrap();
        assert!(
            err.starts_with("ttrace: error:") || err.starts_with("error: invalid value"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn simulate_dumps_traces_that_read_back() {
    let dir = std::env::temp_dir().join(format!("ttrace-dump-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let o = ttrace(
        &[
            "simulate",
            "--tp",
            "2",
            "--cp",
            "2",
            "--bug",
            "qkv-wrong-interleave",
            "--dump",
            dir.to_str().unwrap(),
        ],
        "",
    );
    assert_eq!(o.status.code(), Some(1));
    let mut reference = ttrace::io::TraceDir::open(&dir.join("reference")).unwrap();
    let mut candidate = ttrace::io::TraceDir::open(&dir.join("candidate")).unwrap();
    assert_eq!(candidate.manifest().mesh.world(), 4);
    let id = "layers.0.attn.qkv|fwd.output.0";
    let (r, c) = (
        reference.logical(id).unwrap(),
        candidate.logical(id).unwrap(),
    );
    assert_eq!(r.shape(), c.shape());
    assert_ne!(r, c, "the injected bug is in the dumped candidate");
    assert_eq!(
        reference.logical("embedding|fwd.output.0").unwrap(),
        candidate.logical("embedding|fwd.output.0").unwrap()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
