//! Central-difference gradient checks of every op's backward pass (fourth-order stencil, f64).

use super::*;

/// Directional check of a backward pass: with L(θ) = <g, f(θ)>, compares the analytic
/// <∇L, v> to the fourth-order central difference
/// (−L(θ+2hv) + 8L(θ+hv) − 8L(θ−hv) + L(θ−2hv)) / 12h, h = 1e-4. Returns the error relative to
/// ‖∇L‖·‖v‖ (the Cauchy–Schwarz scale of the directional derivative), which stays meaningful
/// when <∇L, v> itself is near zero, floored at 1e-5·|L| so that a zero gradient is compared
/// with the stencil's own cancellation noise (≈ 2^-53·16·|L| / 12h ≈ 1.5e-12·|L|).
fn directional_error(theta: &[f64], v: &[f64], analytic: &[f64], l: impl Fn(&[f64]) -> f64) -> f64 {
    directional_error_at(theta, v, analytic, l, 0.0)
}

/// [`directional_error`] for a loss whose value may cancel far below the terms it sums:
/// `terms` (Σ of their magnitudes) also sets the floor, since their rounding is the stencil's
/// noise (2^-53·terms/h).
fn directional_error_at(
    theta: &[f64],
    v: &[f64],
    analytic: &[f64],
    l: impl Fn(&[f64]) -> f64,
    terms: f64,
) -> f64 {
    let h = 1e-4;
    let at = |s: f64| -> f64 {
        let p: Vec<f64> = theta.iter().zip(v).map(|(a, b)| a + s * h * b).collect();
        l(&p)
    };
    let (l2, l1, m1, m2) = (at(2.0), at(1.0), at(-1.0), at(-2.0));
    let numeric = (-l2 + 8.0 * l1 - 8.0 * m1 + m2) / (12.0 * h);
    let exact: f64 = analytic.iter().zip(v).map(|(a, b)| a * b).sum();
    let norm = |x: &[f64]| x.iter().map(|a| a * a).sum::<f64>().sqrt();
    let floor = 1e-5
        * [l2, l1, m1, m2]
            .iter()
            .fold(terms.max(1e-300), |m, x| m.max(x.abs()));
    (numeric - exact).abs() / (norm(analytic) * norm(v)).max(floor)
}

fn inner(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Stated tolerance for every gradient check: the fourth-order stencil with h = 1e-4 in f64 has
/// truncation error O(h⁴) ≈ 1e-16 times the fifth derivative and cancellation error
/// ≈ 2^-53·|L|/h ≈ 1e-12 relative; 1e-6 leaves room for functions that vary on the scale √eps.
const GRAD_TOL: f64 = 1e-6;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn linear_gradients(rows in 1usize..6, inp in 1usize..7, out in 1usize..6, seed in 0u64..1000) {
        let x = seeded(rows * inp, seed, 1.0);
        let w = seeded(out * inp, seed + 1, 1.0);
        let b = seeded(out, seed + 2, 1.0);
        let g = seeded(rows * out, seed + 3, 1.0);
        let p = f64p();
        let fwd = |x: &[f64], w: &[f64], b: &[f64]| {
            let y = linear(&t(&[rows, inp], x.to_vec(), Format::F64), &t(&[out, inp], w.to_vec(), Format::F64), Some(&t(&[out], b.to_vec(), Format::F64)), &p).unwrap();
            inner(y.values(), &g)
        };
        let (dx, dw, db) = linear_backward(
            &t(&[rows, inp], x.clone(), Format::F64), &t(&[out, inp], w.clone(), Format::F64), true,
            &t(&[rows, out], g.clone(), Format::F64), &p, &p).unwrap();
        let v = seeded(rows * inp, seed + 4, 1.0);
        prop_assert!(directional_error(&x, &v, dx.values(), |z| fwd(z, &w, &b)) < GRAD_TOL);
        let v = seeded(out * inp, seed + 5, 1.0);
        prop_assert!(directional_error(&w, &v, dw.values(), |z| fwd(&x, z, &b)) < GRAD_TOL);
        let v = seeded(out, seed + 6, 1.0);
        prop_assert!(directional_error(&b, &v, db.unwrap().values(), |z| fwd(&x, &w, z)) < GRAD_TOL);
    }

    #[test]
    fn softmax_and_activation_gradients(rows in 1usize..5, n in 1usize..9, seed in 0u64..1000) {
        let x = seeded(rows * n, seed, 3.0);
        let g = seeded(rows * n, seed + 1, 1.0);
        let v = seeded(rows * n, seed + 2, 1.0);
        let p = f64p();
        let tx = |z: &[f64]| t(&[rows, n], z.to_vec(), Format::F64);
        let y = softmax(&tx(&x), &p).unwrap();
        let dx = softmax_backward(&y, &tx(&g), &p).unwrap();
        prop_assert!(directional_error(&x, &v, dx.values(), |z| inner(softmax(&tx(z), &p).unwrap().values(), &g)) < GRAD_TOL);
        let dx = gelu_backward(&tx(&x), &tx(&g), &p).unwrap();
        prop_assert!(directional_error(&x, &v, dx.values(), |z| inner(gelu(&tx(z), &p).unwrap().values(), &g)) < GRAD_TOL);
        let dx = silu_backward(&tx(&x), &tx(&g), &p).unwrap();
        prop_assert!(directional_error(&x, &v, dx.values(), |z| inner(silu(&tx(z), &p).unwrap().values(), &g)) < GRAD_TOL);
        let targets: Vec<usize> = (0..rows).map(|r| (r * 7 + seed as usize) % n).collect();
        let dz = cross_entropy_backward(&tx(&x), &targets, 1.0, &p).unwrap();
        prop_assert!(directional_error(&x, &v, dz.values(), |z| cross_entropy(&tx(z), &targets, &p).unwrap().values()[0]) < GRAD_TOL);
    }

    #[test]
    fn norm_gradients(rows in 1usize..5, n in 2usize..9, seed in 0u64..1000, which in 0usize..4) {
        let x = seeded(rows * n, seed, 2.0);
        let w = seeded(n, seed + 1, 1.0);
        let b = seeded(n, seed + 2, 1.0);
        let g = seeded(rows * n, seed + 3, 1.0);
        let p = f64p();
        let var = [Variance::TwoPass, Variance::Welford, Variance::OnePass, Variance::TwoPass][which];
        let rms = which == 3;
        let fwd = |x: &[f64], w: &[f64], b: &[f64]| {
            let (y, _) = if rms {
                rms_norm(&t(&[rows, n], x.to_vec(), Format::F64), &t(&[n], w.to_vec(), Format::F64), 1e-5, &p).unwrap()
            } else {
                layer_norm(&t(&[rows, n], x.to_vec(), Format::F64), &t(&[n], w.to_vec(), Format::F64), &t(&[n], b.to_vec(), Format::F64), 1e-5, var, &p).unwrap()
            };
            (inner(y.values(), &g), y)
        };
        let saved = if rms {
            rms_norm(&t(&[rows, n], x.clone(), Format::F64), &t(&[n], w.clone(), Format::F64), 1e-5, &p).unwrap().1
        } else {
            layer_norm(&t(&[rows, n], x.clone(), Format::F64), &t(&[n], w.clone(), Format::F64), &t(&[n], b.clone(), Format::F64), 1e-5, var, &p).unwrap().1
        };
        let (dx, dw, db) = norm_backward(&saved, &t(&[n], w.clone(), Format::F64), &t(&[rows, n], g.clone(), Format::F64), !rms, &p, Format::F64).unwrap();
        let v = seeded(rows * n, seed + 4, 1.0);
        // L = Σ gᵢ(wᵢx̂ᵢ + bᵢ) can cancel to far below its terms, whose rounding sets the
        // stencil's noise: the terms of y, not y (CI: n = 2, one-pass variance, b cancelling
        // w·x̂ to L = 0.068 while |g·w·x̂| ≈ 0.84).
        let terms: f64 = (0..rows * n)
            .map(|k| {
                let row = &x[k / n * n..(k / n + 1) * n];
                let mean = if rms { 0.0 } else { row.iter().sum::<f64>() / n as f64 };
                let var = row.iter().map(|z| (z - mean) * (z - mean)).sum::<f64>() / n as f64;
                let xhat = (x[k] - mean) / (var + 1e-5).sqrt();
                g[k].abs() * (w[k % n].abs() * xhat.abs() + if rms { 0.0 } else { b[k % n].abs() })
            })
            .sum();
        prop_assert!(directional_error_at(&x, &v, dx.values(), |z| fwd(z, &w, &b).0, terms) < GRAD_TOL);
        let v = seeded(n, seed + 5, 1.0);
        prop_assert!(directional_error_at(&w, &v, dw.values(), |z| fwd(&x, z, &b).0, terms) < GRAD_TOL);
        if let Some(db) = db {
            prop_assert!(directional_error_at(&b, &v, db.values(), |z| fwd(&x, &w, z).0, terms) < GRAD_TOL);
        }
    }

    #[test]
    fn attention_gradients(batch in 1usize..3, seq in 1usize..6, heads in 1usize..3, d in 1usize..4, seed in 0u64..1000, online in any::<bool>()) {
        let hidden = heads * d;
        let qkv = seeded(batch * seq * 3 * hidden, seed, 1.0);
        let g = seeded(batch * seq * hidden, seed + 1, 1.0);
        let v = seeded(qkv.len(), seed + 2, 1.0);
        let p = f64p();
        let imp = if online { AttentionImpl::Online { block: 2 } } else { AttentionImpl::Standard };
        let tq = |z: &[f64]| t(&[batch, seq, 3 * hidden], z.to_vec(), Format::F64);
        let (_, saved) = attention(&tq(&qkv), heads, true, imp, &p).unwrap();
        let d_qkv = attention_backward(&saved, &t(&[batch, seq, hidden], g.clone(), Format::F64), &p).unwrap();
        let err = directional_error(&qkv, &v, d_qkv.values(), |z| inner(attention(&tq(z), heads, true, imp, &p).unwrap().0.values(), &g));
        prop_assert!(err < GRAD_TOL, "relative error {}", err);
    }

    #[test]
    fn embedding_gradients(seed in 0u64..1000) {
        let (vocab, hidden, batch, seq) = (6, 3, 2, 4);
        let ids: Vec<usize> = (0..batch * seq).map(|i| (i * 5 + seed as usize) % vocab).collect();
        let wte = seeded(vocab * hidden, seed, 1.0);
        let wpe = seeded(seq * hidden, seed + 1, 1.0);
        let g = seeded(batch * seq * hidden, seed + 2, 1.0);
        let p = f64p();
        let fwd = |a: &[f64], b: &[f64]| inner(embedding(&ids, batch, seq, &t(&[vocab, hidden], a.to_vec(), Format::F64), &t(&[seq, hidden], b.to_vec(), Format::F64), &p).unwrap().values(), &g);
        let (dte, dpe) = embedding_backward(&ids, batch, seq, vocab, seq, &t(&[batch, seq, hidden], g.clone(), Format::F64), &p, Format::F64).unwrap();
        let v = seeded(wte.len(), seed + 3, 1.0);
        prop_assert!(directional_error(&wte, &v, dte.values(), |z| fwd(z, &wpe)) < GRAD_TOL);
        let v = seeded(wpe.len(), seed + 4, 1.0);
        prop_assert!(directional_error(&wpe, &v, dpe.values(), |z| fwd(&wte, z)) < GRAD_TOL);
    }
}
