//! Values: non-finite, zero and near-zero references, subnormals, FP8 saturation, empty tensors, invalid threshold requests, squares that underflow.

use super::*;

#[test]
fn nan_in_the_candidate_fails_at_its_position_whatever_the_threshold() {
    let r = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], Format::F32);
    let c = t(&[1.0, 2.0, 3.0, 4.0, 5.0, f64::NAN], Format::F32);
    let v = compare_tensor("x", &r, &c, f64::INFINITY, 1.0);
    assert!(!v.passed);
    assert_eq!(v.first_nonfinite, Some(5));
    assert_eq!(v.nonfinite_mismatches, 1);
    // The finite part is still measured (no NaN leaks into the numbers).
    assert_eq!(v.rel_error, 0.0);
}

#[test]
fn nan_or_infinity_in_the_reference_against_finite_values_fails() {
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let r = t(&[bad, 1.0], Format::F32);
        let c = t(&[1.0, 1.0], Format::F32);
        let v = compare_tensor("x", &r, &c, f64::INFINITY, 1.0);
        assert!(!v.passed, "{bad}");
        assert_eq!(v.first_nonfinite, Some(0));
    }
}

/// The documented policy: NaN matches NaN (any payload), an infinity matches the same
/// infinity; −∞ vs +∞ and ∞ vs NaN are mismatches.
#[test]
fn matching_non_finite_values_follow_the_policy() {
    let quiet = f64::NAN;
    let other_payload = f64::from_bits(f64::NAN.to_bits() | 0x1234);
    let r = t(&[quiet, f64::INFINITY, f64::NEG_INFINITY, 2.0], Format::F64);
    let c = t(
        &[other_payload, f64::INFINITY, f64::NEG_INFINITY, 2.0],
        Format::F64,
    );
    assert!(compare_tensor("x", &r, &c, 0.0, 1.0).passed);
    for (a, b) in [
        (f64::INFINITY, f64::NEG_INFINITY),
        (f64::INFINITY, f64::NAN),
        (f64::NAN, f64::NEG_INFINITY),
    ] {
        let v = compare_tensor(
            "x",
            &t(&[a], Format::F64),
            &t(&[b], Format::F64),
            1e300,
            1.0,
        );
        assert!(!v.passed && v.nonfinite_mismatches == 1, "{a} vs {b}");
    }
}

#[test]
fn all_zero_references_never_divide_by_zero() {
    let zero = t(&[0.0, -0.0, 0.0], Format::BF16);
    let v = compare_tensor("x", &zero, &zero, 0.0, 1.0);
    assert!(v.passed && v.rel_error == 0.0 && v.ratio == 0.0);
    // A non-zero candidate: infinite relative error (not NaN), fails any finite threshold …
    let c = t(&[0.0, 2f64.powi(-20), 0.0], Format::BF16);
    let v = compare_tensor("x", &zero, &c, 1e-9, 1.0);
    assert!(!v.passed && v.rel_error == f64::INFINITY && !v.ratio.is_nan());
    assert_eq!(v.max_abs, 2f64.powi(-20));
    // … and passes an absolute threshold that covers it.
    let v = compare_tensor("x", &zero, &c, 1e-6, 1.0);
    assert!(v.passed && !v.ratio.is_nan());
}

#[test]
fn near_zero_references_keep_finite_relative_errors() {
    // Subnormal F32 values (the smallest is 2^-149).
    let tiny = 2f64.powi(-149);
    let r = t(&[tiny, 3.0 * tiny], Format::F32);
    let c = t(&[2.0 * tiny, 3.0 * tiny], Format::F32);
    let v = compare_tensor("x", &r, &c, 2.0 * tiny, 1.0);
    assert!(v.rel_error.is_finite() && v.rel_error > 0.0 && v.passed);
    assert_eq!(v.max_ulp, 1);
}

fn stat(ref_norm: f64, diff_norm: f64, kind: Option<ttrace::trace::ModuleKind>) -> TensorStat {
    TensorStat {
        ref_norm,
        ref_max_abs: ref_norm,
        diff_norm,
        elements: 16,
        last_dim: 4,
        ndim: 2,
        format: Format::BF16,
        layout: Layout::replicated(),
        ref_layout: Layout::replicated(),
        norm_gain: 1.0,
        chain_error: 0.0,
        op: None,
        module: kind.map(ModuleInfo::of),
        cand_module: None,
    }
}

/// A residual whose reference output is exactly zero (x + (−x)) is priced by an absolute
/// bound from its inputs' differences: ‖Δout‖ ≤ (1 + u)(‖Δx‖ + ‖Δy‖) — never 0 (a false
/// alarm) and never ∞ (a blind spot).
#[test]
fn a_zero_residual_output_gets_an_absolute_floor() {
    use ttrace::trace::ModuleKind;
    let ids: Vec<String> = ["r|fwd.input.0", "r|fwd.input.1", "r|fwd.output.0"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut stats = HashMap::new();
    stats.insert(ids[0].clone(), stat(4.0, 1e-3, None));
    stats.insert(ids[1].clone(), stat(4.0, 2e-3, None));
    stats.insert(ids[2].clone(), stat(0.0, 0.0, Some(ModuleKind::Residual)));
    let index = InputIndex::new(&ids);
    let ctx = PriceContext {
        mesh: Mesh::single(),
        ref_mesh: Mesh::single(),
        microbatches: 1,
        ref_microbatches: 1,
        recipe: None,
        log_inv_delta: (1e6f64).ln(),
    };
    let get = |id: &str| stats.get(id);
    let p = price_local(&ids[2], &index, &get, &ctx).unwrap();
    let u = Format::BF16.unit_roundoff();
    assert_eq!(p.threshold, 3e-3 * (1.0 + u));
}

#[test]
fn subnormals_round_and_compare_across_zero() {
    let s = 2f64.powi(-133); // BF16's smallest subnormal
    assert_eq!(Format::BF16.round(0.75 * s, Overflow::NonSaturating), s);
    assert_eq!(Format::BF16.round(0.5 * s, Overflow::NonSaturating), 0.0); // tie to even (0)
    let v = compare_tensor(
        "x",
        &t(&[s], Format::BF16),
        &t(&[-s], Format::BF16),
        1.0,
        1.0,
    );
    assert_eq!(v.max_ulp, 2, "−s, 0, s: two steps");
}

#[test]
fn fp8_overflow_follows_the_overflow_policy() {
    assert_eq!(Format::E4M3.round(1000.0, Overflow::Saturating), 448.0);
    assert_eq!(Format::E4M3.round(-1e30, Overflow::Saturating), -448.0);
    // E4M3 has no infinity: a non-saturating overflow is NaN.
    assert!(Format::E4M3.round(1000.0, Overflow::NonSaturating).is_nan());
    assert_eq!(
        Format::E5M2.round(1e6, Overflow::NonSaturating),
        f64::INFINITY
    );
    assert_eq!(Format::E5M2.round(1e6, Overflow::Saturating), 57344.0);
    // Values past FP8's range, not quantizable as FP8: a typed error, not a silent clamp.
    let e = Tensor::from_vec(&[1], vec![1000.0], Format::E4M3).unwrap_err();
    assert!(matches!(e, Error::NotRepresentable { .. }), "{e}");
}

#[test]
fn empty_tensors_compare_store_and_multiply() {
    let e = Tensor::from_vec(&[0, 3], vec![], Format::BF16).unwrap();
    let v = compare_tensor("x", &e, &e, 0.0, 1.0);
    assert!(v.passed && v.rel_error == 0.0 && v.elements == 0);
    let d = tmp("empty");
    let p = d.join("e.safetensors");
    safetensors::write(&p, &[("e", &e)], &Default::default()).unwrap();
    let back = safetensors::SafetensorsFile::open(&p)
        .unwrap()
        .read("e")
        .unwrap();
    assert_eq!(back.shape(), &[0, 3]);
    // An empty reduction is exactly zero in any order.
    let a = Tensor::zeros(&[2, 0], Format::BF16);
    let b = Tensor::zeros(&[0, 3], Format::BF16);
    let c = matmul(
        &a,
        &b,
        &Policy::new(Format::BF16, Format::F32, Format::BF16),
    )
    .unwrap();
    assert_eq!(c.values(), &[0.0; 6]);
    assert_eq!(
        sum(
            &[],
            &Accumulation::new(Format::BF16, Format::BF16, ttrace::Order::Sequential)
        )
        .unwrap(),
        0.0
    );
}

#[test]
fn invalid_threshold_requests_are_typed_errors() {
    let p = Policy::new(Format::BF16, Format::F32, Format::BF16);
    let q = Policy::new(Format::BF16, Format::BF16, Format::BF16);
    let x = TermStats::normal(0.0, 1.0);
    let conf = Confidence::default_probabilistic();
    // Zero length (nothing to price), and a huge one: refused up front, not an hour of work
    // or an allocation failure. The plan's fields are public, so plan_matmul checks too.
    let plan = |k| MatmulPlan {
        m: 4,
        k,
        n: 4,
        a: x,
        b: x,
    };
    for k in [0, MAX_PLANNED_TERMS + 1] {
        let e = plan_matmul(&plan(k), &p, &q, conf).unwrap_err();
        assert!(
            matches!(e, Error::InvalidParameter { name: "k", .. }),
            "{e}"
        );
    }
    assert!(plan_matmul(&plan(MAX_PLANNED_TERMS.min(1 << 16)), &p, &q, conf).is_ok());
    // A plan is checked where it is built, too: zero rows, an output that overflows.
    for (m, n, name) in [(0, 4, "m"), (usize::MAX, 2, "n")] {
        let e = MatmulPlan::new(m, 16, n, x, x).unwrap_err();
        assert!(
            matches!(e, Error::InvalidParameter { name: got, .. } if got == name),
            "{e}"
        );
    }
    // δ outside (0, 1).
    for d in [0.0, 1.0, -0.5, 2.0, f64::NAN] {
        assert!(
            Confidence::probabilistic(d)
                .err()
                .is_some_and(|e| matches!(e, ttrace::Error::InvalidParameter { .. })),
            "{d}"
        );
    }
    // Unknown formats.
    assert!(matches!(
        "bf17".parse::<Format>(),
        Err(ttrace::Error::UnknownFormat(..))
    ));
    assert!(matches!(
        "".parse::<Format>(),
        Err(ttrace::Error::UnknownFormat(..))
    ));
}

/// Differences whose squares underflow are not lost: a candidate differing from the reference
/// only by subnormal amounts, or in a tensor of magnitude 1e-170 (every square below the
/// smallest `f64`), fails a zero threshold and reports its relative error — checked against
/// the same norms computed on the values scaled by 2^600 (exact for these magnitudes).
#[test]
fn differences_whose_squares_underflow_are_measured() {
    let exact = |r: &[f64], c: &[f64]| {
        let k = 2f64.powi(600);
        let dn = r
            .iter()
            .zip(c)
            .map(|(a, b)| ((b - a) * k).powi(2))
            .sum::<f64>()
            .sqrt();
        let rn = r.iter().map(|a| (a * k).powi(2)).sum::<f64>().sqrt();
        dn / rn
    };
    let sub: Vec<f64> = (0..512).map(|i| i as f64 * 1e-310).collect();
    let mut sub_c = sub.clone();
    sub_c[7] = 3e-310;
    sub_c[300] = sub[300] + 5e-324;
    let tiny: Vec<f64> = (0..512).map(|i| (1.0 + i as f64) * 1e-170).collect();
    let tiny_c: Vec<f64> = tiny.iter().map(|x| x * (1.0 + 1e-3)).collect();
    for (r, c) in [(&sub, &sub_c), (&tiny, &tiny_c)] {
        let v = compare_tensor(
            "x",
            &Tensor::from_vec(&[64, 8], r.clone(), Format::F64).unwrap(),
            &Tensor::from_vec(&[64, 8], c.clone(), Format::F64).unwrap(),
            0.0,
            1.0,
        );
        assert!(!v.passed, "{v:?}");
        let want = exact(r, c);
        assert!(
            (v.rel_error - want).abs() <= 1e-12 * want,
            "{} against {want}",
            v.rel_error
        );
    }
    // The overflow side: a difference beyond the largest f64 is an infinite norm, never a pass.
    let (mut r, mut c) = (vec![1.0; 16], vec![1.0; 16]);
    r[3] = 1e308;
    c[3] = -1e308;
    let v = compare_tensor("x", &t(&r, Format::F64), &t(&c, Format::F64), f64::MAX, 1.0);
    assert!(!v.passed && v.rel_error.is_infinite(), "{v:?}");
}
