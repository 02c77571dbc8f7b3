//! Thresholds on structured data (issue 16): the reproducers of the adversarial test as unit
//! tests with their explicit inputs, and a quick slice of the data zoo (`tests/zoo/mod.rs`;
//! the full sweep is `cargo run --release --example zoo`).

#[path = "zoo/mod.rs"]
mod zoo;

use zoo::common;

use ttrace::bounds::{
    matmul_threshold, reduction_error, sum_threshold, Confidence, NormData, NormSide, Threshold,
};
use ttrace::{
    dot, exact_dot, exact_sum, sum, Accumulation, Combine, Error, Format, Order, Products,
};
use ttrace::{Policy, Tensor};

const DELTA: Confidence = Confidence::Probabilistic { delta: 1e-6 };

fn split(parts: usize, partial: Format, combine: Combine) -> Order {
    Order::SplitK {
        parts,
        inner: Box::new(Order::Sequential),
        partial,
        combine,
    }
}

/// |cand − ref| of a one-row sum against the guaranteed and probabilistic thresholds.
fn sum_case(xs: Vec<f64>, input: Format, candidate: Order) {
    let r = Policy::new(input, Format::F32, Format::F32);
    let c = r.clone().with_order(candidate);
    let t = Tensor::from_vec(&[1, xs.len()], xs.clone(), input).unwrap();
    let d = (sum(&xs, &r.accumulation).unwrap() - sum(&xs, &c.accumulation).unwrap()).abs();
    for conf in [Confidence::Guaranteed, DELTA] {
        let th = sum_threshold(&t, &r, &c, false, conf).unwrap();
        assert!(
            d <= th.abs_frobenius,
            "{conf:?}: |D| = {d:e} > {:e}",
            th.abs_frobenius
        );
    }
}

/// Sums whose deterministic parts (ties, absorption) the thresholds used to drop.
#[test]
fn deterministic_parts_are_carried() {
    // 64 copies of an FP32 constant: every addition in the top binade is a tie.
    sum_case(
        vec![1.8622474670410156; 64],
        Format::F32,
        split(8, Format::F32, Combine::Tree),
    );
    // 2^24 then 15 × 0.75: each 0.75 rounds the same way.
    let mut xs = vec![2f64.powi(24)];
    xs.extend([0.75; 15]);
    sum_case(xs, Format::F32, Order::Pairwise { base: 8 });
    // BF16 dot [4096, 0.5 × 63]·[4096, 0.5 × 63], FP32 accumulation.
    let mut v = vec![4096.0];
    v.extend([0.5; 63]);
    let r = Policy::new(Format::BF16, Format::F32, Format::F32);
    let c = r.clone().with_order(Order::Pairwise { base: 8 });
    let a = Tensor::from_vec(&[1, 64], v.clone(), Format::BF16).unwrap();
    let b = Tensor::from_vec(&[64, 1], v.clone(), Format::BF16).unwrap();
    let d = (dot(&v, &v, &r.accumulation).unwrap() - dot(&v, &v, &c.accumulation).unwrap()).abs();
    let th = matmul_threshold(&a, &b, None, &r, &c, DELTA).unwrap();
    assert!(d <= th.abs_frobenius, "|D| = {d} > {}", th.abs_frobenius);
}

/// Guaranteed bounds hold when roundings underflow (subnormal partials, products rounded to
/// zero), checked against exact sums.
#[test]
fn guaranteed_bounds_hold_under_underflow() {
    let xs = [Format::F32.round(1e-6, ttrace::Overflow::NonSaturating); 2];
    let acc = Accumulation::new(
        Format::F32,
        Format::F32,
        split(2, Format::F16, Combine::Sequential),
    );
    let err = (sum(&xs, &acc).unwrap() - exact_sum(&xs)).abs();
    let g = reduction_error(&xs, &acc, false).unwrap().guaranteed;
    assert!(err > 0.0 && err <= g, "error {err:e}, bound {g:e}");

    let x = [1.5 * 2f64.powi(-70)];
    let acc = Accumulation::new(Format::BF16, Format::F32, Order::Sequential)
        .with_products(Products::Rounded(Format::BF16));
    let terms = [x[0] * x[0]];
    let err = (dot(&x, &x, &acc).unwrap() - exact_dot(&x, &x).unwrap()).abs();
    let e = reduction_error(&terms, &acc, true).unwrap();
    assert!(
        err > 0.0 && err <= e.guaranteed,
        "error {err:e}, bound {:e}",
        e.guaranteed
    );
    // The product's rounding is determined: the model carries it exactly.
    assert_eq!(e.mean, -terms[0]);
}

/// A reduction that may overflow is refused with the overflow variant, never priced finite.
#[test]
fn overflow_is_refused() {
    let xs = [3e38, 3e38, -3e38].map(|v| Format::BF16.round(v, ttrace::Overflow::NonSaturating));
    let acc = Accumulation::new(Format::BF16, Format::F32, Order::Sequential);
    assert!(sum(&xs, &acc).unwrap().is_infinite());
    match reduction_error(&xs, &acc, false) {
        Err(Error::Overflow { format, .. }) => assert_eq!(format, Format::F32),
        other => panic!("expected an overflow error, got {other:?}"),
    }
}

fn assert_slice(ops: &[zoo::Op], trials: usize, min_cells: usize) {
    let rows = zoo::sweep(ops, &[(2, 4, trials), (64, 8, trials)], &|_, _, _| true).unwrap();
    let failing: Vec<String> = rows
        .iter()
        .filter(|r| r.cell.failures() > 0)
        .map(|r| {
            format!(
                "{} {} {} k={}: {:?}",
                r.op.name(),
                r.family.name(),
                r.pair,
                r.k,
                r.cell
            )
        })
        .collect();
    assert!(
        rows.len() >= min_cells,
        "the slice ran {} cells",
        rows.len()
    );
    assert!(failing.is_empty(), "{}", failing.join("\n"));
}

/// A quick slice of the zoo (the full sweep is `cargo run --release --example zoo`): every
/// data family and policy pair at K = 2 and 64 — no guaranteed or probabilistic violation, no
/// non-finite result the threshold did not refuse, the oracle's exact sums within the
/// guaranteed bound of both sides, and no probabilistic request that the engine's executions
/// sent to the guaranteed threshold (the model contradicted).
#[test]
fn zoo_slice_sums_and_means() {
    assert_slice(&[zoo::Op::Sum, zoo::Op::Mean, zoo::Op::AllReduce], 5, 900);
}

#[test]
fn zoo_slice_elementwise() {
    use ttrace::bounds::Elementwise;
    let ops = [
        zoo::Op::Elementwise(Elementwise::Add),
        zoo::Op::Elementwise(Elementwise::Scale { c: 0.1 }),
        zoo::Op::Elementwise(Elementwise::Gelu),
        zoo::Op::Elementwise(Elementwise::Silu),
    ];
    assert_slice(&ops, 5, 400);
}

#[test]
fn zoo_slice_matmuls() {
    assert_slice(&[zoo::Op::Matmul], 3, 300);
}

/// The same slice priced by the vectorized all-random model (`Pricing::Fast`; the walk where
/// its structure test fails).
#[test]
fn zoo_slice_matmuls_fast_pricing() {
    assert_slice(&[zoo::Op::MatmulFast], 3, 300);
}

/// Sums and means priced by the pass (as ones(1 × k)·xᵀ).
#[test]
fn zoo_slice_sums_fast_pricing() {
    assert_slice(&[zoo::Op::SumFast, zoo::Op::MeanFast], 3, 300);
}

#[test]
fn zoo_slice_softmax_and_norms() {
    use ttrace::engine::{AttentionImpl, Variance};
    let ops = [
        zoo::Op::Softmax(AttentionImpl::Standard),
        zoo::Op::LayerNorm(Variance::TwoPass),
        zoo::Op::RmsNorm,
    ];
    assert_slice(&ops, 5, 150);
}

/// LayerNorm and RMSNorm priced with `Pricing::Fast` (each side's sums by the compiled
/// all-random model, the walk where the executions do not fit it, near-constant rows on the
/// walk): no violation, no fallback to the guaranteed threshold.
#[test]
fn zoo_slice_norms_fast_pricing() {
    use ttrace::engine::Variance;
    let ops = [
        zoo::Op::LayerNormFast(Variance::TwoPass),
        zoo::Op::RmsNormFast,
    ];
    assert_slice(&ops, 5, 150);
}

/// The mean cross-entropy and its gradient on every family (masked and dominant-logit rows
/// among them), in other orders and vocabulary-parallel: no violation.
#[test]
fn zoo_slice_cross_entropy() {
    assert_slice(&[zoo::Op::CrossEntropy, zoo::Op::CrossEntropyGrad], 5, 600);
}

/// One head's attention (standard against pairwise and online forms, causal or not) on every
/// family of queries and keys: no violation, overflow refused.
#[test]
fn zoo_slice_attention() {
    use ttrace::engine::AttentionImpl;
    assert_slice(&[zoo::Op::Attention(AttentionImpl::Standard)], 5, 150);
}

/// Masked softmax rows: a −∞ causal mask and a −1e4 additive mask are priced (finite
/// thresholds that pass identical and correct outputs), a fully masked row is refused.
#[test]
fn masked_softmax_is_priced() {
    use ttrace::bounds::softmax_threshold;
    use ttrace::engine::{online_softmax, softmax, AttentionImpl};
    let k = 64;
    let mut x: Vec<f64> = (0..4 * k)
        .map(|i| ((i * 37 % 23) as f64 - 11.0) / 4.0)
        .collect();
    for r in 0..4 {
        for j in r * 8 + 1..k {
            x[r * k + j] = if r % 2 == 0 {
                f64::NEG_INFINITY
            } else {
                x[r * k + j] - 9984.0
            };
        }
    }
    let x = Tensor::from_vec(&[4, k], x, Format::F32).unwrap();
    let p = Policy::new(Format::BF16, Format::F32, Format::BF16);
    let standard = softmax(&x, &p).unwrap();
    let online = online_softmax(&x, 16, &p).unwrap();
    let observed = common::frob(standard.values(), online.values());
    let online_form = AttentionImpl::Online { block: 16 };
    for conf in [Confidence::Guaranteed, DELTA] {
        let same = softmax_threshold(
            &x,
            &p,
            AttentionImpl::Standard,
            &p,
            AttentionImpl::Standard,
            conf,
        )
        .unwrap();
        assert!(same.abs_frobenius == 0.0 && same.accepts(0.0));
        let th = softmax_threshold(&x, &p, AttentionImpl::Standard, &p, online_form, conf).unwrap();
        assert!(
            th.abs_frobenius.is_finite() && observed <= th.abs_frobenius,
            "{observed} > {th:?}"
        );
    }
    let all_masked = Tensor::from_vec(&[1, 4], vec![f64::NEG_INFINITY; 4], Format::F32).unwrap();
    assert!(matches!(
        softmax_threshold(
            &all_masked,
            &p,
            AttentionImpl::Standard,
            &p,
            online_form,
            DELTA
        ),
        Err(Error::NonFinite { .. })
    ));
}

/// One dominant logit over many small ones: the standard form's sequential FP32 denominator
/// absorbs every small numerator (each below half an ulp of 1), while the online form adds
/// block sums between half an ulp and one, each rounded up to the next point of the grid. Both
/// errors are deterministic (hundreds of ulps together), and both thresholds must carry them.
#[test]
fn absorbed_softmax_denominator_is_carried() {
    use ttrace::bounds::softmax_threshold;
    use ttrace::engine::{online_softmax, softmax, AttentionImpl};
    let p = Policy::new(Format::BF16, Format::F32, Format::F32);
    let online_form = AttentionImpl::Online { block: 16 };
    let judge = |x: &Tensor| -> (f64, Vec<Threshold>) {
        let standard = softmax(x, &p).unwrap();
        let online = online_softmax(x, 16, &p).unwrap();
        let observed = common::frob(standard.values(), online.values());
        let th = [Confidence::Guaranteed, DELTA].map(|conf| {
            softmax_threshold(x, &p, AttentionImpl::Standard, &p, online_form, conf).unwrap()
        });
        for t in &th {
            assert!(t.accepts(observed), "{observed} > {t:?}");
        }
        (observed, th.to_vec())
    };
    // Logits 0 and 4095 × −19: the standard denominator stays exactly 1 (each e^−19 is below
    // half an ulp of 1), the online one rounds each block sum (16 e^−19, between half an ulp
    // and one) up. Both errors are known from the data: the threshold is within 1.5 × of them.
    let k = 4096;
    let x: Vec<f64> = (0..k).map(|i| if i == 0 { 0.0 } else { -19.0 }).collect();
    let x = Tensor::from_vec(&[1, k], x, Format::BF16).unwrap();
    let (observed, th) = judge(&x);
    let dropped: f64 = x.values()[1..].iter().map(|v| v.exp()).sum();
    assert!(observed > dropped && dropped > 100.0 * f32::EPSILON as f64);
    assert!(
        th[1].abs_frobenius < 1.5 * observed,
        "{observed} vs {:?}",
        th[1]
    );
    // The zoo's cell that found it: dyadic logits k/8 with one raised by 30 (trial 155).
    let k = 16384;
    let mut v = zoo::generate(zoo::Family::Dyadic, 1, k, 155, Format::BF16, Format::F32);
    zoo::dominant_logit(&mut v, 0, 30.0, Format::BF16);
    judge(&Tensor::from_vec(&[1, k], v, Format::BF16).unwrap());
}

/// One-pass LayerNorm of rows 1000 ± 1 (the variance cancels and may come out negative): no
/// finite threshold, refused with the variant that says so; two-pass and Welford are priced.
#[test]
fn one_pass_variance_cancellation_is_refused() {
    use ttrace::bounds::{norm_threshold, NormOp};
    use ttrace::engine::Variance;
    let n = 1024;
    let x: Vec<f64> = (0..n)
        .map(|i| {
            Format::F32.round(
                1000.0 + ((i * 7919 % 2001) as f64 - 1000.0) / 1000.0,
                ttrace::Overflow::NonSaturating,
            )
        })
        .collect();
    let x = Tensor::from_vec(&[1, n], x, Format::F32).unwrap();
    let w = Tensor::from_vec(&[n], vec![1.0; n], Format::F32).unwrap();
    let p = Policy::new(Format::F32, Format::F32, Format::F32);
    let two = NormOp::LayerNorm(Variance::TwoPass);
    let price = |cand: NormOp, order: Order| {
        let c = p.clone().with_order(order);
        norm_threshold(
            &NormData {
                x: &x,
                weight: &w,
                bias: None,
                eps: 1e-5,
            },
            NormSide {
                op: two,
                policy: &p,
            },
            NormSide {
                op: cand,
                policy: &c,
            },
            DELTA,
        )
    };
    let r = price(NormOp::LayerNorm(Variance::OnePass), Order::Sequential);
    assert!(matches!(r, Err(Error::NoFiniteBound { .. })), "{r:?}");
    for cand in [two, NormOp::LayerNorm(Variance::Welford)] {
        let th = price(cand, Order::Pairwise { base: 8 }).unwrap();
        assert!(th.abs_frobenius.is_finite());
    }
}

/// Kahan's guaranteed bound against the exact sum (big-integer oracle) on cancelling,
/// constant and absorbing data, in BF16 and FP32 accumulators.
#[test]
fn kahan_guaranteed_bound_holds() {
    let cases: Vec<Vec<f64>> = vec![
        (0..500)
            .map(|i| if i % 2 == 0 { 1e4 } else { -1e4 } + (i as f64) / 64.0)
            .collect(),
        vec![1.8622474670410156; 300],
        std::iter::once(2f64.powi(24))
            .chain(std::iter::repeat_n(0.75, 200))
            .collect(),
    ];
    for acc_f in [Format::F32, Format::BF16] {
        for xs in &cases {
            let xs: Vec<f64> = xs
                .iter()
                .map(|&v| acc_f.round(v, ttrace::Overflow::NonSaturating))
                .collect();
            let acc = Accumulation::new(acc_f, acc_f, Order::Kahan);
            let computed = sum(&xs, &acc).unwrap();
            let err = common::Dy::from_f64(computed)
                .add(&common::exact(&xs).neg())
                .round(common::spec("f64"), false)
                .abs();
            let g = reduction_error(&xs, &acc, false).unwrap().guaranteed;
            assert!(err <= g, "{acc_f}: error {err:e} > bound {g:e}");
            // In FP32 (n·u ≪ 1) about 2u·Σ|x| (Knuth), not the n·u of recursive summation; in
            // BF16 with n·u ≈ 1 the second-order terms are of the same size.
            if acc_f == Format::F32 {
                let scale: f64 = xs.iter().map(|v| v.abs()).sum();
                assert!(
                    g <= 2.1 * acc_f.unit_roundoff() * scale,
                    "{g:e} vs {scale:e}"
                );
            }
        }
    }
}

/// The classes of structured data on which the scale and bias tests fired on correct
/// arithmetic before their deterministic round-off was handled (`examples/detect_zoo.rs`,
/// `papers/checking.md` §7): sequentially summed softmax rows of gridded logits (a biased
/// shared factor per row), constant and repeated rows (equal round-off), two stored formats
/// (one-sided rounding), rows of few distinct values. Correct pairs: none may fire; where the
/// test applies it still runs.
#[test]
fn the_systematic_tests_hold_on_the_structured_data_that_broke_them() {
    use ttrace::check::{compare_tensor_with, Detection, Detector};
    use ttrace::engine::{AttentionImpl, Variance};
    use zoo::{Family, Op};
    let cases: [(Op, Family, &str, usize, bool); 16] = [
        // Rows of few distinct values (dyadic logits, near-constant rows, BF16 inputs
        // normalized in FP32): structured, no systematic test (`Detect::structured`; the
        // last four fired at 1.05–2.12× before it).
        (
            Op::Softmax(AttentionImpl::Standard),
            Family::Dyadic,
            "->f32 seq vs pairwise",
            1024,
            false,
        ),
        (
            Op::Softmax(AttentionImpl::Standard),
            Family::NearConstant,
            "->f32 seq vs pairwise",
            1024,
            false,
        ),
        (
            Op::LayerNorm(Variance::TwoPass),
            Family::NearConstant,
            "two-pass vs one-pass: seq vs pairwise",
            1024,
            false,
        ),
        (Op::RmsNorm, Family::NearConstant, "rms", 1024, false),
        (
            Op::LayerNorm(Variance::TwoPass),
            Family::Mean(30.0),
            "two-pass vs one-pass: bf16 seq",
            1024,
            false,
        ),
        // Data of distinct values keep the tests.
        (Op::RmsNorm, Family::Gaussian, "rms", 1024, true),
        (
            Op::LayerNorm(Variance::TwoPass),
            Family::Mean(30.0),
            "two-pass vs one-pass: f32 seq",
            1024,
            true,
        ),
        // BF16 logits into an FP32 softmax: BF16's grid, normalized (a row's sum biased
        // by −2.3 ε against a spread of 4.7 ε: the slack kept it, at a cost in power).
        (
            Op::Softmax(ttrace::engine::AttentionImpl::Standard),
            Family::Gaussian,
            "->f32 seq vs pairwise",
            1024,
            false,
        ),
        (
            Op::Softmax(ttrace::engine::AttentionImpl::Standard),
            Family::SortedDescending,
            "->f32 seq vs pairwise",
            1024,
            false,
        ),
        (
            Op::LayerNorm(ttrace::engine::Variance::TwoPass),
            Family::Constant,
            "two-pass: seq",
            1024,
            false,
        ),
        (Op::RmsNorm, Family::RepeatedRows, "rms", 1024, false),
        (
            Op::Elementwise(ttrace::bounds::Elementwise::Gelu),
            Family::Gaussian,
            "bf16->bf16 vs bf16->f32",
            1024,
            false,
        ),
        // Rows that nearly repeat one another (`Detect::nearly_repeated`): attention whose
        // softmax rows are nearly uniform (every output row nearly the mean of V) and the
        // gradient of logits whose rows alternate or stall — one shared round-off, not
        // independent rows (the detect zoo's false alarms at 1.04–2.21× before it).
        (
            Op::Attention(AttentionImpl::Standard),
            Family::Stall,
            "f32->f32 standard seq vs pairwise",
            1024,
            false,
        ),
        (
            Op::Attention(AttentionImpl::Standard),
            Family::Alternating,
            "f32->f32 standard vs online(16)",
            1024,
            false,
        ),
        (
            Op::CrossEntropyGrad,
            Family::Alternating,
            "f32->f32 seq vs vocab-parallel 8",
            1024,
            false,
        ),
        (
            Op::CrossEntropyGrad,
            Family::Stall,
            "f32->f32 seq vs vocab-parallel 8",
            64,
            false,
        ),
    ];
    let rows = 256;
    for (op, family, pair_name, k, applies) in cases {
        let pair = zoo::pairs(op)
            .into_iter()
            .find(|p| p.name.starts_with(pair_name))
            .unwrap_or_else(|| panic!("no pair {pair_name}"));
        let input = pair.reference.input();
        let acc = pair.reference.accumulator();
        let (x, y) = if let Op::Attention(_) = op {
            // The detect zoo's trial 0 (`examples/detect_zoo.rs`).
            zoo::attention_operands(family, rows, k, 0, input, acc).unwrap()
        } else {
            let seed = if op == Op::CrossEntropyGrad { 0 } else { 1 };
            let x = zoo::generate(family, rows, k, seed, input, acc);
            let y = zoo::generate(Family::Gaussian, rows, k, seed ^ 0x5eed, input, acc);
            (
                Tensor::from_vec(&[rows, k], x, input).unwrap(),
                Tensor::from_vec(&[rows, k], y, input).unwrap(),
            )
        };
        let (op_r, op_c) = match op {
            Op::Elementwise(_) | Op::CrossEntropyGrad => (op, op),
            _ => (pair.ref_op, pair.cand_op),
        };
        let side = |o: Op, p: &Policy| {
            let v = zoo::execute(o, &x, &y, p).unwrap();
            Tensor::from_vec(&[rows, k], v, p.output).unwrap()
        };
        let (r, c) = (side(op_r, &pair.reference), side(op_c, &pair.candidate));
        let rn = r.values().iter().map(|v| v * v).sum::<f64>().sqrt();
        let eps = pair.reference.output.machine_epsilon();
        let v = compare_tensor_with(
            "x|fwd.output.0",
            &r,
            &c,
            0.5 * rn,
            eps,
            Detection::default(),
        );
        let name = format!("{} {} {pair_name}", op.name(), family.name());
        let systematic: Vec<_> = v
            .findings
            .iter()
            .filter(|f| matches!(f.detector, Detector::Scale | Detector::Bias))
            .collect();
        assert!(
            systematic.iter().all(|f| !f.fired),
            "{name}: {systematic:?}"
        );
        if applies {
            assert_eq!(systematic.len(), 2, "{name}: the tests should apply");
        }
    }
}

/// Near-constant FP32 rows (a constant, one element in eight raised by a small integer) agree
/// modulo every spacing their sums meet, so their undetermined roundings fall alike row after
/// row: priced as independent rows, 5 of 100 trials of 16 rows × 64 (sequential vs
/// block-FMA(32)) and 3 of 10 of 8 rows × 1,024 (vs blocked(16)) came out over the
/// probabilistic threshold (closest 0.958). The rows are one component now, and the model
/// fits: the engine's executions never send a trial to the guaranteed threshold (a failure
/// of the cell).
#[test]
fn near_constant_rows_are_priced_as_moving_together() {
    let keep = |_: zoo::Op, family: zoo::Family, pair: &str| {
        family == zoo::Family::NearConstant
            && pair.starts_with("f32->f32")
            && (pair.contains("blocked(16)") || pair.contains("block-FMA(32)"))
    };
    let rows = zoo::sweep(
        &[zoo::Op::Sum, zoo::Op::AllReduce],
        &[(64, 16, 100), (1024, 8, 10)],
        &keep,
    )
    .unwrap();
    assert_eq!(rows.len(), 8);
    for r in &rows {
        assert!(
            r.cell.failures() == 0,
            "{} {} k={}: {:?}",
            r.op.name(),
            r.pair,
            r.k,
            r.cell
        );
    }
}

/// The adversary (`zoo::adversary`, `examples/adversary.rs`) climbing every op and pair of
/// the zoo for a short while: it must find no input beyond a guaranteed bound (probabilistic
/// thresholds rest on a model that an adversary may beat; the example reports those).
#[test]
fn the_adversary_finds_no_guaranteed_violation() {
    let mut climbs = 0;
    for op in zoo::ops() {
        for pair in zoo::pairs(op) {
            for c in zoo::adversary::climb(op, &pair, 100, 2, 7) {
                climbs += 1;
                assert!(
                    !c.calls.guaranteed_violated(),
                    "{} {} from {} {:?}: {:?}\n x = {:?}",
                    op.name(),
                    pair.name,
                    c.family.name(),
                    c.shape,
                    c.calls,
                    c.x
                );
            }
        }
    }
    assert!(climbs > 300, "{climbs} climbs");
}
