//! Accumulation below FP32: one-way rounding, and no systematic test where a trace declares it.

use super::*;

/// A [256, 256] × [256, 64] matmul of positive operands rounded to BF16, accumulated in `acc`
/// with output in `out`: sequentially (the reference) and pairwise (the candidate). Both are
/// correct arithmetic.
fn positive_matmul(acc: Format, out: Format) -> (Tensor, Tensor) {
    let (rows, k, cols) = (256, 256, 64);
    let mut g = ttrace::engine::SplitMix64::for_name("positive", 7);
    let mut draw = |n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| Format::BF16.round(g.uniform(), Overflow::Saturating))
            .collect()
    };
    let a = Tensor::from_vec(&[rows, k], draw(rows * k), Format::BF16).unwrap();
    let b = Tensor::from_vec(&[k, cols], draw(k * cols), Format::BF16).unwrap();
    let p = Policy::new(Format::BF16, acc, out);
    let r = matmul(&a, &b, &p).unwrap();
    let c = matmul(&a, &b, &p.with_order(ttrace::Order::Pairwise { base: 8 })).unwrap();
    (r, c)
}

fn systematic(v: &ttrace::check::TensorVerdict) -> Vec<Detector> {
    v.findings
        .iter()
        .map(|f| f.detector)
        .filter(|d| matches!(d, Detector::Scale | Detector::Bias))
        .collect()
}

#[test]
fn accumulation_below_fp32_rounds_one_way_and_has_no_systematic_test() {
    let id = "layers.0.fc1|fwd.output.0";
    // In BF16 the long positive sums stagnate (terms below half an ulp of the running sum are
    // lost): the two orders differ in one direction, and the symmetric model of the scale and
    // bias tests does not hold — they fire on correct arithmetic.
    let (r, c) = positive_matmul(Format::BF16, Format::BF16);
    let eps = Format::BF16.machine_epsilon();
    // A norm threshold far above the difference (2.8%) but below the reference's own norm
    // (at which any scale would be allowed).
    let norm = |t: &Tensor| t.values().iter().map(|x| x * x).sum::<f64>().sqrt();
    let th = 0.5 * norm(&r);
    let v = compare_tensor_with(id, &r, &c, th, eps, Detection::default());
    assert_eq!(v.fired(), vec![Detector::Scale, Detector::Bias], "{v:?}");
    let d = v
        .findings
        .iter()
        .find(|f| f.detector == Detector::Bias)
        .unwrap();
    assert!(d.estimate > 0.0 && d.ratio > 1.0, "{d:?}");
    // Told the accumulation, the check keeps the norm and the sparse test only.
    let off = Detection::default().accumulated_in(Format::BF16);
    let v = compare_tensor_with(id, &r, &c, th, eps, off);
    assert!(v.passed && systematic(&v).is_empty(), "{v:?}");
    assert!(v.findings.iter().any(|f| f.detector == Detector::Sparse));
    // Accumulated in FP32, the same operands round symmetrically: both tests apply and hold.
    let (r, c) = positive_matmul(Format::F32, Format::F32);
    let on = Detection::default().accumulated_in(Format::F32);
    let th = 0.5 * norm(&r);
    let v = compare_tensor_with(id, &r, &c, th, Format::F32.machine_epsilon(), on);
    assert_ne!(r.values(), c.values());
    assert!(v.passed, "{v:?}");
    assert_eq!(systematic(&v), vec![Detector::Scale, Detector::Bias]);
}

#[test]
fn a_trace_that_declares_an_accumulation_below_fp32_is_checked_without_systematic_tests() {
    let id = "layers.0.fc1|fwd.output.0".to_string();
    let (r, c) = positive_matmul(Format::BF16, Format::BF16);
    let kinds: HashMap<String, ttrace::trace::ModuleKind> =
        [(id.clone(), ttrace::trace::ModuleKind::Linear)].into();
    // A producer threshold far above the difference (2.8%) but below the reference's norm:
    // only the tests beyond the norm can fire.
    let rn = r.values().iter().map(|x| x * x).sum::<f64>().sqrt();
    let threshold: HashMap<String, f64> = [(id.clone(), 0.5 * rn)].into();
    let write = |dir: &std::path::Path, t: &Tensor, recipe: Option<&str>| {
        let entries = [(id.clone(), Layout::replicated(), vec![t.clone()])];
        write_trace_dir(dir, &Mesh::single(), recipe, &entries, &kinds, &threshold).unwrap();
    };
    let verdict = |d: &std::path::Path| {
        let out = check_dir_paths(&d.join("r"), &d.join("c"), PricingMode::Auto, &|| {}).unwrap();
        out.report.verdicts[0].clone()
    };
    // Nothing declared: FP32 accumulation is assumed, and the stagnation reads as a bias.
    let d = tmp("acc-undeclared");
    write(&d.join("r"), &r, None);
    write(&d.join("c"), &c, None);
    let v = verdict(&d);
    assert!(!v.passed && v.fired().contains(&Detector::Bias), "{v:?}");
    // The candidate's module declares BF16 accumulation: no scale or bias test.
    let path = d.join("c").join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for e in m["tensors"].as_array_mut().unwrap() {
        e["module"]["accumulate"] = serde_json::json!("bf16");
    }
    std::fs::write(&path, serde_json::to_string(&m).unwrap()).unwrap();
    let v = verdict(&d);
    assert!(v.passed && systematic(&v).is_empty(), "{v:?}");
    // Likewise a recipe that accumulates in BF16.
    let d = tmp("acc-recipe");
    write(&d.join("r"), &r, Some("uniform-bf16"));
    write(&d.join("c"), &c, Some("uniform-bf16"));
    let v = verdict(&d);
    assert!(v.passed && systematic(&v).is_empty(), "{v:?}");
}
