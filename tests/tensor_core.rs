//! Tensor-core orders and orders of unknown kernel: the emulation against an independent
//! implementation of the documented model on exact big-integer arithmetic, the guaranteed
//! bound against the exact error on adversarial data, families priced for every member, and
//! the text grammar.

mod common;

use common::{spec, Dy};
use num_bigint::BigInt;
use num_traits::{Signed, ToPrimitive, Zero};
use proptest::prelude::*;
use ttrace::bounds::reduction_error;
use ttrace::{
    dot, AccRounding, Accumulation, Combine, Error, Format, Order, Overflow, Products,
    TensorCoreSum,
};

// ------------------------------------------------------------ independent reference model
// Written from the documented model (papers/formats-and-orders.md §5.1) on exact dyadics.

/// floor(log2 |x|) of a non-zero finite f64, from its bits.
fn exponent(x: f64) -> i32 {
    let d = Dy::from_f64(x.abs());
    d.e + d.m.bits() as i32 - 1
}

fn dy_exponent(d: &Dy) -> Option<i32> {
    if d.m.is_zero() {
        None
    } else {
        Some(d.e + d.m.abs().bits() as i32 - 1)
    }
}

/// d truncated toward zero to a multiple of 2^qe.
fn trunc_to(d: &Dy, qe: i32) -> Dy {
    if d.e >= qe {
        return d.clone();
    }
    let sh = (qe - d.e) as usize;
    let mag = d.m.abs() >> sh;
    let m = if d.m.is_negative() { -mag } else { mag };
    Dy { m, e: qe }
}

/// d rounded to `p` significant bits (toward zero or to nearest even), spacing at least
/// 2^min_e.
fn round_bits(d: &Dy, p: u32, nearest: bool, min_e: i32) -> Dy {
    let Some(top) = dy_exponent(d) else {
        return Dy::zero();
    };
    let qe = (top - p as i32 + 1).max(min_e);
    if d.e >= qe {
        return d.clone();
    }
    let sh = (qe - d.e) as usize;
    let mag = d.m.abs();
    let mut q = &mag >> sh;
    if nearest {
        let rem = &mag - (&q << sh);
        let half = BigInt::from(1) << (sh - 1);
        let odd = (&q % 2u32) == BigInt::from(1);
        if rem > half || (rem == half && odd) {
            q += 1;
        }
    }
    Dy {
        m: if d.m.is_negative() { -q } else { q },
        e: qe,
    }
}

fn to_f64(d: &Dy) -> f64 {
    if d.m.is_zero() {
        return 0.0;
    }
    common::ldexp(d.m.to_f64().unwrap(), d.e)
}

/// The model on exact arithmetic: x, y the factors (alignment e_x + e_y).
fn reference_tc(x: &[f64], y: &[f64], tc: &TensorCoreSum) -> f64 {
    let n = x.len();
    let chunk = tc.promote.unwrap_or(n).max(1);
    let mut register: Option<f64> = None;
    for start in (0..n).step_by(chunk) {
        let end = (start + chunk).min(n);
        let mut c = Dy::zero();
        for b in (start..end).step_by(tc.block) {
            let e_b = (b + tc.block).min(end);
            let mut e = dy_exponent(&c);
            for i in b..e_b {
                if x[i] != 0.0 && y[i] != 0.0 {
                    let a = exponent(x[i]) + exponent(y[i]);
                    e = Some(e.map_or(a, |v: i32| v.max(a)));
                }
            }
            let Some(e) = e else { continue };
            let qe = e - tc.align_bits as i32;
            let mut s = trunc_to(&c, qe);
            for i in b..e_b {
                let t = Dy::from_f64(x[i]).mul(&Dy::from_f64(y[i]));
                s = s.add(&trunc_to(&t, qe));
            }
            c = round_bits(&s, tc.acc_bits, tc.rounding == AccRounding::Nearest, -149);
        }
        let cv = to_f64(&c);
        register = Some(match register {
            None => Dy::from_f64(cv).round(spec("f32"), false),
            Some(r) => Dy::from_f64(r)
                .add(&Dy::from_f64(cv))
                .round(spec("f32"), false),
        });
    }
    register.unwrap_or(0.0)
}

// ------------------------------------------------------------------------- strategies

fn tensor_core() -> impl Strategy<Value = TensorCoreSum> {
    (
        1usize..40,
        3u32..22,
        3u32..24,
        any::<bool>(),
        prop::option::of(1usize..90),
    )
        .prop_map(|(block, align_bits, acc_bits, rn, promote)| TensorCoreSum {
            block,
            align_bits,
            acc_bits,
            rounding: if rn {
                AccRounding::Nearest
            } else {
                AccRounding::Truncate
            },
            promote,
        })
}

/// Values of `f` from structured families: Gaussian-like, one sign, wide magnitudes, zeros,
/// repeated values, outliers.
fn values(f: Format, n: usize) -> impl Strategy<Value = Vec<f64>> {
    let one = prop_oneof![
        (-4.0f64..4.0),
        (0.0f64..3.0),
        (-20.0f64..20.0).prop_map(|e| 2f64.powf(e) * if e as i64 % 2 == 0 { 1.0 } else { -1.0 }),
        Just(0.0),
        Just(1.0),
        (-1.0f64..1.0).prop_map(|v| v * 300.0),
    ];
    prop::collection::vec(one, n).prop_map(move |v| {
        v.into_iter()
            .map(|x| f.round(x, Overflow::Saturating))
            .collect()
    })
}

fn narrow_format() -> impl Strategy<Value = Format> {
    prop::sample::select(vec![Format::E4M3, Format::E5M2, Format::BF16, Format::F16])
}

fn pair() -> impl Strategy<Value = (Format, Vec<f64>, Vec<f64>)> {
    (narrow_format(), 0usize..300).prop_flat_map(|(f, n)| (Just(f), values(f, n), values(f, n)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The emulation is the documented model, bit for bit (an implementation on big integers
    /// that shares no code with the crate's).
    #[test]
    fn the_emulation_is_the_documented_model(tc in tensor_core(), (f, x, y) in pair()) {
        let acc = Accumulation::new(f, Format::F32, Order::TensorCore(tc));
        let got = dot(&x, &y, &acc).unwrap();
        let want = reference_tc(&x, &y, &tc);
        prop_assert!(got == want || (got.is_nan() && want.is_nan()), "{tc:?}: {got:e} vs {want:e}");
    }

    /// The guaranteed bound holds against the exact product sum, for one pass, for a split
    /// whose parts run tensor cores, and for a family (every member).
    #[test]
    fn the_guaranteed_bound_holds(tc in tensor_core(), (f, x, y) in pair(), parts in 1usize..5) {
        let exact: f64 = common::exact(
            &x.iter().zip(&y).map(|(a, b)| a * b).collect::<Vec<f64>>(),
        ).round(spec("f64"), false);
        let terms: Vec<f64> = x.iter().zip(&y).map(|(a, b)| a * b).collect();
        let split = Order::SplitK {
            parts,
            inner: Box::new(Order::TensorCore(tc)),
            partial: Format::F32,
            combine: Combine::Tree,
        };
        let family = Order::AnyOf(vec![Order::TensorCore(tc), split.clone()]);
        for order in [Order::TensorCore(tc), split, family] {
            let acc = Accumulation::new(f, Format::F32, order.clone());
            let e = reduction_error(&terms, &acc, true).unwrap();
            let got = dot(&x, &y, &acc).unwrap();
            let err = (got - exact).abs();
            prop_assert!(err <= e.guaranteed, "{order}: error {err:e} above {:e}", e.guaranteed);
        }
    }

    /// A family's statistics contain every member's determined error: mean ± tie_bound.
    #[test]
    fn a_family_covers_each_member(tc in tensor_core(), (f, x, y) in pair()) {
        let terms: Vec<f64> = x.iter().zip(&y).map(|(a, b)| a * b).collect();
        let members = vec![
            Order::TensorCore(tc),
            Order::SplitK { parts: 2, inner: Box::new(Order::TensorCore(tc)), partial: Format::F32, combine: Combine::Sequential },
            Order::SplitK { parts: 3, inner: Box::new(Order::TensorCore(tc)), partial: Format::F32, combine: Combine::Tree },
        ];
        let fam = reduction_error(&terms, &Accumulation::new(f, Format::F32, Order::AnyOf(members.clone())), false).unwrap();
        for m in members {
            let e = reduction_error(&terms, &Accumulation::new(f, Format::F32, m.clone()), false).unwrap();
            prop_assert!((e.mean - fam.mean).abs() <= fam.tie_bound * (1.0 + 1e-12) + 1e-300, "{m}");
            prop_assert!(e.guaranteed <= fam.guaranteed);
        }
    }
}

/// Worst cases for truncation: long same-sign sums where the accumulator dominates every
/// block, products far below the block's largest, alternating huge and tiny terms, and sums
/// that cancel to zero. The bound holds and is not vacuous (below Σ|t| on same-sign data).
#[test]
fn the_guaranteed_bound_holds_on_adversarial_sums() {
    let tc = TensorCoreSum::hopper_fp8_fast();
    let e4m3 = |v: f64| Format::E4M3.round(v, Overflow::Saturating);
    let cases: Vec<(Vec<f64>, Vec<f64>)> = vec![
        // 16384 positive products: the accumulator grows to 2^14 times each term.
        (vec![e4m3(0.9375); 16384], vec![e4m3(1.125); 16384]),
        // One large product per block, the rest 2^-12 below it.
        (
            (0..4096)
                .map(|i| if i % 32 == 0 { 448.0 } else { e4m3(0.1) })
                .collect(),
            vec![1.0; 4096],
        ),
        // Alternating magnitudes and signs.
        (
            (0..4096)
                .map(|i| if i % 2 == 0 { 448.0 } else { -0.015625 })
                .collect(),
            (0..4096)
                .map(|i| if i % 3 == 0 { 1.0 } else { 0.75 })
                .collect(),
        ),
        // Exact cancellation: + then − the same products.
        (
            (0..2048)
                .map(|i| {
                    if i < 1024 {
                        e4m3(1.0 + (i % 7) as f64 / 8.0)
                    } else {
                        -e4m3(1.0 + ((i - 1024) % 7) as f64 / 8.0)
                    }
                })
                .collect(),
            vec![1.0; 2048],
        ),
    ];
    for promote in [None, Some(128)] {
        let tc = TensorCoreSum { promote, ..tc };
        for (x, y) in &cases {
            let terms: Vec<f64> = x.iter().zip(y).map(|(a, b)| a * b).collect();
            let acc = Accumulation::new(Format::E4M3, Format::F32, Order::TensorCore(tc));
            let e = reduction_error(&terms, &acc, true).unwrap();
            let got = dot(x, y, &acc).unwrap();
            let exact: f64 = terms.iter().sum(); // exact: E4M3 products, f64 partial sums
            let abs: f64 = terms.iter().map(|t| t.abs()).sum();
            assert!(
                (got - exact).abs() <= e.guaranteed,
                "{promote:?}: {} > {}",
                (got - exact).abs(),
                e.guaranteed
            );
            assert!(
                e.guaranteed < abs,
                "{promote:?}: vacuous bound {} vs {abs}",
                e.guaranteed
            );
            // The determined error is the error.
            assert!(((got - exact) - e.mean).abs() <= e.tie_bound + 1e-12 * abs);
        }
    }
    // Truncation is one-signed: 16384 equal positive products lose a visible fraction, which
    // promotion every 128 terms removes almost entirely.
    let (x, y) = &cases[0];
    let fast = dot(
        x,
        y,
        &Accumulation::new(Format::E4M3, Format::F32, Order::TensorCore(tc)),
    )
    .unwrap();
    let precise = dot(
        x,
        y,
        &Accumulation::new(
            Format::E4M3,
            Format::F32,
            Order::TensorCore(TensorCoreSum::hopper_fp8()),
        ),
    )
    .unwrap();
    let exact = 0.9375 * 1.125 * 16384.0;
    assert!(
        fast < exact && (exact - fast) / exact > 1e-4,
        "{fast} {exact}"
    );
    assert!((exact - precise).abs() / exact < 1e-6, "{precise} {exact}");
}

/// An accumulator of very few bits over many blocks: the step-by-step bound alone grows by
/// (1 + 2^(1−P)) per block and would pass the format's range long before the sum does
/// (CI found 300 F16 products, P = 3, block 1, refused as an overflow). The bound holds
/// against the exact sum, no overflow is claimed for a sum far from the range, and when
/// truncating the bound stays within what magnitudes allow (|c − S| ≤ |c| + |S| ≤ 2Σ|t|).
#[test]
fn a_narrow_accumulator_over_many_blocks_is_priced() {
    let f16 = |v: f64| Format::F16.round(v, Overflow::Saturating);
    let x: Vec<f64> = (0..300)
        .map(|i| f16(((i * 37 % 101) as f64 - 50.0) * 13.25 + 0.5))
        .collect();
    let y: Vec<f64> = (0..300)
        .map(|i| f16(((i * 53 % 89) as f64 - 44.0) * 7.125 - 0.25))
        .collect();
    let terms: Vec<f64> = x.iter().zip(&y).map(|(a, b)| a * b).collect();
    let abs: f64 = terms.iter().map(|t| t.abs()).sum();
    let exact: f64 = common::exact(&terms).round(spec("f64"), false);
    for rounding in [AccRounding::Truncate, AccRounding::Nearest] {
        for block in [1, 2, 7] {
            let tc = TensorCoreSum {
                block,
                align_bits: 3,
                acc_bits: 3,
                rounding,
                promote: None,
            };
            let acc = Accumulation::new(Format::F16, Format::F32, Order::TensorCore(tc));
            let e = reduction_error(&terms, &acc, true).unwrap();
            let got = dot(&x, &y, &acc).unwrap();
            assert_eq!(got, reference_tc(&x, &y, &tc), "{tc:?}");
            assert!((got - exact).abs() <= e.guaranteed, "{tc:?}");
            // Truncation never grows |c| beyond Σ|t|; rounding to nearest may (by 2^−P per
            // block at worst), so there only validity and the absence of a false overflow.
            if rounding == AccRounding::Truncate {
                assert!(
                    e.guaranteed <= 2.0 * abs,
                    "{tc:?}: {:e} vs Σ|t| {abs:e}",
                    e.guaranteed
                );
            }
        }
    }
}

/// The text forms read back, presets expand to what they name, and bad text is refused with
/// the reason.
#[test]
fn tensor_core_and_family_text() {
    for text in [
        "tc:32:13:14:rz",
        "tc:32:13:14:rz:promote=128",
        "tc:16:20:24:rn",
        "any(sequential|pairwise:8|splitk:4:f32:tree)",
        "any(tc:32:13:14:rz|splitk:2:f32:seq:inner=tc:32:13:14:rz)",
        "splitk:2:bf16:seq:inner=any(sequential|blocked:32)",
    ] {
        let o: Order = text.parse().unwrap();
        assert_eq!(o.to_string(), text);
        let p: ttrace::Policy = format!("in=e4m3,acc=f32,out=bf16,order={text}")
            .parse()
            .unwrap();
        assert_eq!(p.to_string().parse::<ttrace::Policy>().unwrap(), p);
    }
    assert_eq!(
        "hopper-fp8".parse::<Order>().unwrap(),
        Order::hopper_fp8_gemm(false)
    );
    assert_eq!(
        "any:bf16".parse::<Order>().unwrap(),
        Order::unknown_kernel(Format::BF16)
    );
    match Order::hopper_fp8_gemm(true) {
        Order::AnyOf(m) => {
            assert_eq!(m[0], Order::TensorCore(TensorCoreSum::hopper_fp8_fast()));
            assert_eq!(m.len(), 8);
        }
        o => panic!("{o}"),
    }
    for (bad, name) in [
        ("tc:0:13:14:rz", "block"),
        ("tc:32:0:14:rz", "align"),
        ("tc:32:13:1:rz", "acc_bits"),
        ("tc:32:13:14:rz:promote=0", "promote"),
        ("tc:32:13:14:rq", "order"),
        ("tc:32:13", "order"),
        ("any()", "order"),
        ("any(sequential|any(kahan))", "order"),
        ("any(sequential", "order"),
    ] {
        match bad.parse::<Order>() {
            Err(Error::InvalidParameter { name: n, .. }) => assert_eq!(n, name, "{bad}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
    // Products of F32 inputs are not exact in f64: a tensor core refuses them.
    let acc = Accumulation::new(Format::F64, Format::F32, "tc:32:13:14:rz".parse().unwrap());
    assert!(matches!(
        dot(&[1.0], &[1.0], &acc),
        Err(Error::InvalidParameter { name: "order", .. })
    ));
    // Depth-based bounds refuse a tensor core (its error is not relative to each term).
    let acc = Accumulation::new(Format::E4M3, Format::F32, "tc:32:13:14:rz".parse().unwrap());
    assert!(matches!(
        acc.dot_depths(10),
        Err(Error::InvalidParameter { name: "order", .. })
    ));
}

/// A family's depths are at least every member's, format by format.
#[test]
fn family_depths_cover_every_member() {
    let members = vec![
        Order::Sequential,
        Order::pairwise(1),
        Order::split_k(4, Format::BF16, Combine::Tree),
    ];
    let fam = Accumulation::new(Format::BF16, Format::F32, Order::AnyOf(members.clone()));
    let d = fam.sum_depths(100).unwrap();
    for m in members {
        let dm = Accumulation::new(Format::BF16, Format::F32, m)
            .sum_depths(100)
            .unwrap();
        for (a, b) in d.iter().zip(&dm) {
            for f in Format::ALL {
                assert!(a.count(f) >= b.count(f));
            }
        }
    }
    let _ = Products::Exact;
}

/// Two runs of a kernel of unknown order are not the same execution: a policy with a family
/// on both sides prices the difference between any two members (cuBLAS picks the kernel by
/// shape: a column shard or a batch half of a product runs another one).
#[test]
fn two_runs_of_an_unknown_kernel_may_differ() {
    use ttrace::bounds::{
        matmul_threshold, norm_threshold, Confidence, NormData, NormOp, NormSide,
    };
    use ttrace::{Policy, Tensor};
    let a = Tensor::rounded(
        &[6, 512],
        (0..6 * 512)
            .map(|i| ((i * 7919) % 1009) as f64 / 500.0 - 1.0)
            .collect(),
        Format::F32,
        Overflow::Saturating,
    )
    .unwrap();
    let b = Tensor::rounded(
        &[512, 5],
        (0..512 * 5)
            .map(|i| ((i * 104729) % 1013) as f64 / 700.0 - 0.6)
            .collect(),
        Format::F32,
        Overflow::Saturating,
    )
    .unwrap();
    let any: Policy = "in=f32,acc=f32,out=f32,order=any".parse().unwrap();
    let t = matmul_threshold(
        &a,
        &b,
        None,
        &any,
        &any,
        Confidence::default_probabilistic(),
    )
    .unwrap();
    assert!(!t.identical && t.abs_frobenius > 0.0);
    let members = match Order::unknown_kernel(Format::F32) {
        Order::AnyOf(m) => m,
        o => panic!("{o}"),
    };
    let outputs: Vec<Tensor> = members
        .iter()
        .map(|m| ttrace::engine::matmul(&a, &b, &any.clone().with_order(m.clone())).unwrap())
        .collect();
    let differing = outputs
        .iter()
        .filter(|o| o.values() != outputs[0].values())
        .count();
    assert!(
        differing > 0,
        "the members must differ for this test to mean anything"
    );
    for (i, o) in outputs.iter().enumerate() {
        for p in &outputs {
            assert!(
                t.check(p, o).passed,
                "member {} against another",
                members[i]
            );
        }
    }
    // The same for a norm: one kernel against itself is bit-identical, a family is not.
    let x = Tensor::rounded(
        &[4, 256],
        (0..1024).map(|i| (i as f64 * 0.37).sin() * 3.0).collect(),
        Format::BF16,
        Overflow::Saturating,
    )
    .unwrap();
    let w = Tensor::rounded(&[256], vec![1.0; 256], Format::BF16, Overflow::Saturating).unwrap();
    let seq: Policy = "in=bf16,acc=f32,out=bf16".parse().unwrap();
    let fam: Policy = "in=bf16,acc=f32,out=bf16,order=any".parse().unwrap();
    let data = NormData {
        x: &x,
        weight: &w,
        bias: None,
        eps: 1e-6,
    };
    let side = |policy| NormSide {
        op: NormOp::RmsNorm,
        policy,
    };
    let p = Confidence::default_probabilistic();
    let same = norm_threshold(&data, side(&seq), side(&seq), p).unwrap();
    let unknown = norm_threshold(&data, side(&fam), side(&fam), p).unwrap();
    assert!(same.identical && !unknown.identical && unknown.abs_frobenius > 0.0);
}
