//! The counterexamples of the independent adversarial suite (issue 34), each with its explicit
//! inputs: both sides run on the engine, and ‖cand − ref‖ must lie within the guaranteed and
//! the probabilistic (δ = 1e-6) thresholds; the refusals that had a finite bound are priced.

use ttrace::bounds::{
    matmul_threshold, norm_threshold, norm_threshold_priced, softmax_threshold, sum_threshold,
    Confidence, NormData, NormOp, NormSide, Pricing,
};
use ttrace::engine::{layer_norm, softmax, AttentionImpl, Variance};
use ttrace::{Error, Format, Order, Overflow, Policy, Tensor};

mod common;
use common::frob;

const DELTA: Confidence = Confidence::Probabilistic { delta: 1e-6 };

/// `r` vocabulary-parallel over 8 shards with BF16 partials, combined in a ring (the
/// adversary's cells where its cross-entropy and softmax cases were found).
fn vocabulary_parallel_bf16(r: &Policy) -> Policy {
    r.clone().with_order(Order::SplitK {
        parts: 8,
        inner: Box::new(Order::Sequential),
        partial: Format::BF16,
        combine: ttrace::Combine::Ring { start: 1 },
    })
}

/// A LayerNorm pair on one row: (observed ‖D‖, guaranteed, probabilistic), both sides executed
/// by the engine and priced by `norm_threshold`; zeros for a refusal where a side's output is
/// not finite or, with `allow_refusal`, a one-pass variance is involved. The probabilistic
/// threshold priced with `Pricing::Fast` (the compiled all-random model, the walk where the
/// executions do not fit it) must hold the difference too.
fn layer_norm_case(
    x: &[f64],
    format: Format,
    eps: f64,
    reference: (Variance, &Policy),
    candidate: (Variance, &Policy),
    allow_refusal: bool,
) -> ttrace::Result<(f64, f64, f64)> {
    let n = x.len();
    let x = Tensor::rounded(&[1, n], x.to_vec(), format, Overflow::NonSaturating)?;
    let w = Tensor::from_vec(&[n], vec![1.0; n], format)?;
    let b = Tensor::zeros(&[n], format);
    let (yr, _) = layer_norm(&x, &w, &b, eps, reference.0, reference.1)?;
    let (yc, _) = layer_norm(&x, &w, &b, eps, candidate.0, candidate.1)?;
    let d = frob(yr.values(), yc.values());
    let finite = yr.values().iter().chain(yc.values()).all(|v| v.is_finite());
    let data = NormData {
        x: &x,
        weight: &w,
        bias: Some(&b),
        eps,
    };
    let sides = (
        NormSide {
            op: NormOp::LayerNorm(reference.0),
            policy: reference.1,
        },
        NormSide {
            op: NormOp::LayerNorm(candidate.0),
            policy: candidate.1,
        },
    );
    let th =
        [Confidence::Guaranteed, DELTA].map(|conf| norm_threshold(&data, sides.0, sides.1, conf));
    let [g, p] = th;
    let fast = norm_threshold_priced(&data, sides.0, sides.1, DELTA, Pricing::Fast);
    match (&p, fast) {
        (Ok(_), Ok(f)) => assert!(
            d <= f.abs_frobenius,
            "fast-priced {:e} < ‖D‖ = {d:e}",
            f.abs_frobenius
        ),
        (Err(e), Err(f)) => assert_eq!(
            std::mem::discriminant(e),
            std::mem::discriminant(&f),
            "{e:?} against {f:?}"
        ),
        (p, f) => panic!("walk {p:?}, fast {f:?}"),
    }
    let one_pass = allow_refusal && [reference.0, candidate.0].contains(&Variance::OnePass);
    match (g, p) {
        (Ok(g), Ok(p)) => Ok((d, g.abs_frobenius, p.abs_frobenius)),
        // A refusal is right where a side's output is not finite, and allowed for a one-pass
        // variance the model cannot determine (its guaranteed error may exceed var + eps).
        (Err(Error::NoFiniteBound { .. }), Err(Error::NoFiniteBound { .. }))
            if !finite || one_pass =>
        {
            Ok((0.0, 0.0, 0.0))
        }
        (g, p) => Err(g.and(p).unwrap_err()),
    }
}

fn assert_within(name: &str, (d, g, p): (f64, f64, f64)) {
    assert!(d <= g, "{name}: guaranteed {g:e} < ‖D‖ = {d:e}");
    assert!(d <= p, "{name}: probabilistic {p:e} < ‖D‖ = {d:e}");
}

/// Case 1: a constant FP32 row: two-pass rounds its mean (x − μ̂ = 1 ulp), Welford and the exact
/// model do not. The thresholds were ≈ 0 (the two sides were taken to share μ̂).
#[test]
fn constant_rows_under_every_variance_algorithm() {
    let f32p = Policy::new(Format::F32, Format::F32, Format::F32);
    let seq = f32p.clone();
    let pw = f32p.clone().with_order(Order::Pairwise { base: 8 });
    for x in [vec![1.7; 3], vec![1.7; 64], vec![0.1; 7], vec![3.3; 1000]] {
        for (r, c) in [
            (Variance::TwoPass, Variance::Welford),
            (Variance::TwoPass, Variance::OnePass),
            (Variance::Welford, Variance::OnePass),
            (Variance::TwoPass, Variance::TwoPass),
        ] {
            for (pr, pc) in [(&seq, &seq), (&seq, &pw)] {
                let name = format!("{} × {}: {r:?} vs {c:?}", x[0], x.len());
                if r == c && pr == pc {
                    continue;
                }
                assert_within(
                    &name,
                    layer_norm_case(&x, Format::F32, 1e-5, (r, pr), (c, pc), true).unwrap(),
                );
            }
        }
    }
    // The case: ‖D‖ = 6.53e-5.
    let (d, _, _) = layer_norm_case(
        &[1.7; 3],
        Format::F32,
        1e-5,
        (Variance::TwoPass, &seq),
        (Variance::Welford, &seq),
        true,
    )
    .unwrap();
    assert!(d > 6e-5, "{d:e}");
}

/// Case 2: Welford with a large mean: every μ update rounds at the spacing of 1000.
#[test]
fn welford_with_a_large_mean() {
    let p = Policy::new(Format::BF16, Format::F32, Format::F32);
    let x = [
        1000.0, 1000.0, 1000.0, 1000.0, 1000.0, 1004.0, 1000.0, 1000.0,
    ];
    let case = layer_norm_case(
        &x,
        Format::BF16,
        1e-5,
        (Variance::TwoPass, &p),
        (Variance::Welford, &p),
        false,
    )
    .unwrap();
    assert!(case.0 > 1e-4, "{case:?}");
    assert_within("1000 × 7, 1004", case);
    // The family: large-mean near-constant rows, every pair of algorithms.
    for k in [8usize, 64, 333] {
        for m in [1000.0, 3e4, 250.0] {
            let x: Vec<f64> = (0..k)
                .map(|i| if (i * 7919) % 5 == 0 { m + 4.0 } else { m })
                .collect();
            for (r, c) in [
                (Variance::TwoPass, Variance::Welford),
                (Variance::Welford, Variance::Welford),
            ] {
                let pc = p.clone().with_order(Order::Pairwise { base: 8 });
                assert_within(
                    &format!("{m} ({k}) {r:?} vs {c:?}"),
                    layer_norm_case(&x, Format::BF16, 1e-5, (r, &p), (c, &pc), false).unwrap(),
                );
            }
        }
    }
}

/// Case 3: one outlier: x_16 = 1e6 among 1023 values in [−1, 1]. The squares of x − μ̂ (≈ 977²)
/// added to 1e12 round up by the same amount each time.
#[test]
fn a_single_large_outlier() {
    let p = Policy::new(Format::F32, Format::F32, Format::F32);
    let pw = p.clone().with_order(Order::Pairwise { base: 8 });
    let mut x: Vec<f64> = (0..1024)
        .map(|j| ((7919 * j) % 1009) as f64 / 504.5 - 1.0)
        .collect();
    x[16] = 1e6;
    for v in [Variance::TwoPass, Variance::OnePass, Variance::Welford] {
        assert_within(
            &format!("{v:?}"),
            layer_norm_case(&x, Format::F32, 0.0, (v, &p), (v, &pw), false).unwrap(),
        );
    }
}

/// Case 4: FP16 accumulation that stalls: [1, 8192]·[8192, 1], input, accumulator and output
/// FP16. The sequential sum crosses into [2⁻¹⁰, 2⁻⁹) and then absorbs or rounds up every
/// product: its error, −4.36e-4, is systematic. The model used to lose track of where ŝ lay
/// (its bound grew by U/2 at each crossing, faster than the sum) and priced the stall as
/// random; the interval carried by monotone rounding pins ŝ, so the stall is determined.
#[test]
fn fp16_accumulation_stall() {
    let f16 = |v: f64| Format::F16.round(v, Overflow::NonSaturating);
    let k = 8192;
    let x: Vec<f64> = (0..k)
        .map(|j| f16(((7919 * j + 3) % 1009) as f64 / 1009.0 * 2f64.powi(-10)))
        .collect();
    let y: Vec<f64> = (0..k)
        .map(|j| f16(((104729 * j + 11) % 1009) as f64 / 1009.0 * 2f64.powi(-10)))
        .collect();
    let r = Policy::new(Format::F16, Format::F16, Format::F16);
    let c = r.clone().with_order(Order::Pairwise { base: 8 });
    let a = Tensor::from_vec(&[1, k], x, Format::F16).unwrap();
    let b = Tensor::from_vec(&[k, 1], y, Format::F16).unwrap();
    let d = frob(
        ttrace::engine::matmul(&a, &b, &r).unwrap().values(),
        ttrace::engine::matmul(&a, &b, &c).unwrap().values(),
    );
    assert!(d > 4e-4, "{d:e}");
    let t = matmul_threshold(&a, &b, None, &r, &c, Confidence::Guaranteed).unwrap();
    assert!(d <= t.abs_frobenius, "{:e} < {d:e}", t.abs_frobenius);
    let t = matmul_threshold(&a, &b, None, &r, &c, DELTA).unwrap();
    assert!(d <= t.abs_frobenius, "{:e} < {d:e}", t.abs_frobenius);
    // And not by a margin that would hide a bug of the stall's size (it was 3.50e-4 against
    // 4.34e-4 before; the determined stall leaves a few U of the crossings random).
    assert!(
        t.abs_frobenius <= 1.05 * d,
        "{:e} vs {d:e}",
        t.abs_frobenius
    );
}

/// Case 5: softmax with an FP32 output, sequential against pairwise(8) sums: the per-element bound.
#[test]
fn softmax_per_element_bound() {
    let p = Policy::new(Format::BF16, Format::F32, Format::F32);
    let pw = p.clone().with_order(Order::Pairwise { base: 8 });
    let row = [
        3.8125, 5.9375, 4.25, 2.109375, 0.9921875, -0.2578125, -1.5546875, 0.79296875, -2.546875,
    ];
    let x = Tensor::from_vec(&[1, 9], row.to_vec(), Format::BF16).unwrap();
    let (yr, yc) = (softmax(&x, &p).unwrap(), softmax(&x, &pw).unwrap());
    let d = frob(yr.values(), yc.values());
    let max = yr
        .values()
        .iter()
        .zip(yc.values())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(max > 1.1e-7, "{max:e}");
    // The pairwise kernel priced as one of a family (its sum undetermined): the row's common
    // part must enter each element's own bound.
    let family = p.clone().with_order(Order::AnyOf(vec![
        Order::Sequential,
        Order::Pairwise { base: 8 },
    ]));
    for (cand, conf) in [
        (&pw, Confidence::Guaranteed),
        (&pw, DELTA),
        (&family, DELTA),
    ] {
        let t = softmax_threshold(
            &x,
            &p,
            AttentionImpl::Standard,
            cand,
            AttentionImpl::Standard,
            conf,
        )
        .unwrap();
        assert!(
            d <= t.abs_frobenius,
            "{conf:?}: {:e} < {d:e}",
            t.abs_frobenius
        );
        assert!(
            max <= t.per_element,
            "{conf:?}: per element {:e} < {max:e}",
            t.per_element
        );
    }
}

/// Refusals with a bound: a one-value row (both outputs are exactly β), two-pass against
/// Welford with ε > 0, alternating BF16 sums accumulated in FP16 at K = 4096.
#[test]
fn refusals_that_had_a_bound() {
    let p = Policy::new(Format::F32, Format::F32, Format::F32);
    let pw = p.clone().with_order(Order::Pairwise { base: 8 });
    let (d, g, pr) = layer_norm_case(
        &[2.5],
        Format::F32,
        1e-5,
        (Variance::OnePass, &p),
        (Variance::OnePass, &pw),
        false,
    )
    .unwrap();
    assert_eq!(d, 0.0);
    assert!(g.is_finite() && pr.is_finite());
    let mut x: Vec<f64> = (0..4096).map(|i| 1000.0 + (i % 3) as f64).collect();
    x[7] = 1004.0;
    assert_within(
        "two-pass vs Welford, eps 1e-5",
        layer_norm_case(
            &x,
            Format::F32,
            1e-5,
            (Variance::TwoPass, &p),
            (Variance::Welford, &p),
            false,
        )
        .unwrap(),
    );
    // Alternating BF16 terms (partial sums stay near 100) in an FP16 accumulator.
    let k = 4096;
    let xs: Vec<f64> = (0..k)
        .map(|i| {
            let v = 100.0 + (i % 13) as f64 / 4.0;
            if i % 2 == 0 {
                v
            } else {
                -v + 0.25
            }
        })
        .collect();
    let t = Tensor::rounded(&[1, k], xs, Format::BF16, Overflow::NonSaturating).unwrap();
    let r = Policy::new(Format::BF16, Format::F16, Format::F32);
    let c = r.clone().with_order(Order::Pairwise { base: 8 });
    for conf in [Confidence::Guaranteed, DELTA] {
        match sum_threshold(&t, &r, &c, false, conf) {
            Ok(th) => assert!(th.abs_frobenius.is_finite()),
            Err(e) => panic!("{conf:?}: refused: {e}"),
        }
    }
}

/// Found by a probe of orders the zoo's norms do not run: a two-pass LayerNorm whose candidate
/// sums by Kahan's compensated order was refused with "Kahan summation is priced as a whole
/// order, not inside a split-K part" (no split-K was asked for): the variance's sum over the
/// model's squares, known within radii, went to the all-random model, which prices plain
/// orders only. Kahan's running bound now takes the radii (each term's magnitude raised by
/// its radius, each partial sum's by the radii so far), and the pair is priced and holds
/// against the engine on Gaussian, large-mean and near-constant rows in FP32 and BF16.
#[test]
fn layer_norm_with_compensated_summation_is_priced() {
    for input in [Format::F32, Format::BF16] {
        let p = Policy::new(input, Format::F32, Format::F32);
        let kahan = p.clone().with_order(Order::Kahan);
        let mut g = ttrace::engine::SplitMix64::for_name("layer_norm_kahan", 0);
        for (name, x) in [
            (
                "gaussian",
                (0..300).map(|_| g.normal()).collect::<Vec<f64>>(),
            ),
            ("mean 1000", (0..300).map(|_| 1000.0 + g.normal()).collect()),
            (
                "near-constant",
                (0..64)
                    .map(|i| 250.0 + if i % 8 == 3 { 2.0 } else { 0.0 })
                    .collect(),
            ),
        ] {
            for (r, c) in [
                (Variance::TwoPass, Variance::TwoPass),
                (Variance::TwoPass, Variance::OnePass),
                (Variance::OnePass, Variance::TwoPass),
            ] {
                let case = layer_norm_case(&x, input, 1e-5, (r, &p), (c, &kahan), true)
                    .unwrap_or_else(|e| panic!("{input} {name} {r:?} vs {c:?}: {e}"));
                assert_within(&format!("{input} {name} {r:?} vs {c:?} (Kahan)"), case);
            }
        }
    }
}

/// Found by ttrace's own adversary (`examples/adversary.rs`, a hill climb over the data):
/// one row of FP32 logits whose target's loss, 525.08, a vocabulary-parallel candidate rounds
/// onto its BF16 partial (524) wherever the row's small difference puts it — the rounding
/// absorbs that difference, which the model had added, signed, against the sum's own error:
/// the probabilistic threshold was 1.00025× too small.
#[test]
fn a_loss_rounded_onto_a_coarse_partial_absorbs_the_rows_difference() {
    use ttrace::bounds::cross_entropy_threshold;
    use ttrace::engine::cross_entropy;
    let x = [
        -0.0009988707024604082,
        -522.9137573242188,
        -524.1173706054688,
        -2.802596928649634e-45,
        -1058.8802490234375,
        -523.6959228515625,
        -0.0009988707024604082,
        -0.0009988707024604082,
    ];
    let logits = Tensor::from_vec(&[1, 8], x.to_vec(), Format::F32).unwrap();
    let targets = [5];
    let r = Policy::new(Format::F32, Format::F32, Format::F32);
    let c = vocabulary_parallel_bf16(&r);
    let lr = cross_entropy(&logits, &targets, &r).unwrap().values()[0];
    let lc = cross_entropy(&logits, &targets, &c).unwrap().values()[0];
    assert_eq!(lc, 524.0, "the candidate's loss on BF16's grid");
    let d = (lc - lr).abs();
    let [g, p] = [Confidence::Guaranteed, DELTA]
        .map(|conf| cross_entropy_threshold(&logits, &targets, &r, &c, conf).unwrap());
    assert_within("cross-entropy", (d, g.abs_frobenius, p.abs_frobenius));
    assert!(d <= p.per_element, "{d:e} > {:e}", p.per_element);
}

/// Found by ttrace's own adversary (`examples/adversary.rs`): an FP32 row of 64 values, one
/// of them 6.3·10⁶, the rest below 200 — two-pass against Welford. After the outlier's square
/// the two-pass sum of squares adds 41 nearly equal squares (x − μ̂ with μ̂ ≈ 98,293), each
/// within its deviation of a midpoint of the sum's grid and all moved alike by μ̂'s error:
/// they erred alike, and the outlier's element came out 1.46× its per-element bound (the
/// norm 1.15×) with those roundings priced as independent.
#[test]
fn nearly_equal_squares_straddling_midpoints_err_alike() {
    let x = [
        1.0704426765441895,
        191.9736328125,
        0.7533606290817261,
        0.6557630300521851,
        0.5086846351623535,
        -0.9108579158782959,
        -0.011668354272842407,
        -0.31483104825019836,
        -1.0811962965817656e-05,
        -7.493588782381266e-05,
        -0.007045418489724398,
        -1.401298464324817e-45,
        -4.557951615424827e-05,
        -5.605193857299268e-45,
        -0.0956951379776001,
        -0.000428572267992422,
        -0.0024805646389722824,
        -4.6183433966007215e-08,
        -0.0,
        0.006669983267784119,
        -0.0035407007671892643,
        -0.1913902759552002,
        6290594.5,
        -0.019445834681391716,
        -0.03922063857316971,
        -0.054588861763477325,
        -0.191390261054039,
        -0.009914219379425049,
        -0.17714320123195648,
        -0.006689843256026506,
        -0.19219054281711578,
        -0.00496112834662199,
        -0.0010249800980091095,
        -0.038482699543237686,
        -0.0014614721294492483,
        -0.08857159316539764,
        -0.008675292134284973,
        -0.10917772352695465,
        -0.09614739567041397,
        -0.0957874283194542,
        -0.0891336053609848,
        0.25298741459846497,
        -0.1947079300880432,
        -0.1771431416273117,
        -0.09578739106655121,
        -0.09614738076925278,
        -0.1913902759552002,
        -0.00029974355129525065,
        -0.09494282305240631,
        -0.0017846173141151667,
        -8.446843935416837e-08,
        -0.04842684045433998,
        0.0,
        -0.027294432744383812,
        -0.01716790720820427,
        -0.003569233464077115,
        -0.004332075361162424,
        -0.320404052734375,
        -0.17754460871219635,
        -0.0017792558064684272,
        -0.19222915172576904,
        -0.023565785959362984,
        -14.429017066955566,
        -0.01984451897442341,
    ];
    let p = Policy::new(Format::F32, Format::F32, Format::F32);
    let n = x.len();
    let t = Tensor::from_vec(&[1, n], x.to_vec(), Format::F32).unwrap();
    let w = Tensor::from_vec(&[n], vec![1.0; n], Format::F32).unwrap();
    let b = Tensor::zeros(&[n], Format::F32);
    let (yr, _) = layer_norm(&t, &w, &b, 1e-5, Variance::TwoPass, &p).unwrap();
    let (yc, _) = layer_norm(&t, &w, &b, 1e-5, Variance::Welford, &p).unwrap();
    let data = NormData {
        x: &t,
        weight: &w,
        bias: Some(&b),
        eps: 1e-5,
    };
    let side = |v| NormSide {
        op: NormOp::LayerNorm(v),
        policy: &p,
    };
    let [g, pr] = [Confidence::Guaranteed, DELTA].map(|conf| {
        norm_threshold(
            &data,
            side(Variance::TwoPass),
            side(Variance::Welford),
            conf,
        )
        .unwrap()
    });
    let d = frob(yr.values(), yc.values());
    assert_within("layernorm", (d, g.abs_frobenius, pr.abs_frobenius));
    let dmax = yr
        .values()
        .iter()
        .zip(yc.values())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(dmax <= pr.per_element, "{dmax:e} > {:e}", pr.per_element);
    assert!(dmax <= g.per_element);
}

/// Found by ttrace's own adversary (`examples/adversary.rs`, seed 2): four rows of 32 BF16
/// logits whose candidate sums its denominator as 8 vocabulary-parallel partials all-reduced
/// in BF16, the partials placed near midpoints of BF16's grid in every row, so that every
/// row's error sits near its largest value at once — data built against the uniform-phase
/// model, 1.016× its probabilistic norm threshold. No model of independent roundings covers
/// such data; the engine's executions of the two declared sides, which now check every op's
/// probabilistic threshold, see it exceeded and return the guaranteed threshold.
#[test]
fn softmax_partials_placed_against_the_model_fall_back() {
    let x = [
        0.078125,
        3.504753112792969e-5,
        -0.333984375,
        1.34375,
        0.35546875,
        -0.07080078125,
        1.2890625,
        0.384765625,
        -1.625,
        0.333984375,
        0.032958984375,
        1.109375,
        -2.140625,
        0.6171875,
        -0.0284423828125,
        -0.6796875,
        0.228515625,
        -1.9765625,
        -0.3828125,
        -0.6640625,
        -2.3365020751953125e-5,
        -0.37109375,
        0.88671875,
        -1.71875,
        0.1279296875,
        1.3515625,
        -0.87109375,
        1.1484375,
        -1.0625,
        0.5078125,
        -2.109375,
        0.1396484375,
        -0.0,
        -1.015625,
        -0.55859375,
        1.34375,
        0.35546875,
        -0.03515625,
        1.3046875,
        0.384765625,
        -1.625,
        0.33984375,
        0.033203125,
        0.5546875,
        -0.0,
        0.62109375,
        -1.8367099231598242e-40,
        -0.6640625,
        0.23046875,
        -1.9296875,
        -0.37890625,
        -0.65625,
        2.296875,
        -0.365234375,
        0.90625,
        -1.6640625,
        0.1298828125,
        -0.765625,
        -0.8515625,
        1.1484375,
        1.1953125,
        0.5078125,
        2.0625,
        0.140625,
        0.07861328125,
        -0.48828125,
        0.578125,
        1.34375,
        0.1787109375,
        -0.0693359375,
        1.2890625,
        0.38671875,
        -0.8125,
        -0.7734375,
        -0.033203125,
        0.33984375,
        -2.09375,
        0.62109375,
        -0.05615234375,
        0.0,
        0.45703125,
        -1.9296875,
        -0.380859375,
        -0.6328125,
        0.6875,
        -0.3671875,
        0.8984375,
        -1.6640625,
        0.142578125,
        -0.77734375,
        -0.8359375,
        0.0,
        1.1796875,
        0.51953125,
        -2.09375,
        0.1455078125,
        -0.078125,
        -1.0859375,
        0.0,
        1.34375,
        0.35546875,
        -0.0732421875,
        1.2890625,
        0.7578125,
        -0.0693359375,
        0.337890625,
        0.0322265625,
        1.109375,
        -0.0,
        0.310546875,
        -0.056396484375,
        -0.0,
        -0.0,
        -1.9296875,
        -1.625,
        -0.65234375,
        0.341796875,
        -0.36328125,
        0.90625,
        0.1279296875,
        -0.1298828125,
        -0.796875,
        -0.86328125,
        1.1484375,
        0.0,
        -0.435546875,
        -2.171875,
        -1.5497207641601563e-6,
    ];
    let logits = Tensor::from_vec(&[4, 32], x.to_vec(), Format::BF16).unwrap();
    let r = Policy::new(Format::BF16, Format::F32, Format::F32);
    let c = vocabulary_parallel_bf16(&r);
    let (yr, yc) = (softmax(&logits, &r).unwrap(), softmax(&logits, &c).unwrap());
    let d = frob(yr.values(), yc.values());
    let [g, p] = [Confidence::Guaranteed, DELTA].map(|conf| {
        let s = AttentionImpl::Standard;
        softmax_threshold(&logits, &r, s, &c, s, conf).unwrap()
    });
    assert_within("softmax", (d, g.abs_frobenius, p.abs_frobenius));
}

/// Found by ttrace's own adversary (seed 0): the cross-entropy gradient of four rows of 32
/// FP32 logits, the candidate vocabulary-parallel over 8 shards with BF16 partials — the
/// same class as the softmax above, 1.009× the probabilistic norm threshold.
#[test]
fn cross_entropy_grad_partials_placed_against_the_model_fall_back() {
    use ttrace::bounds::cross_entropy_grad_threshold;
    use ttrace::engine::cross_entropy_backward;
    let x = [
        -0.36793363094329834,
        0.6164249777793884,
        0.45733365416526794,
        0.3240065574645996,
        -1.2205400466918945,
        -0.8266467452049255,
        2.150290012359619,
        0.5331065058708191,
        0.5213481187820435,
        0.8791481852531433,
        0.3488462567329407,
        -0.16786694526672363,
        -1.401298464324817e-45,
        0.2805881202220917,
        1.3423515558242798,
        -0.5253956913948059,
        -0.040858954191207886,
        -1.5836310386657715,
        1.644583821296692,
        -0.1911514401435852,
        0.7063015699386597,
        0.5622125267982483,
        -1.1627154350280762,
        -1.0546917915344238,
        0.5362535119056702,
        1.3577884435653687,
        0.0,
        -1.50977623462677,
        0.0,
        -0.22087416052818298,
        -0.04780719429254532,
        0.3240066468715668,
        0.2841850817203522,
        -0.2586901783943176,
        0.9843100309371948,
        0.0,
        0.0678262785077095,
        0.8543253540992737,
        -0.9689390063285828,
        -0.7367668151855469,
        0.47350233793258667,
        2.018726348876953,
        -1.6249176263809204,
        -1.1027214527130127,
        -0.8110516667366028,
        2.802596928649634e-45,
        0.9241696000099182,
        0.1276281476020813,
        -0.5514017939567566,
        0.5737261176109314,
        -1.0698825120925903,
        -0.6053469777107239,
        0.0,
        0.14417396485805511,
        -2.6285648345947266,
        -0.4154638946056366,
        0.5774601697921753,
        -0.43140095472335815,
        -1.5838946104049683,
        -1.0776605606079102,
        1.819983959197998,
        -0.6544548273086548,
        -0.22218751907348633,
        7.789803930791095e-6,
        -1.0779098272323608,
        1.9372047185897827,
        -0.09775905311107635,
        -0.9231151938438416,
        0.39697855710983276,
        -0.7987909317016602,
        0.022696631029248238,
        -1.46247635268031e-39,
        -1.1887190341949463,
        0.31673726439476013,
        -1.181602120399475,
        -0.22262614965438843,
        -0.14181499183177948,
        -1.9312481880187988,
        -0.7174484133720398,
        -0.09506548941135406,
        -0.6369706392288208,
        -0.9083997011184692,
        -0.9605937004089355,
        -1.0770400762557983,
        -2227.482666015625,
        -0.9623399376869202,
        0.45733368396759033,
        0.6388351321220398,
        1.6225996017456055,
        -0.6820763349533081,
        -1.8199838399887085,
        1.9320911169052124,
        -0.7867400050163269,
        -1.0546916723251343,
        -0.8094325661659241,
        0.8397257328033447,
        2.0896666049957275,
        1.9372047185897827,
        -2.043243646621704,
        -2.043243646621704,
        -0.13767516613006592,
        0.3954979181289673,
        -0.7908729314804077,
        0.07715469598770142,
        -0.16406592726707458,
        -0.9536037445068359,
        0.7138767242431641,
        0.13001734018325806,
        -0.5366030931472778,
        0.11500827968120575,
        -1.8499364852905273,
        0.23359374701976776,
        -2119.189208984375,
        -0.7867399454116821,
        -0.014378334395587444,
        0.8397257328033447,
        -0.0,
        -0.768511176109314,
        -0.2419355809688568,
        0.23359373211860657,
        0.6085425019264221,
        0.7064889669418335,
        -0.0,
        0.0,
        -0.16406592726707458,
        -0.48281213641166687,
        -0.19146232306957245,
        1.0793150663375854,
    ];
    let logits = Tensor::from_vec(&[4, 32], x.to_vec(), Format::F32).unwrap();
    let targets = [5, 5, 5, 5];
    let r = Policy::new(Format::F32, Format::F32, Format::F32);
    let c = vocabulary_parallel_bf16(&r);
    let run = |p: &Policy| cross_entropy_backward(&logits, &targets, 1.0, p).unwrap();
    let d = frob(run(&r).values(), run(&c).values());
    let [g, p] = [Confidence::Guaranteed, DELTA]
        .map(|conf| cross_entropy_grad_threshold(&logits, &targets, 1.0, &r, &c, conf).unwrap());
    assert_within(
        "cross-entropy gradient",
        (d, g.abs_frobenius, p.abs_frobenius),
    );
}

/// A constant row with eps = 0: the exact normalization is 0/0. One-pass LayerNorm with a
/// BF16 accumulator computes a variance of rounding errors alone, so both sides' outputs are
/// finite and differ by 0.07 or more — and the threshold was priced NaN, which a comparison
/// takes as a pass (found by a probe of the fast pricing against the walk, 2026-12-08). Now
/// refused with `NoFiniteBound`, under every pricing and confidence; with eps > 0 the same
/// rows are judged as before.
#[test]
fn constant_rows_with_zero_eps_are_refused_not_priced_nan() {
    let k = 1024;
    let r = Policy::new(Format::F32, Format::BF16, Format::F16).with_order(Order::pairwise(8));
    let c = r.clone().with_order(Order::blocked(16));
    let x = Tensor::rounded(&[2, k], vec![1.7; 2 * k], Format::F32, Overflow::Saturating).unwrap();
    let w = Tensor::rounded(&[k], vec![1.0; k], Format::F32, Overflow::Saturating).unwrap();
    let b = Tensor::zeros(&[k], Format::F32);
    let (yr, _) = layer_norm(&x, &w, &b, 0.0, Variance::OnePass, &r).unwrap();
    let (yc, _) = layer_norm(&x, &w, &b, 0.0, Variance::OnePass, &c).unwrap();
    let finite = yr.values().iter().chain(yc.values()).all(|v| v.is_finite());
    assert!(finite && frob(yr.values(), yc.values()) > 0.05);
    let side = |p| NormSide {
        op: NormOp::LayerNorm(Variance::OnePass),
        policy: p,
    };
    for eps in [0.0, 1e-5] {
        let data = NormData {
            x: &x,
            weight: &w,
            bias: Some(&b),
            eps,
        };
        for conf in [Confidence::Guaranteed, DELTA] {
            for pricing in [Pricing::Walk, Pricing::Fast, Pricing::Auto] {
                let t = norm_threshold_priced(&data, side(&r), side(&c), conf, pricing);
                match t {
                    Err(Error::NoFiniteBound { reason, .. }) if eps == 0.0 => {
                        assert!(reason.contains("0/0"), "{reason}")
                    }
                    // eps > 0: the one-pass variance of these rows may cancel to nothing,
                    // refused as before (its own reason), or priced finite.
                    Err(Error::NoFiniteBound { reason, .. }) => {
                        assert!(reason.contains("two-pass"), "{reason}")
                    }
                    Ok(t) => assert!(eps > 0.0 && t.abs_frobenius.is_finite(), "{t:?}"),
                    Err(e) => panic!("{eps} {conf:?} {pricing:?}: {e}"),
                }
            }
        }
    }
}
