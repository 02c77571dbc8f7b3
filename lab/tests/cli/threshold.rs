//! `ttrace threshold`: plans, every op of the registry, refusals.

use super::*;

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
        ("cross_entropy", "", "order=splitk:4:f32:tree"),
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
