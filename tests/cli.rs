//! The `ttrace` binary: `formats` and `round`.

use std::io::Write;
use std::process::{Command, Output, Stdio};

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

#[test]
fn threshold_prices_a_plan_and_reports_baselines() {
    let o = ttrace(
        &[
            "threshold",
            "matmul",
            "--m",
            "64",
            "--k",
            "1024",
            "--n",
            "64",
            "--ref",
            "in=bf16,acc=f32,out=f32,order=sequential",
            "--cand",
            "in=bf16,acc=f32,out=f32,order=splitk:4:f32:tree",
            "--json",
        ],
        "",
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let th = &v["threshold"];
    let rel = th["relative"].as_f64().unwrap();
    let worst = th["guaranteed_relative"].as_f64().unwrap();
    assert!(
        rel > 0.0 && rel < worst,
        "probabilistic {rel} below guaranteed {worst}"
    );
    assert_eq!(th["confidence"]["kind"], "probabilistic");
    assert_eq!(th["confidence"]["delta"].as_f64().unwrap(), 1e-6);
    assert!(th["per_element"].as_f64().unwrap() > 0.0);
    let names: Vec<&str> = v["baselines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["baseline"]["name"].as_str().unwrap())
        .collect();
    assert!(
        names.iter().any(|n| n.contains("assert_close"))
            && names.iter().any(|n| n.contains("Megatron"))
    );
    // Identical policies: zero.
    let o = ttrace(
        &[
            "threshold",
            "sum",
            "--ref",
            "in=f32,acc=f32,out=f32",
            "--cand",
            "in=f32,acc=f32,out=f32",
            "--json",
        ],
        "",
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["threshold"]["identical"], true);
    assert_eq!(v["threshold"]["abs_frobenius"].as_f64().unwrap(), 0.0);
}

#[test]
fn threshold_rejects_bad_specs() {
    for args in [
        vec!["threshold", "matmul", "--cand", "order=zigzag"],
        vec!["threshold", "matmul", "--cand", "in=fp7"],
        vec!["threshold", "matmul", "--delta", "1.5"],
        vec!["threshold", "matmul", "--cand", "order=kahan"],
        vec!["threshold", "matmul", "--cand", "order=pairwise:0"],
    ] {
        let o = ttrace(&args, "");
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(!o.stderr.is_empty());
    }
}

#[test]
fn threshold_prices_every_supported_op() {
    // Policies: the defaults (in=bf16, acc=f32, out=bf16, sequential) with these keys set.
    for (op, r, c) in [
        ("softmax", "", "form=online:64"),
        // A kernel of unknown order: priced by the model (one sequential kernel on this data is
        // determined, and its one-pass output equals the two-pass one: a zero threshold).
        ("layernorm", "", "variance=onepass,order=any"),
        ("rmsnorm", "", "order=pairwise:8,out=f32"),
        ("gelu", "", "out=f32"),
        ("silu", "", "acc=bf16"),
        (
            "matmul",
            "in=e4m3,scaling=current",
            "in=e4m3,scaling=current,order=splitk:4:bf16:tree",
        ),
        // Hopper's FP8 tensor cores, whole against split in two (priced on synthetic data).
        (
            "matmul",
            "in=e4m3,out=f32,order=hopper-fp8-fast",
            "in=e4m3,out=f32,order=splitk:2:f32:seq:inner=hopper-fp8-fast",
        ),
        // A kernel of unknown order on both sides.
        (
            "matmul",
            "in=f32,out=f32,order=any",
            "in=tf32,out=f32,order=any",
        ),
        ("rmsnorm", "", "order=any"),
        // The rest of the op registry, on synthetic operands.
        ("linear", "", "order=pairwise:8"),
        ("mean", "", "order=splitk:4:bf16:tree"),
        (
            "allreduce",
            "in=f32,out=f32",
            "in=f32,out=f32,order=splitk:8:bf16:ring",
        ),
        ("add", "", "out=f32"),
        ("scale:0.3", "", "out=f32"),
        ("exp", "", "out=f32"),
    ] {
        let o = ttrace(
            &[
                "threshold",
                op,
                "--m",
                "8",
                "--k",
                "256",
                "--n",
                "8",
                "--ref",
                r,
                "--cand",
                c,
                "--json",
            ],
            "",
        );
        assert!(
            o.status.success(),
            "{op}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["op"], op);
        let rel = v["threshold"]["relative"].as_f64().unwrap();
        assert!(rel.is_finite() && rel > 0.0, "{op}: {rel}");
        assert!(rel <= v["threshold"]["guaranteed_relative"].as_f64().unwrap());
    }
    // Welford's variance is priced; a one-pass variance of rows 1000 ± 1 by a kernel of unknown
    // order may cancel to zero or below, and the refusal says so with exit code 2.
    let o = ttrace(
        &[
            "threshold",
            "layernorm",
            "--cand",
            "variance=welford",
            "--m",
            "2",
            "--k",
            "16",
            "--json",
        ],
        "",
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["threshold"]["relative"].as_f64().unwrap().is_finite());
    let o = ttrace(
        &[
            "threshold",
            "layernorm",
            "--ref",
            "in=f32,acc=f32,out=f32,variance=twopass",
            "--cand",
            "in=f32,acc=f32,out=f32,variance=onepass,order=any",
            "--m",
            "2",
            "--k",
            "1024",
            "--mean",
            "1000",
            "--std",
            "1",
        ],
        "",
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no finite threshold"));
    // An op the registry does not know, and a scale without a number.
    for (op, says) in [("conv", "unknown op 'conv'"), ("scale:x", "scale:C needs")] {
        let o = ttrace(&["threshold", op], "");
        assert_eq!(o.status.code(), Some(2), "{op}");
        assert!(String::from_utf8_lossy(&o.stderr).contains(says), "{op}");
    }
}

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

#[test]
fn check_finds_dumped_bugs_passes_clean_dumps_and_rejects_broken_ones() {
    let base = std::env::temp_dir().join(format!("ttrace-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let dump = |name: &str, extra: &[&str]| {
        let d = base.join(name);
        let mut args = vec![
            "simulate",
            "--tp",
            "2",
            "--sp",
            "--dp",
            "2",
            "--dump",
            d.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        ttrace(&args, "");
        d
    };
    let clean = dump("clean", &[]);
    let check = |d: &std::path::Path| {
        ttrace(
            &[
                "check",
                d.join("reference").to_str().unwrap(),
                d.join("candidate").to_str().unwrap(),
            ],
            "",
        )
    };
    let o = check(&clean);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    for bug in [
        "sp-norm-grad-not-reduced",
        "row-bias-on-every-rank",
        "dp-grad-summed-not-averaged",
    ] {
        let d = dump(bug, &["--bug", bug, "--recipe", "fp8-delayed"]);
        let o = check(&d);
        let text = String::from_utf8(o.stdout).unwrap();
        assert_eq!(o.status.code(), Some(1), "{bug}: {text}");
        assert!(text.contains("FAIL"), "{bug}: {text}");
    }
    // Unusable input: a truncated shard file, a missing rank, a missing directory.
    let cand = clean.join("candidate");
    let f = cand.join("rank1.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let o = check(&clean);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8(o.stderr)
        .unwrap()
        .contains("rank1.safetensors"));
    std::fs::write(&f, &bytes).unwrap();
    std::fs::remove_file(&f).unwrap();
    let o = check(&clean);
    assert_eq!(o.status.code(), Some(2));
    let o = ttrace(&["check", "/nonexistent/ref", "/nonexistent/cand"], "");
    assert_eq!(o.status.code(), Some(2));
    std::fs::remove_dir_all(&base).unwrap();
}

/// Exit code 2 and a message naming the problem for each kind of unusable trace: a wrong
/// dtype, a rank without entries, a manifest naming an absent tensor, shards whose shapes
/// differ between ranks, a tensor the candidate lacks.
#[test]
fn check_rejects_malformed_traces_with_exit_code_2() {
    use serde_json::Value;
    let (base, d) = simulated_tp2_dump("malformed");
    let (rdir, cdir) = (d.join("reference"), d.join("candidate"));
    let mpath = cdir.join("manifest.json");
    let original = std::fs::read_to_string(&mpath).unwrap();
    let check = || {
        let o = ttrace(
            &["check", rdir.to_str().unwrap(), cdir.to_str().unwrap()],
            "",
        );
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let edit = |f: &dyn Fn(&mut Vec<Value>)| {
        let mut m: Value = serde_json::from_str(&original).unwrap();
        f(m["tensors"].as_array_mut().unwrap());
        std::fs::write(&mpath, serde_json::to_string(&m).unwrap()).unwrap();
    };
    // Wrong dtype.
    edit(&|t| t[3]["dtype"] = Value::from("f16"));
    let (code, err) = check();
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("stored as") && err.contains("f16"), "{err}");
    // A rank with no entries.
    edit(&|t| t.retain(|e| e["rank"] != 1));
    let (code, err) = check();
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("no shard for rank 1"), "{err}");
    // A tensor the file does not hold.
    edit(&|t| t[0]["key"] = Value::from("not-there"));
    let (code, err) = check();
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not-there") && err.contains("absent"), "{err}");
    // A tensor the candidate lacks.
    let first = serde_json::from_str::<Value>(&original).unwrap()["tensors"][0]["id"].clone();
    edit(&|t| t.retain(|e| e["id"] != first));
    let (code, err) = check();
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains(first.as_str().unwrap()), "{err}");
    // Shards whose shapes do not fit their layout: declare a tp-replicated tensor split.
    edit(&|t| {
        for e in t.iter_mut() {
            if e["id"] == "loss|fwd.output.0" {
                e["layout"]["tp"] = serde_json::json!({"kind": "split", "dim": 0, "groups": 1});
            }
        }
    });
    let (code, err) = check();
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("loss|fwd.output.0"), "{err}");
    std::fs::write(&mpath, &original).unwrap();
    assert_eq!(check().0, Some(0));
    std::fs::remove_dir_all(&base).unwrap();
}

/// Per-rank manifest fragments (`manifest.rank{r}.json`, as separate processes write them)
/// are merged when `manifest.json` is absent; fragments that disagree are rejected.
#[test]
fn check_merges_per_rank_manifest_fragments() {
    use serde_json::Value;
    let base = std::env::temp_dir().join(format!("ttrace-fragments-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let d = base.join("run");
    let o = ttrace(
        &["simulate", "--tp", "2", "--dump", d.to_str().unwrap()],
        "",
    );
    assert_eq!(o.status.code(), Some(0));
    let cdir = d.join("candidate");
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(cdir.join("manifest.json")).unwrap())
            .unwrap();
    for r in 0..2 {
        let mut part = m.clone();
        part["tensors"]
            .as_array_mut()
            .unwrap()
            .retain(|e| e["rank"] == r);
        std::fs::write(
            cdir.join(format!("manifest.rank{r}.json")),
            serde_json::to_string(&part).unwrap(),
        )
        .unwrap();
    }
    std::fs::remove_file(cdir.join("manifest.json")).unwrap();
    let args = [
        "check".to_string(),
        d.join("reference").to_str().unwrap().to_string(),
        cdir.to_str().unwrap().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = ttrace(&args, "");
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut part: Value =
        serde_json::from_str(&std::fs::read_to_string(cdir.join("manifest.rank1.json")).unwrap())
            .unwrap();
    part["recipe"] = Value::from("fp32");
    std::fs::write(
        cdir.join("manifest.rank1.json"),
        serde_json::to_string(&part).unwrap(),
    )
    .unwrap();
    let o = ttrace(&args, "");
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("disagrees"));
    std::fs::remove_dir_all(&base).unwrap();
}

/// An interrupted `ttrace check --json` leaves no report, or a complete one — never a
/// half-written file or a stray temporary; re-running gives byte-identical reports.
#[test]
fn check_reports_are_atomic_and_reproducible() {
    let base = std::env::temp_dir().join(format!("ttrace-atomic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let d = base.join("dump");
    let o = ttrace(
        &["simulate", "--tp", "2", "--dump", d.to_str().unwrap()],
        "",
    );
    assert!(o.status.code().is_some(), "{o:?}");
    let (r, c) = (d.join("reference"), d.join("candidate"));
    let report = base.join("report.json");
    let args = |out: &std::path::Path| {
        vec![
            "check".to_string(),
            r.to_str().unwrap().to_string(),
            c.to_str().unwrap().to_string(),
            "--json".to_string(),
            out.to_str().unwrap().to_string(),
        ]
    };
    // Interrupt runs at several moments.
    for delay_ms in [0u64, 5, 20, 80] {
        let _ = std::fs::remove_file(&report);
        let mut child = Command::new(env!("CARGO_BIN_EXE_ttrace"))
            .args(args(&report))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill();
        let _ = child.wait();
        if report.exists() {
            let text = std::fs::read_to_string(&report).unwrap();
            serde_json::from_str::<serde_json::Value>(&text)
                .unwrap_or_else(|e| panic!("half-written report after {delay_ms} ms: {e}"));
        }
        let stray: Vec<_> = std::fs::read_dir(&base)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.contains(".tmp"))
            .collect();
        // A kill between the temporary's creation and its rename may leave it (never the
        // report itself half-written); it must not be mistaken for a report.
        assert!(stray.iter().all(|n| n.starts_with('.')), "{stray:?}");
    }
    let a = base.join("a.json");
    let b = base.join("b.json");
    let ra: Vec<String> = args(&a);
    let rb: Vec<String> = args(&b);
    let oa = ttrace(&ra.iter().map(String::as_str).collect::<Vec<_>>(), "");
    let ob = ttrace(&rb.iter().map(String::as_str).collect::<Vec<_>>(), "");
    assert_eq!(oa.status.code(), ob.status.code());
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let _ = std::fs::remove_dir_all(&base);
}

/// The README's `ttrace check traces/reference traces/candidate` on directories of traced
/// steps (`step0/`, as the tracer writes them): the one common step is checked; several are
/// refused with the list and the command to pick one. Reference and candidate swapped (the
/// sharded run given as the reference) is refused, saying so.
#[test]
fn check_finds_the_traced_step_and_refuses_a_swap() {
    let (base, d) = simulated_tp2_dump("steps");
    let (r, c) = (base.join("traces/reference"), base.join("traces/candidate"));
    std::fs::create_dir_all(&r).unwrap();
    std::fs::create_dir_all(&c).unwrap();
    std::fs::rename(d.join("reference"), r.join("step0")).unwrap();
    std::fs::rename(d.join("candidate"), c.join("step0")).unwrap();
    let o = ttrace(&["check", r.to_str().unwrap(), c.to_str().unwrap()], "");
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("step0"));
    // A second step on both sides: say which.
    for side in [&r, &c] {
        let from = side.join("step0");
        let to = side.join("step1");
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&from).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    let o = ttrace(&["check", r.to_str().unwrap(), c.to_str().unwrap()], "");
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("step0, step1") && err.contains("name one"),
        "{err}"
    );
    // Swapped.
    let o = ttrace(
        &[
            "check",
            c.join("step0").to_str().unwrap(),
            r.join("step0").to_str().unwrap(),
        ],
        "",
    );
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("swapped"), "{err}");
    let _ = std::fs::remove_dir_all(&base);
}

/// A parameter gradient one rank lacks (the parameter got no gradient there) is a finding
/// naming the parameter and the rank, not unusable input.
#[test]
fn a_parameter_gradient_missing_on_one_rank_is_a_finding() {
    use serde_json::Value;
    let (base, d) = simulated_tp2_dump("missing-grad");
    let (rdir, cdir) = (d.join("reference"), d.join("candidate"));
    let mpath = cdir.join("manifest.json");
    let mut m: Value = serde_json::from_str(&std::fs::read_to_string(&mpath).unwrap()).unwrap();
    let t = m["tensors"].as_array_mut().unwrap();
    let victim = t
        .iter()
        .find(|e| e["id"].as_str().unwrap().ends_with("|param_grad") && e["rank"] == 1)
        .unwrap()["id"]
        .clone();
    t.retain(|e| !(e["id"] == victim && e["rank"] == 1));
    std::fs::write(&mpath, serde_json::to_string(&m).unwrap()).unwrap();
    let o = ttrace(
        &["check", rdir.to_str().unwrap(), cdir.to_str().unwrap()],
        "",
    );
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(
        o.status.code(),
        Some(1),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains(victim.as_str().unwrap()) && out.contains("rank 1 holds no gradient"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&base);
}
