//! Comparisons that must not pass vacuously: overflow, consumed tensors, fallback thresholds, zero inputs, a trace against itself.

use super::*;

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
