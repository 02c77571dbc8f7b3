//! `ttrace check` on dumped trace directories: findings, refusals, fragments, reports.

use super::*;

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
