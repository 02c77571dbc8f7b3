//! The detectors' tests: power and false alarms on synthetic pairs, the kernel against the
//! plain loop, the sparse test's second pass.
#![cfg(test)]

use super::*;
use crate::format::Overflow;
use crate::random::SplitMix64;

const EPS: f64 = 1.0 / 128.0;

fn gaussian(n: usize, seed: u64) -> Vec<f64> {
    let mut g = SplitMix64::for_name("detect", seed);
    (0..n).map(|_| g.normal()).collect()
}

/// The tests on F64 tensors with the default settings.
fn run(shape: &[usize], r: &[f64], c: &[f64]) -> Vec<Finding> {
    detect(shape, r, c, Format::F64, EPS, Detection::default())
}

fn get(f: &[Finding], d: Detector) -> Option<Finding> {
    f.iter().copied().find(|x| x.detector == d)
}

/// Null draws: element noise plus row clusters (a per-row scale, as a norm's denominator
/// makes) plus column clusters (a per-column offset, as an attention sink makes), all with
/// random signs. At a per-test δ of 5% the rate of firing must stay below it.
#[test]
fn clustered_round_off_keeps_the_false_alarm_rate() {
    let (rows, cols) = (48, 40);
    let cfg = Detection {
        delta: 0.05 / (1.0 - NORM_SHARE) * SHARED_BY,
        ..Detection::default()
    };
    assert!((cfg.each() - 0.05).abs() < 1e-12);
    let r = gaussian(rows * cols, 1);
    let t = symmetric_critical(cfg.each());
    let (mut fired_scale, mut fired_bias, mut naive) = (0, 0, 0);
    for k in 0..400 {
        let z = gaussian(rows * cols + rows + cols, 100 + k);
        let c: Vec<f64> = (0..rows * cols)
            .map(|i| {
                let (t, j) = (i / cols, i % cols);
                let row = 3.0 * z[rows * cols + t] * r[i];
                let col = 2.0 * z[rows * cols + rows + j];
                r[i] + 1e-4 * (z[i] + row + col)
            })
            .collect();
        let f = detect(&[rows, cols], &r, &c, Format::F64, EPS, cfg);
        fired_scale += get(&f, Detector::Scale).unwrap().fired as usize;
        fired_bias += get(&f, Detector::Bias).unwrap().fired as usize;
        // Every element its own cluster: Σ D / √(Σ D²).
        let (l, v) = r.iter().zip(&c).fold((0.0, 0.0), |(l, v), (a, b)| {
            (l + (b - a), v + (b - a) * (b - a))
        });
        naive += (l.abs() > t * f64::sqrt(v)) as usize;
    }
    // Binomial(400, 0.05): mean 20, 4 standard deviations above is 37.
    assert!(
        fired_scale <= 37 && fired_bias <= 37,
        "{fired_scale} {fired_bias}"
    );
    // Treating every element as its own cluster does not hold the rate on these data.
    assert!(naive > 100, "{naive}");
}

#[test]
fn a_scale_error_well_below_the_norm_is_found_and_measured() {
    let (rows, cols) = (512, 256);
    let r = gaussian(rows * cols, 2);
    let noise = gaussian(rows * cols, 3);
    // Round-off of about 1 ε per element; a scale of 0.1 ε.
    let rho = 0.1 * EPS;
    let c: Vec<f64> = r
        .iter()
        .zip(&noise)
        .map(|(a, z)| a * (1.0 + rho) + EPS * z)
        .collect();
    let f = run(&[rows, cols], &r, &c);
    let s = get(&f, Detector::Scale).unwrap();
    assert!(s.fired, "{s:?}");
    assert!((s.estimate - 0.1).abs() < 0.02, "{s:?}");
    // Without the scale it stays quiet.
    let c0: Vec<f64> = r.iter().zip(&noise).map(|(a, z)| a + EPS * z).collect();
    let f = run(&[rows, cols], &r, &c0);
    assert!(f.iter().all(|x| !x.fired), "{f:?}");
}

/// Two runs of the same computation, each with round-off of its own (c = t + n_c,
/// r = t + n_r, exchangeable): ⟨D, r⟩ = ⟨c, r⟩ − ‖r‖² has mean −E‖n_r‖², a scale of
/// −(relative noise)² that √N times its noise makes visible on large noisy tensors (FP8
/// gradients of 10⁴ elements, BF16 tensors of millions). Weighted by the midpoint
/// m = (r + c)/2, ⟨D, m⟩ = (‖c‖² − ‖r‖²)/2 changes sign under the exchange.
#[test]
fn a_reference_with_round_off_of_its_own_does_not_look_like_a_scale() {
    let (rows, cols) = (256, 512);
    let t = gaussian(rows * cols, 20);
    let sigma = 12.0 * EPS; // FP8 gradients a few layers down: ~12 ε of BF16
                            // t·(1 + ρ)·(1 + σz), z standard normal per element.
    let noisy = |seed: u64, rho: f64| -> Vec<f64> {
        let z = gaussian(rows * cols, seed);
        t.iter()
            .zip(&z)
            .map(|(a, z)| a * (1.0 + rho) * (1.0 + sigma * z))
            .collect()
    };
    let mut fired = 0;
    let mut old_ratio = f64::INFINITY;
    for seed in 0..8 {
        let (r, c) = (noisy(100 + seed, 0.0), noisy(200 + seed, 0.0));
        let s = get(&run(&[rows, cols], &r, &c), Detector::Scale).unwrap();
        fired += usize::from(s.fired);
        // The reference-weighted estimate, its bias and its noise (the oracle):
        // −σ² against √(2·E r⁴/(E r²)²/N)·σ ≈ √(6/N)·σ.
        let (dr, rr): (f64, f64) = r
            .iter()
            .zip(&c)
            .fold((0.0, 0.0), |(x, y), (a, b)| (x + (b - a) * a, y + a * a));
        let noise = (6.0 / (rows * cols) as f64).sqrt() * sigma;
        old_ratio = old_ratio.min((dr / rr).abs() / (5.72 * noise));
        assert!(s.estimate.abs() < 4.0 * noise / EPS, "{s:?}");
    }
    // The reference weights would have fired on every draw.
    assert!(old_ratio > 1.5, "{old_ratio}");
    assert_eq!(fired, 0);
    // A scale of 1 ε on top (twice the threshold, 0.48 ε here) is still found.
    let (r, c) = (noisy(300, 0.0), noisy(301, EPS));
    let s = get(&run(&[rows, cols], &r, &c), Detector::Scale).unwrap();
    assert!(s.fired && (s.estimate - 1.0).abs() < 0.15, "{s:?}");
}

#[test]
fn a_bias_is_found_and_a_vector_has_no_systematic_test() {
    let (rows, cols) = (256, 128);
    let r = gaussian(rows * cols, 4);
    let noise = gaussian(rows * cols, 5);
    let c: Vec<f64> = r
        .iter()
        .zip(&noise)
        .map(|(a, z)| a + EPS * (z + 0.05))
        .collect();
    let f = run(&[rows, cols], &r, &c);
    let b = get(&f, Detector::Bias).unwrap();
    assert!(b.fired && (b.estimate - 0.05).abs() < 0.01, "{b:?}");
    // One row: every element may share one cluster, so neither test applies.
    let f = run(&[rows * cols], &r, &c);
    assert!(get(&f, Detector::Scale).is_none() && get(&f, Detector::Bias).is_none());
}

#[test]
fn single_corrupted_elements_are_found_where_they_are() {
    let (rows, cols) = (1024, 1024);
    let r = gaussian(rows * cols, 6);
    let noise = gaussian(rows * cols, 7);
    let mut c: Vec<f64> = r
        .iter()
        .zip(&noise)
        .map(|(a, z)| a + 0.01 * EPS * z * a.abs().max(1.0))
        .collect();
    let f = run(&[rows, cols], &r, &c);
    assert!(!get(&f, Detector::Sparse).unwrap().fired);
    // Four elements off by 8 ε of their own magnitude (magnitude ≥ 1 here).
    let hit = [5usize, 77_777, 500_000, 1_048_575];
    for &i in &hit {
        c[i] = r[i] + 8.0 * EPS * r[i].abs().max(1.0);
    }
    let f = run(&[rows, cols], &r, &c);
    let s = get(&f, Detector::Sparse).unwrap();
    assert!(s.fired && s.count == 4, "{s:?}");
    assert!(hit.contains(&s.at.unwrap()));
    // The norm would not see it: 4 elements of a million.
    let dn: f64 = r
        .iter()
        .zip(&c)
        .map(|(a, b)| (b - a) * (b - a))
        .sum::<f64>()
        .sqrt();
    let rn: f64 = r.iter().map(|a| a * a).sum::<f64>().sqrt();
    assert!(dn / rn < 0.1 * EPS);
}

#[test]
fn one_rounding_flip_per_element_is_always_allowed() {
    // BF16 tensors differing by one ulp in a third of their elements, nothing else.
    let n = 64 * 64;
    let r: Vec<f64> = gaussian(n, 8)
        .iter()
        .map(|&x| Format::BF16.round(x, Overflow::NonSaturating))
        .collect();
    let c: Vec<f64> = r
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let ulp = Format::BF16.ulp(x).unwrap();
            if i % 3 == 0 {
                Format::BF16.round(x + ulp, Overflow::NonSaturating)
            } else {
                x
            }
        })
        .collect();
    let f = detect(&[64, 64], &r, &c, Format::BF16, EPS, Detection::default());
    let s = get(&f, Detector::Sparse).unwrap();
    assert!(!s.fired && s.estimate == 0.0, "{s:?}");
    // The same values stored in FP32 are judged on the BF16 grid they lie on.
    let f = detect(&[64, 64], &r, &c, Format::F32, EPS, Detection::default());
    assert!(!get(&f, Detector::Sparse).unwrap().fired);
}

#[test]
fn pieces_and_a_second_read_give_the_same_findings() {
    let (rows, cols) = (37, 53);
    let r = gaussian(rows * cols, 9);
    let mut c: Vec<f64> = r.iter().map(|a| a * (1.0 + 1e-3)).collect();
    c[100] += 1.0;
    let whole = run(&[rows, cols], &r, &c);
    let mut d = Detect::new(&[rows, cols], Format::F64, Detection::default());
    for (a, b) in r.chunks(17).zip(c.chunks(17)) {
        d.feed(a, b);
    }
    let mut reads = 0;
    let pieces = d.finish(EPS, &mut |s, e, f| {
        reads += 1;
        f(&r[s..e], &c[s..e])
    });
    assert_eq!(whole, pieces);
    // Only the rows the first pass could not settle were read again.
    assert!(reads >= 1 && reads < rows, "{reads}");
}

/// Random rows with the cases the lanes must get right: lengths off the lane count, rows
/// whose reference is zero, equal pairs, subnormal and huge values.
fn awkward_rows(seed: u64, rows: usize, cols: usize, f: Format) -> (Vec<f64>, Vec<f64>) {
    let mut g = SplitMix64::for_name("lane-kernel", seed);
    let round = |x: f64| f.round(x, Overflow::Saturating);
    let mut r = Vec::with_capacity(rows * cols);
    let mut c = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        let scale = [1.0, 1e-30, 1e30, 0.0, 2f64.powi(-140)][i % 5];
        for _ in 0..cols {
            let a = round(scale * (2.0 * g.uniform() - 1.0));
            let b = match g.below(4) {
                0 => a,
                1 => round(a * (1.0 + 1e-2 * (g.uniform() - 0.5))),
                2 => round(a + scale * 1e-3 * (g.uniform() - 0.5)),
                _ => round(a + 1e-3 * (g.uniform() - 0.5)),
            };
            r.push(a);
            c.push(b);
        }
    }
    (r, c)
}

/// A row equal to its reference bit for bit takes the reference's sums only, and gets what
/// the general loop gives, bit for bit, in its sums and in the column sums it adds to: in
/// its AVX2 form (where the CPU has it) and its portable one; at every scale of the zoo of
/// rows (zero rows, subnormal BF16, 1e30), with signed zeros, with a tail shorter than the
/// lanes, and beside a row that differs in one element's sign of zero (the general loop).
#[test]
fn an_equal_row_takes_the_general_sums() {
    fn cols_of<'a>(v: &'a mut [Vec<f64>], n: &'a mut [usize]) -> Columns<'a> {
        let [dr, d, r2, m2, q] = v else {
            unreachable!("five column sums")
        };
        // The sums of differences start at a value they keep (they add only zeros).
        dr[0] = 0.25;
        Columns {
            dr,
            d,
            r2,
            m2,
            n,
            q,
        }
    }
    for (seed, (rows, cols, f)) in [
        (1, 64, Format::F32),
        (5, 13, Format::BF16),
        (7, 3, Format::F16),
        (6, 37, Format::F64),
        (2, 1031, Format::BF16),
    ]
    .into_iter()
    .enumerate()
    {
        let (mut r, _) = awkward_rows(seed as u64, rows, cols, f);
        r[1] = -0.0;
        let mut signed = r.clone();
        signed[1] = 0.0;
        let k = Kernel {
            min_ulp: crate::format::pow2(f.emin()),
            frac: crate::format::pow2(1 - f.precision() as i32),
        };
        let bits = |s: RowSums| {
            [
                s.rr, s.mm, s.x, s.y, s.dada, s.dd, s.a4, s.q, s.qmax, s.emax, s.lq, s.ln, s.ms,
                s.m2d, s.m3, s.m3d,
            ]
            .map(f64::to_bits)
        };
        let columns = |n: usize| (vec![vec![0.0f64; n]; 5], vec![0usize; n]);
        for (row, (a, b)) in r.chunks(cols).zip(signed.chunks(cols)).enumerate() {
            let c = a.to_vec();
            let (mut general, mut gn) = columns(cols);
            let (mut fast, mut fast_n) = columns(cols);
            let (mut plain, mut plain_n) = columns(cols);
            let want = k.row_with(a, &c, Some(cols_of(&mut general, &mut gn)), false);
            let got = k.dispatch(a, &c, Some(cols_of(&mut fast, &mut fast_n)));
            let got_plain = k.row(a, &c, Some(cols_of(&mut plain, &mut plain_n)));
            let want = bits(want.unwrap());
            assert_eq!(bits(got.unwrap()), want, "{f:?} row {row}");
            assert_eq!(bits(got_plain.unwrap()), want, "{f:?} row {row}");
            let cbits = |v: &Vec<Vec<f64>>| -> Vec<Vec<u64>> {
                v.iter()
                    .map(|c| c.iter().map(|x| x.to_bits()).collect())
                    .collect()
            };
            assert_eq!(cbits(&fast), cbits(&general), "{f:?} row {row}: columns");
            assert_eq!(cbits(&plain), cbits(&general), "{f:?} row {row}: columns");
            assert_eq!((&fast_n, &plain_n), (&gn, &gn));
            // A row that differs only in the sign of a zero is not equal: the general loop.
            if row == 0 {
                let x = k.dispatch(a, b, None).unwrap();
                let y = k.row_with(a, b, None, false).unwrap();
                assert_eq!(bits(x), bits(y));
            }
        }
    }
}

/// The lane kernel (AVX2 where the CPU has it) adds what the per-element pass adds, up to
/// the order of the additions and the reciprocal (relative 1e-12), with its row maxima
/// upper bounds of the per-element ones; and its AVX2 and portable forms agree bit for bit.
#[test]
fn the_lane_kernel_matches_the_per_element_pass() {
    let close = |x: f64, y: f64, scale: f64| (x - y).abs() <= 1e-12 * scale.max(1e-300);
    for (seed, (rows, cols, f)) in [
        (8, 64, Format::F32),
        (5, 13, Format::BF16),
        (7, 3, Format::F16),
        (3, 1, Format::E4M3),
        (6, 37, Format::F64),
        (2, 1031, Format::BF16),
    ]
    .into_iter()
    .enumerate()
    {
        let (r, c) = awkward_rows(seed as u64, rows, cols, f);
        let mut fast = Detect::new(&[rows, cols], f, Detection::default());
        let mut plain = Detect::new(&[rows, cols], f, Detection::default());
        for (a, b) in r.chunks(cols).zip(c.chunks(cols)) {
            assert!(fast.row_pass_finite(a, b));
            plain.row_pass_plain(a, b);
            // Both forms of the kernel, on the same row, give the same bits.
            let k = Kernel {
                min_ulp: crate::format::pow2(f.emin()),
                frac: crate::format::pow2(1 - f.precision() as i32),
            };
            let bits = |s: RowSums| {
                [
                    s.rr, s.mm, s.x, s.y, s.dada, s.dd, s.a4, s.q, s.qmax, s.emax, s.lq, s.ln,
                    s.ms, s.m2d, s.m3, s.m3d,
                ]
                .map(f64::to_bits)
            };
            let (x, y) = (k.dispatch(a, b, None).unwrap(), k.row(a, b, None).unwrap());
            assert_eq!(bits(x), bits(y));
        }
        fast.cluster_rows();
        plain.cluster_rows();
        let pairs = [
            (fast.scale.sum, plain.scale.sum, plain.scale.rows.sqrt()),
            (fast.scale.rows, plain.scale.rows, plain.scale.rows),
            (
                fast.scale.elements,
                plain.scale.elements,
                plain.scale.elements,
            ),
            (fast.bias.sum, plain.bias.sum, plain.bias.rows.sqrt()),
            (fast.bias.rows, plain.bias.rows, plain.bias.rows),
            (fast.bias.elements, plain.bias.elements, plain.bias.elements),
            (fast.pure_rows, plain.pure_rows, plain.pure_rows),
            (fast.pure_elements, plain.pure_elements, plain.pure_elements),
            (fast.rr, plain.rr, plain.rr),
            (fast.mm, plain.mm, plain.mm),
        ];
        for (i, (x, y, scale)) in pairs.into_iter().enumerate() {
            assert!(close(x, y, scale), "{f:?} sum {i}: {x} against {y}");
        }
        assert_eq!((fast.n, fast.row_count), (plain.n, plain.row_count));
        assert_eq!(fast.large_n, plain.large_n);
        assert!(close(fast.large_q, plain.large_q, plain.large_q));
        assert_eq!(fast.col_n, plain.col_n);
        for j in 0..cols {
            for (x, y) in [
                (fast.col_dr[j], plain.col_dr[j]),
                (fast.col_d[j], plain.col_d[j]),
                (fast.col_r2[j], plain.col_r2[j]),
                (fast.col_m2[j], plain.col_m2[j]),
                (fast.col_q[j], plain.col_q[j]),
            ] {
                assert!(
                    close(x, y, x.abs().max(y.abs())),
                    "{f:?} column {j}: {x} against {y}"
                );
            }
        }
        for (u, v) in fast.rows.iter().zip(&plain.rows) {
            assert_eq!((u.n, u.zero), (v.n, v.zero));
            assert!(close(u.q, v.q, v.q) && close(u.qmax, v.qmax, v.qmax));
            assert!(
                u.emax >= v.emax && close(u.emax, v.emax, v.emax),
                "{u:?} {v:?}"
            );
        }
        assert_eq!(fast.on_grid, plain.on_grid);
    }
}

/// The tests are homogeneous: scaling a pair by 2^k (exact) leaves every finding the same,
/// bit for bit, while the sums stay in range; beyond it (an F64 tensor of values near
/// 1e±160 or 1e±300) a test is reported not applicable, never fired on a broken sum.
#[test]
fn findings_do_not_depend_on_magnitude_and_extremes_never_fire() {
    let (rows, cols) = (128, 96);
    let r = gaussian(rows * cols, 21);
    let z = gaussian(rows * cols, 22);
    // Round-off-like noise, and a real scale on top of it.
    let noise: Vec<f64> = r.iter().zip(&z).map(|(a, w)| a + 1e-12 * w).collect();
    let scaled: Vec<f64> = noise.iter().map(|b| b * (1.0 + 1e-9)).collect();
    for (c, fires) in [(&noise, false), (&scaled, true)] {
        let base = run(&[rows, cols], &r, c);
        assert_eq!(base.iter().any(|f| f.fired), fires, "{base:?}");
        for k in [-300, -150, -60, 60, 150, 300] {
            let m = 2f64.powi(k);
            let rk: Vec<f64> = r.iter().map(|a| a * m).collect();
            let ck: Vec<f64> = c.iter().map(|b| b * m).collect();
            let got = run(&[rows, cols], &rk, &ck);
            if k.abs() <= 60 {
                assert_eq!(got, base, "2^{k}");
            } else {
                for f in &got {
                    let same = base.iter().find(|g| g.detector == f.detector);
                    assert!(
                        !f.fired || same.is_some_and(|g| g.fired),
                        "2^{k}: {f:?} fired where the unscaled pair gives {same:?}"
                    );
                }
            }
        }
    }
}

/// A row with a non-finite pair leaves the lanes with nothing added and goes the
/// per-element way, which skips the pair.
#[test]
fn a_non_finite_pair_sends_its_row_the_per_element_way() {
    let mut d = Detect::new(&[2, 5], Format::F64, Detection::default());
    let r = [1.0, 2.0, f64::NAN, 4.0, 5.0];
    let c = [1.0, 2.5, 3.0, f64::INFINITY, 5.0];
    assert!(!d.row_pass_finite(&r, &c));
    assert_eq!((d.row_count, d.n, d.col_n.iter().sum::<usize>()), (0, 0, 0));
    d.row_pass(&r, &c);
    assert_eq!((d.row_count, d.n), (1, 3));
    assert_eq!(d.col_n, vec![1, 1, 0, 0, 1]);
    assert_eq!(d.bias.sum, 0.5);
}

/// The real-engine matrix's case: a BF16 output scaled by 1 + 10⁻³ (0.13 ε) before its
/// rounding. With 32 tokens no systematic test applies (a pure signal cannot reach the
/// critical value against 32 row clusters); with 128 the scale test finds it, and nothing
/// fires without it.
#[test]
fn a_scale_below_one_rounding_needs_enough_tokens() {
    let bf = |x: f64| Format::BF16.round(x, Overflow::NonSaturating);
    let r = gaussian(32 * 256, 11);
    let r: Vec<f64> = r.iter().map(|&x| bf(x)).collect();
    let c: Vec<f64> = gaussian(32 * 256, 11)
        .iter()
        .map(|&x| bf(x * (1.0 + 1e-3)))
        .collect();
    let f = detect(&[32, 256], &r, &c, Format::BF16, EPS, Detection::default());
    assert!(get(&f, Detector::Scale).is_none(), "{f:?}");
    let (rows, cols) = (128, 256);
    let y = gaussian(rows * cols, 11);
    let wiggle = gaussian(rows * cols, 12);
    let bf = |x: f64| Format::BF16.round(x, Overflow::NonSaturating);
    // Round-off of the accumulations: 10⁻³ ulp-sized differences before the rounding.
    let r: Vec<f64> = y.iter().map(|&x| bf(x)).collect();
    let pre: Vec<f64> = y
        .iter()
        .zip(&wiggle)
        .map(|(x, w)| x + 1e-3 * EPS * w * x.abs())
        .collect();
    let clean: Vec<f64> = pre.iter().map(|&x| bf(x)).collect();
    let scaled: Vec<f64> = pre.iter().map(|&x| bf(x * (1.0 + 1e-3))).collect();
    let d = Detection::default();
    let f = detect(&[rows, cols], &r, &scaled, Format::BF16, EPS, d);
    let s = get(&f, Detector::Scale).unwrap();
    assert!(s.fired, "{s:?}");
    assert!((s.estimate - 0.128).abs() < 0.05, "{s:?}");
    let f = detect(&[rows, cols], &r, &clean, Format::BF16, EPS, d);
    assert!(f.iter().all(|x| !x.fired), "{f:?}");
}

#[test]
fn a_column_vector_of_too_many_rows_has_no_sparse_test_and_bounded_records() {
    let n = MAX_ROW_RECORDS + 1;
    let r = vec![1.0; n];
    let mut c = r.clone();
    c[7] = 2.0;
    let mut d = Detect::new(&[n, 1], Format::F64, Detection::default());
    d.feed(&r, &c);
    assert_eq!(d.rows.len(), MAX_ROW_RECORDS);
    let f = d.finish(EPS, &mut |s, e, f| f(&r[s..e], &c[s..e]));
    assert!(get(&f, Detector::Sparse).is_none(), "{f:?}");
}

#[test]
fn critical_values() {
    // The Gaussian comparison at δ = 2c*·P(η ≥ 6), P(η ≥ 6) = 9.865876450377e-10
    // (tabulated), is 6; at δ = 0.5, 2c*·P(η ≥ √2) = 1/2 gives √2 (Hoeffding's would be
    // √(2 ln 4) = 1.67).
    let c = 1.0 / (4.0 * 0.078_649_603_525_142_2);
    let at6 = symmetric_critical(2.0 * c * 9.865_876_450_377e-10);
    assert!((at6 - 6.0).abs() < 1e-9, "{at6}");
    assert!((symmetric_critical(0.5) - std::f64::consts::SQRT_2).abs() < 1e-9);
    // At the tests' δ/30: 5.72, below Hoeffding's 5.98.
    let t = symmetric_critical(1e-6 * 0.1 / 3.0);
    assert!(t > 5.70 && t < 5.74, "{t}");
    // Laplace of unit variance: P(|X| > x) = exp(−√2 x).
    let x = sparse_critical(10.0, 1e-3);
    assert!(((-std::f64::consts::SQRT_2 * x).exp() * 10.0 - 1e-3).abs() < 1e-15);
}

/// Rows that repeat values (a reference of few distinct values per row: BF16 inputs
/// normalized in FP32, near-constant rows) are structured: their sums round one way, and a
/// deterministic shift common to every row — here exactly what a scale bug would make — is
/// not judged by the systematic tests. The same shift on data of distinct values is found;
/// data stored in BF16 repeat values by their format alone and keep the tests.
#[test]
fn rows_of_repeated_values_have_no_systematic_test() {
    let (rows, cols) = (256, 512);
    let shape = [rows, cols];
    let shifted = |r: &[f64]| -> Vec<f64> {
        let z = gaussian(r.len(), 9);
        r.iter()
            .zip(&z)
            .map(|(x, n)| x * (1.0 + 1e-6) + 1e-9 * n)
            .collect()
    };
    let at = |f: Format| -> Vec<f64> {
        gaussian(rows * cols, 8)
            .iter()
            .map(|&x| f.round(x, Overflow::Saturating))
            .collect()
    };
    let systematic = |f: &[Finding]| {
        f.iter()
            .filter(|x| matches!(x.detector, Detector::Scale | Detector::Bias))
            .count()
    };
    let eps = 2.0 * Format::F32.unit_roundoff();
    // Distinct FP32 values: the tests apply and the scale is found.
    let r = at(Format::F32);
    let f = detect(
        &shape,
        &r,
        &shifted(&r),
        Format::F32,
        eps,
        Detection::default(),
    );
    assert_eq!(systematic(&f), 2);
    assert!(get(&f, Detector::Scale).unwrap().fired, "{f:?}");
    // The same values on BF16's grid, stored in FP32: most repeat within their row.
    let r = at(Format::BF16);
    let d = {
        let mut d = Detect::new(&shape, Format::F32, Detection::default());
        d.feed(&r, &r);
        d
    };
    assert!(d.structured() && d.dup_seen >= cols * DUP_ROWS.min(rows) / 2);
    let f = detect(
        &shape,
        &r,
        &shifted(&r),
        Format::F32,
        eps,
        Detection::default(),
    );
    assert_eq!(systematic(&f), 0, "{f:?}");
    // Stored in BF16 they keep the tests (the candidate on BF16's grid too).
    let c: Vec<f64> = r
        .iter()
        .map(|&x| Format::BF16.round(x * (1.0 + 1.0 / 64.0), Overflow::Saturating))
        .collect();
    let f = detect(&shape, &r, &c, Format::BF16, EPS, Detection::default());
    assert_eq!(systematic(&f), 2, "{f:?}");
    assert!(get(&f, Detector::Scale).unwrap().fired);
    // Zeros (a ReLU's, a mask's) are not repeats: half the values zero, the rest distinct.
    let r: Vec<f64> = at(Format::F32)
        .iter()
        .enumerate()
        .map(|(k, &x)| if k % 2 == 0 { 0.0 } else { x })
        .collect();
    let f = detect(
        &shape,
        &r,
        &shifted(&r),
        Format::F32,
        eps,
        Detection::default(),
    );
    assert_eq!(systematic(&f), 2, "{f:?}");
}

/// Rows that move by one relative factor each (a softmax's denominator summed in another
/// order), a few rows by far more than the rest: the sparse test takes the row's factor out
/// (without it the worst row's second element fired at 1.7×), and still finds one
/// element corrupted within such a row.
#[test]
fn a_row_that_moves_by_one_factor_is_not_a_sparse_error() {
    let (rows, cols) = (256, 1024);
    let f32u = Format::F32.unit_roundoff();
    let mut g = SplitMix64::for_name("row factor", 0);
    // Rows of a softmax of heavy-tailed logits: one element dominates, a second is just
    // below the row's root mean square, the rest are tiny.
    let r: Vec<f64> = (0..rows)
        .flat_map(|t| {
            let (top, second) = ((t * 37) % cols, (t * 37 + 11) % cols);
            (0..cols)
                .map(|j| match j {
                    _ if j == top => 0.9,
                    _ if j == second => 0.025,
                    _ => 1e-4 * g.uniform(),
                })
                .map(|x| Format::F32.round(x, Overflow::Saturating))
                .collect::<Vec<_>>()
        })
        .collect();
    let c: Vec<f64> = r
        .chunks(cols)
        .enumerate()
        .flat_map(|(t, row)| {
            // Most rows move by about one rounding; one by 300 of them.
            let f = if t == 7 { 300.0 } else { g.normal() } * f32u;
            row.iter()
                .map(|&x| Format::F32.round(x * (1.0 + f), Overflow::Saturating))
                .collect::<Vec<_>>()
        })
        .collect();
    let eps = 2.0 * f32u;
    let f = detect(
        &[rows, cols],
        &r,
        &c,
        Format::F32,
        eps,
        Detection::default(),
    );
    let sparse = get(&f, Detector::Sparse).unwrap();
    assert!(!sparse.fired && sparse.ratio < 0.5, "{sparse:?}");
    // The largest element of such a row off by 10,000 roundings of itself.
    let at = (7 * cols..8 * cols)
        .max_by(|&i, &j| r[i].total_cmp(&r[j]))
        .unwrap();
    let mut bad = c.clone();
    bad[at] = Format::F32.round(bad[at] * (1.0 + 1e4 * f32u), Overflow::Saturating);
    let f = detect(
        &[rows, cols],
        &r,
        &bad,
        Format::F32,
        eps,
        Detection::default(),
    );
    let sparse = get(&f, Detector::Sparse).unwrap();
    assert!(sparse.fired && sparse.at == Some(at), "{sparse:?}");
}

/// FP32 rows whose factors move at random (a normalizer's rounding per token) with no common
/// part: the row clusters' variance holds them, and a scale far below the factors' spread is
/// found. Rows a few elements dominate (one column in 16 a thousand times larger) keep the
/// deterministic slack: a common factor of the rows within κ times their spread, which such
/// rows' stagnating sums make, does not fire.
#[test]
fn random_row_factors_need_no_slack_and_dominated_rows_keep_it() {
    let (rows, cols) = (256, 1024);
    let eps = Format::F32.machine_epsilon();
    let (sigma_f, sigma_e) = (0.5 * eps, 2.0 * eps);
    let pair = |seed: u64, outliers: bool, common: f64, rho: f64| {
        let r: Vec<f64> = gaussian(rows * cols, seed)
            .iter()
            .enumerate()
            .map(|(k, &x)| if outliers && k % 16 == 3 { 1e3 * x } else { x })
            .collect();
        let f = gaussian(rows, seed + 1);
        let z = gaussian(rows * cols, seed + 2);
        let c: Vec<f64> = r
            .iter()
            .zip(&z)
            .enumerate()
            .map(|(k, (a, e))| {
                let row = common + sigma_f * f[k / cols];
                a * (1.0 + rho) * (1.0 + row) + a.abs().max(1.0) * sigma_e * e
            })
            .collect();
        (r, c)
    };
    let scale = |r: &[f64], c: &[f64]| {
        let f = detect(&[rows, cols], r, c, Format::F32, eps, Detection::default());
        get(&f, Detector::Scale).unwrap()
    };
    for seed in 0..6 {
        let (r, c) = pair(10 * seed, false, 0.0, 0.0);
        assert!(!scale(&r, &c).fired, "seed {seed}");
        // Half an ε: the factors' spread, about three times the clusters' critical value.
        let (r, c) = pair(10 * seed, false, 0.0, 0.5 * eps);
        let s = scale(&r, &c);
        assert!(
            s.fired && (s.estimate - 0.5).abs() < 0.15,
            "seed {seed}: {s:?}"
        );
        // Dominated rows: a common factor of 1.2 σ_f is allowed, and the test applies.
        let (r, c) = pair(10 * seed, true, 1.2 * sigma_f, 0.0);
        let s = scale(&r, &c);
        assert!(!s.fired && s.ratio > 0.3, "seed {seed}: {s:?}");
    }
}

/// The rows' spread ([`Detect::row_spread`]) against its definition computed apart (two
/// passes over the sampled rows): rows that nearly repeat one another (a base row plus 10⁻⁵
/// of noise each) have no systematic test, independent rows keep them.
#[test]
fn nearly_repeated_rows_have_no_systematic_test() {
    let (rows, cols) = (256, 512);
    let shape = [rows, cols];
    let base = gaussian(cols, 21);
    let noise = gaussian(rows * cols, 22);
    let near: Vec<f64> = (0..rows * cols)
        .map(|i| base[i % cols] + 1e-5 * noise[i])
        .collect();
    let spread_oracle = |r: &[f64]| {
        let stride = (rows / DUP_ROWS).max(1);
        let sampled: Vec<&[f64]> = r.chunks(cols).step_by(stride).collect();
        let k = sampled.len() as f64;
        let mut ratios: Vec<f64> = (0..cols)
            .map(|j| {
                let mean = sampled.iter().map(|row| row[j]).sum::<f64>() / k;
                let var = sampled
                    .iter()
                    .map(|row| (row[j] - mean).powi(2))
                    .sum::<f64>()
                    / k;
                let ms = sampled.iter().map(|row| row[j] * row[j]).sum::<f64>() / k;
                (var / ms).sqrt()
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        ratios[cols / 2]
    };
    let first_pass = |r: &[f64]| {
        let mut d = Detect::new(&shape, Format::F32, Detection::default());
        d.feed(r, r);
        d
    };
    let d = first_pass(&near);
    let got = d.row_spread().unwrap();
    let want = spread_oracle(&near);
    assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
    assert!(got < 1e-3 && d.nearly_repeated());
    let systematic = |f: &[Finding]| {
        f.iter()
            .filter(|x| matches!(x.detector, Detector::Scale | Detector::Bias))
            .count()
    };
    let scaled = |r: &[f64]| r.iter().map(|x| x * (1.0 + 1e-6)).collect::<Vec<f64>>();
    let eps = 2.0 * Format::F32.unit_roundoff();
    let f = detect(
        &shape,
        &near,
        &scaled(&near),
        Format::F32,
        eps,
        Detection::default(),
    );
    assert_eq!(systematic(&f), 0, "{f:?}");
    // Independent rows: a spread near 1, and the tests apply (and find the scale).
    let indep = gaussian(rows * cols, 23);
    let d = first_pass(&indep);
    let got = d.row_spread().unwrap();
    assert!((got - spread_oracle(&indep)).abs() <= 1e-9 && got > 0.5 && !d.nearly_repeated());
    let f = detect(
        &shape,
        &indep,
        &scaled(&indep),
        Format::F32,
        eps,
        Detection::default(),
    );
    assert_eq!(systematic(&f), 2, "{f:?}");
    assert!(get(&f, Detector::Scale).unwrap().fired, "{f:?}");
}
