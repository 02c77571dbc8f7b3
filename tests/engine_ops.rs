//! Engine ops: F64 agreement with naive implementations, central-difference gradient checks,
//! and bit-identity with hand composition of the foundation's primitives under narrow policies.

use proptest::prelude::*;
use ttrace::engine::*;
use ttrace::{dot, sum, Accumulation, BlockSum, Combine, Format, Order, Overflow, Products};
use ttrace::{Policy, Recipe, Scaling, Tensor};

// ------------------------------------------------------------------ helpers

fn seeded(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut g = SplitMix64::for_name("test", seed);
    (0..n).map(|_| scale * (2.0 * g.uniform() - 1.0)).collect()
}

fn t(shape: &[usize], v: Vec<f64>, f: Format) -> Tensor {
    Tensor::rounded(shape, v, f, Overflow::Saturating).unwrap()
}

fn f64p() -> Policy {
    Policy::uniform(Format::F64)
}

fn close(a: &[f64], b: &[f64], rel: f64) -> bool {
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-300);
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= rel * scale)
}

fn naive_matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    c
}

fn naive_softmax(x: &[f64], n: usize) -> Vec<f64> {
    x.chunks(n)
        .flat_map(|r| {
            let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = r.iter().map(|v| (v - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(move |v| v / s)
        })
        .collect()
}

fn naive_layer_norm(x: &[f64], n: usize, w: &[f64], b: Option<&[f64]>, eps: f64) -> Vec<f64> {
    x.chunks(n)
        .flat_map(|r| {
            let (mu, var) = match b {
                Some(_) => {
                    let mu = r.iter().sum::<f64>() / n as f64;
                    (
                        mu,
                        r.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n as f64,
                    )
                }
                None => (0.0, r.iter().map(|v| v * v).sum::<f64>() / n as f64),
            };
            let rstd = 1.0 / (var + eps).sqrt();
            r.iter()
                .enumerate()
                .map(|(i, v)| (v - mu) * rstd * w[i] + b.map_or(0.0, |b| b[i]))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Naive causal attention on [batch, seq, 3h] → [batch, seq, h].
fn naive_attention(qkv: &[f64], batch: usize, seq: usize, hidden: usize, heads: usize) -> Vec<f64> {
    let d = hidden / heads;
    let mut out = vec![0.0; batch * seq * hidden];
    for b in 0..batch {
        for h in 0..heads {
            let at = |t: usize, part: usize, j: usize| {
                qkv[(b * seq + t) * 3 * hidden + part * hidden + h * d + j]
            };
            for i in 0..seq {
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d).map(|c| at(i, 0, c) * at(j, 1, c)).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let p = naive_softmax(&s, s.len());
                for c in 0..d {
                    out[(b * seq + i) * hidden + h * d + c] =
                        (0..=i).map(|j| p[j] * at(j, 2, c)).sum();
                }
            }
        }
    }
    out
}

// ------------------------------------------------------------------ F64 vs naive

#[test]
fn f64_ops_agree_with_naive_implementations() {
    let (m, k, n) = (5, 7, 3);
    let a = seeded(m * k, 1, 2.0);
    let b = seeded(k * n, 2, 2.0);
    let c = matmul(
        &t(&[m, k], a.clone(), Format::F64),
        &t(&[k, n], b.clone(), Format::F64),
        &f64p(),
    )
    .unwrap();
    assert!(close(c.values(), &naive_matmul(&a, &b, m, k, n), 1e-14));

    let x = seeded(4 * 6, 3, 3.0);
    let s = softmax(&t(&[4, 6], x.clone(), Format::F64), &f64p()).unwrap();
    assert!(close(s.values(), &naive_softmax(&x, 6), 1e-14));
    for block in [1, 2, 4, 6, 7] {
        let o = online_softmax(&t(&[4, 6], x.clone(), Format::F64), block, &f64p()).unwrap();
        assert!(
            close(o.values(), &naive_softmax(&x, 6), 1e-14),
            "block {block}"
        );
    }

    let w = seeded(6, 4, 1.0);
    let bias = seeded(6, 5, 1.0);
    for var in [Variance::TwoPass, Variance::Welford, Variance::OnePass] {
        let (y, _) = layer_norm(
            &t(&[4, 6], x.clone(), Format::F64),
            &t(&[6], w.clone(), Format::F64),
            &t(&[6], bias.clone(), Format::F64),
            1e-5,
            var,
            &f64p(),
        )
        .unwrap();
        assert!(
            close(
                y.values(),
                &naive_layer_norm(&x, 6, &w, Some(&bias), 1e-5),
                1e-12
            ),
            "{var:?}"
        );
    }
    let (y, _) = rms_norm(
        &t(&[4, 6], x.clone(), Format::F64),
        &t(&[6], w.clone(), Format::F64),
        1e-5,
        &f64p(),
    )
    .unwrap();
    assert!(close(
        y.values(),
        &naive_layer_norm(&x, 6, &w, None, 1e-5),
        1e-13
    ));

    let g = gelu(&t(&[4, 6], x.clone(), Format::F64), &f64p()).unwrap();
    let expect: Vec<f64> = x
        .iter()
        .map(|&v| {
            0.5 * v
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
        })
        .collect();
    assert!(close(g.values(), &expect, 1e-15));
    let si = silu(&t(&[4, 6], x.clone(), Format::F64), &f64p()).unwrap();
    let expect: Vec<f64> = x.iter().map(|&v| v / (1.0 + (-v).exp())).collect();
    assert!(close(si.values(), &expect, 1e-15));

    // Cross-entropy: mean of logsumexp - z_target.
    let targets = [0usize, 5, 2, 3];
    let ce = cross_entropy(&t(&[4, 6], x.clone(), Format::F64), &targets, &f64p()).unwrap();
    let expect: f64 = x
        .chunks(6)
        .zip(&targets)
        .map(|(r, &tg)| r.iter().map(|v| v.exp()).sum::<f64>().ln() - r[tg])
        .sum::<f64>()
        / 4.0;
    assert!((ce.values()[0] - expect).abs() < 1e-14);

    // Attention, both forms.
    let (batch, seq, hidden, heads) = (2, 5, 8, 2);
    let qkv = seeded(batch * seq * 3 * hidden, 6, 1.5);
    let expect = naive_attention(&qkv, batch, seq, hidden, heads);
    for imp in [
        AttentionImpl::Standard,
        AttentionImpl::Online { block: 2 },
        AttentionImpl::Online { block: 1 },
    ] {
        let (o, _) = attention(
            &t(&[batch, seq, 3 * hidden], qkv.clone(), Format::F64),
            heads,
            true,
            imp,
            &f64p(),
        )
        .unwrap();
        assert!(close(o.values(), &expect, 1e-13), "{imp:?}");
    }

    // Embedding: rows of wte plus rows of wpe.
    let wte = seeded(10 * 4, 7, 1.0);
    let wpe = seeded(3 * 4, 8, 1.0);
    let ids = [3usize, 9, 0, 3, 1, 2];
    let e = embedding(
        &ids,
        2,
        3,
        &t(&[10, 4], wte.clone(), Format::F64),
        &t(&[3, 4], wpe.clone(), Format::F64),
        &f64p(),
    )
    .unwrap();
    for (p, &id) in ids.iter().enumerate() {
        for h in 0..4 {
            assert_eq!(
                e.values()[p * 4 + h],
                wte[id * 4 + h] + wpe[(p % 3) * 4 + h]
            );
        }
    }
}

// ------------------------------------------------------------------ gradient checks

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

// ------------------------------------------------------------------ bit identity by hand

fn bf16(v: f64) -> f64 {
    Format::BF16.round(v, Overflow::NonSaturating)
}
fn f32r(v: f64) -> f64 {
    Format::F32.round(v, Overflow::NonSaturating)
}

fn narrow_orders() -> Vec<Order> {
    vec![
        Order::Sequential,
        Order::Pairwise { base: 4 },
        Order::Blocked {
            block: 8,
            inner: BlockSum::Sequential,
        },
        Order::Blocked {
            block: 16,
            inner: BlockSum::Fused,
        },
        Order::SplitK {
            parts: 3,
            inner: Box::new(Order::Sequential),
            partial: Format::BF16,
            combine: Combine::Ring { start: 1 },
        },
        Order::Kahan,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// C = A·B under BF16 inputs, FP32 accumulation, BF16 output, composed by hand as
    /// bf16(dot(a_i, b_j)) — for every order, both product handlings, and FP32 inputs.
    #[test]
    fn matmul_is_dot_then_round(m in 1usize..6, k in 0usize..40, n in 1usize..6, seed in 0u64..1000,
                                oi in 0usize..6, rounded in any::<bool>(), f32_in in any::<bool>()) {
        let input = if f32_in { Format::F32 } else { Format::BF16 };
        let order = narrow_orders()[oi].clone();
        let products = if rounded { Products::Rounded(Format::F32) } else { Products::Exact };
        let a: Vec<f64> = seeded(m * k, seed, 4.0).into_iter().map(|v| input.round(v, Overflow::NonSaturating)).collect();
        let b: Vec<f64> = seeded(k * n, seed + 1, 4.0).into_iter().map(|v| input.round(v, Overflow::NonSaturating)).collect();
        let policy = Policy::new(input, Format::F32, Format::BF16).with_order(order.clone()).with_products(products);
        let c = matmul(&t(&[m, k], a.clone(), input), &t(&[k, n], b.clone(), input), &policy).unwrap();
        let acc = Accumulation::new(input, Format::F32, order).with_products(products);
        for i in 0..m {
            for j in 0..n {
                let col: Vec<f64> = (0..k).map(|p| b[p * n + j]).collect();
                let expect = bf16(dot(&a[i * k..(i + 1) * k], &col, &acc).unwrap());
                prop_assert_eq!(c.values()[i * n + j].to_bits(), expect.to_bits(), "({}, {})", i, j);
            }
        }
    }

    /// FP8 per-tensor current scaling: q = e4m3_sat(f32(x·s)), s = f32(448 / amax), then
    /// c = bf16(f32(dot(q_a, q_b) · f32(s_a⁻¹·s_b⁻¹))) with s⁻¹ = f32(1/s).
    #[test]
    fn fp8_matmul_is_quantize_dot_rescale(m in 1usize..5, k in 1usize..40, n in 1usize..5, seed in 0u64..1000) {
        let a: Vec<f64> = seeded(m * k, seed, 3.0).into_iter().map(bf16).collect();
        let b: Vec<f64> = seeded(k * n, seed + 1, 0.5).into_iter().map(bf16).collect();
        let policy = Policy::new(Format::E4M3, Format::F32, Format::BF16).with_scaling(Scaling::PerTensorCurrent { margin: 0 });
        let c = matmul(&t(&[m, k], a.clone(), Format::BF16), &t(&[k, n], b.clone(), Format::BF16), &policy).unwrap();
        let quant = |x: &[f64]| {
            let amax = x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let s = f32r(448.0 / amax);
            let q: Vec<f64> = x.iter().map(|&v| Format::E4M3.round(f32r(v * s), Overflow::Saturating)).collect();
            (q, f32r(1.0 / s))
        };
        let (qa, ia) = quant(&a);
        let (qb, ib) = quant(&b);
        let f = f32r(ia * ib);
        let acc = Accumulation::new(Format::E4M3, Format::F32, Order::Sequential);
        for i in 0..m {
            for j in 0..n {
                let col: Vec<f64> = (0..k).map(|p| qb[p * n + j]).collect();
                let d = dot(&qa[i * k..(i + 1) * k], &col, &acc).unwrap();
                let expect = bf16(f32r(d * f));
                prop_assert_eq!(c.values()[i * n + j].to_bits(), expect.to_bits());
            }
        }
    }

    /// Softmax: e = f32(exp(f32(x − max))), s = sum(e), p = bf16(f32(e / s)).
    #[test]
    fn softmax_is_composed_of_primitives(rows in 1usize..4, n in 1usize..50, seed in 0u64..1000, oi in 0usize..6) {
        let order = narrow_orders()[oi].clone();
        let x: Vec<f64> = seeded(rows * n, seed, 8.0).into_iter().map(bf16).collect();
        let policy = Policy::new(Format::BF16, Format::F32, Format::BF16).with_order(order.clone());
        let y = softmax(&t(&[rows, n], x.clone(), Format::BF16), &policy).unwrap();
        let acc = Accumulation::new(Format::F32, Format::F32, order);
        for (r, row) in x.chunks(n).enumerate() {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = row.iter().map(|&v| f32r(f32r(v - m).exp())).collect();
            let s = sum(&e, &acc).unwrap();
            for (i, &ei) in e.iter().enumerate() {
                prop_assert_eq!(y.values()[r * n + i].to_bits(), bf16(f32r(ei / s)).to_bits());
            }
        }
    }

    /// LayerNorm (two-pass): μ = f32(sum(x)/n), d = f32(x − μ), var = f32(dot(d, d)/n),
    /// rstd = f32(1/√(f32(var + eps))), y = bf16(f32(f32(f32(d·rstd)·γ) + β)).
    #[test]
    fn layer_norm_is_composed_of_primitives(rows in 1usize..4, n in 1usize..40, seed in 0u64..1000, oi in 0usize..6) {
        let order = narrow_orders()[oi].clone();
        let x: Vec<f64> = seeded(rows * n, seed, 5.0).into_iter().map(|v| bf16(v + 3.0)).collect();
        let w: Vec<f64> = seeded(n, seed + 1, 1.0).into_iter().map(bf16).collect();
        let bb: Vec<f64> = seeded(n, seed + 2, 1.0).into_iter().map(bf16).collect();
        let eps = 1e-5;
        let policy = Policy::new(Format::BF16, Format::F32, Format::BF16).with_order(order.clone());
        let (y, _) = layer_norm(&t(&[rows, n], x.clone(), Format::BF16), &t(&[n], w.clone(), Format::BF16), &t(&[n], bb.clone(), Format::BF16), eps, Variance::TwoPass, &policy).unwrap();
        let acc_in = Accumulation::new(Format::BF16, Format::F32, order.clone());
        let acc_a = Accumulation::new(Format::F32, Format::F32, order);
        let add = |a: f64, b: f64| Format::F32.add_rounded(a, b, Overflow::NonSaturating);
        for (r, row) in x.chunks(n).enumerate() {
            let mu = f32r(sum(row, &acc_in).unwrap() / n as f64);
            let d: Vec<f64> = row.iter().map(|&v| add(v, -mu)).collect();
            let var = f32r(dot(&d, &d, &acc_a).unwrap() / n as f64);
            let rstd = f32r(1.0 / add(var, f32r(eps)).sqrt());
            for i in 0..n {
                let expect = bf16(add(f32r(f32r(d[i] * rstd) * w[i]), bb[i]));
                prop_assert_eq!(y.values()[r * n + i].to_bits(), expect.to_bits(), "row {} col {}", r, i);
            }
        }
    }
}

/// The native f32 kernel and the generic per-element path give identical bits on a matmul big
/// enough to use the kernel, including values at the edge of the product range.
#[test]
fn native_kernel_matches_generic_path() {
    let (m, k, n) = (9, 70, 37); // 4×16 tiles, 1×16 tiles for row 8, 1×1 tiles for columns 32..37
    let mut a: Vec<f64> = seeded(m * k, 11, 2.0).into_iter().map(bf16).collect();
    let b: Vec<f64> = seeded(k * n, 12, 2.0).into_iter().map(bf16).collect();
    a[3] = 2f64.powi(61);
    a[4] = -2f64.powi(-61);
    for order in [
        Order::Sequential,
        Order::Blocked {
            block: 16,
            inner: BlockSum::Sequential,
        },
    ] {
        for products in [Products::Exact, Products::Rounded(Format::F32)] {
            let fast = Policy::new(Format::BF16, Format::F32, Format::F32)
                .with_order(order.clone())
                .with_products(products);
            // Saturating overflow disables the native kernel; nothing overflows here.
            let mut slow = fast.clone();
            slow.accumulation.overflow = Overflow::Saturating;
            let ta = t(&[m, k], a.clone(), Format::BF16);
            let tb = t(&[k, n], b.clone(), Format::BF16);
            let c1 = matmul(&ta, &tb, &fast).unwrap();
            let c2 = matmul(&ta, &tb, &slow).unwrap();
            assert_eq!(c1.values(), c2.values(), "{order:?} {products:?}");
        }
    }
}

#[test]
fn mx_block_scaling_dequantizes_exactly() {
    let x: Vec<f64> = seeded(64, 5, 100.0).into_iter().map(bf16).collect();
    let q = quantize(
        &x,
        [1, 64],
        1,
        Format::E4M3,
        Scaling::Block { size: 32 },
        None,
        Overflow::Saturating,
    );
    for block in 0..2 {
        let xs = &x[block * 32..(block + 1) * 32];
        let amax = xs.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let scale = 2f64.powi(amax.log2().floor() as i32 - 8);
        for (i, &xi) in xs.iter().enumerate() {
            let expect = Format::E4M3.round(xi / scale, Overflow::Saturating) * scale;
            assert_eq!(q.values[block * 32 + i], expect);
            // Within the E4M3 relative precision of the original (no saturation beyond 448·X).
            assert!(
                (q.values[block * 32 + i] - xi).abs() <= xi.abs() * 0.0625 + scale * 2f64.powi(-9)
            );
        }
    }
    assert_eq!(q.scale_inv, 1.0);
}

// ------------------------------------------------------------------ errors

#[test]
fn bad_inputs_are_errors_not_panics() {
    let p = Policy::new(Format::BF16, Format::F32, Format::BF16);
    let a = Tensor::zeros(&[2, 3], Format::BF16);
    let b = Tensor::zeros(&[4, 2], Format::BF16);
    let e = matmul(&a, &b, &p).unwrap_err();
    assert!(e.to_string().contains("inner dimensions"), "{e}");
    assert!(matches!(
        matmul(&Tensor::zeros(&[2], Format::BF16), &b, &p),
        Err(ttrace::Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        Tensor::from_vec(&[2, 2], vec![1.0; 3], Format::F32),
        Err(ttrace::Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        Tensor::from_vec(&[1], vec![0.1], Format::BF16),
        Err(ttrace::Error::NotRepresentable { .. })
    ));
    assert!(matches!(
        add(&a, &Tensor::zeros(&[3, 2], Format::BF16), &p),
        Err(ttrace::Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        softmax(&Tensor::zeros(&[2, 0], Format::BF16), &p),
        Err(ttrace::Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        online_softmax(&a, 0, &p),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    let w = Tensor::zeros(&[4], Format::BF16);
    assert!(matches!(
        layer_norm(&a, &w, &w, 1e-5, Variance::TwoPass, &p),
        Err(ttrace::Error::ShapeMismatch { .. })
    ));
    let w3 = Tensor::zeros(&[3], Format::BF16);
    assert!(matches!(
        layer_norm(&a, &w3, &w3, -1.0, Variance::TwoPass, &p),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    assert!(matches!(
        layer_norm(&a, &w3, &w3, f64::NAN, Variance::TwoPass, &p),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    assert!(matches!(
        cross_entropy(&a, &[0, 3], &p),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    assert!(matches!(
        cross_entropy(&a, &[0], &p),
        Err(ttrace::Error::LengthMismatch { .. })
    ));
    let qkv = Tensor::zeros(&[1, 2, 7], Format::BF16);
    assert!(matches!(
        attention(&qkv, 2, true, AttentionImpl::Standard, &p),
        Err(ttrace::Error::ShapeMismatch { .. })
    ));
    let table = Tensor::zeros(&[4, 3], Format::BF16);
    assert!(matches!(
        embedding(&[0, 4], 1, 2, &table, &table, &p),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    assert!(matches!(
        scale(&a, f64::INFINITY, &p),
        Err(ttrace::Error::NonFinite { .. })
    ));
    let bad = Policy::new(Format::BF16, Format::F32, Format::BF16).with_order(Order::Blocked {
        block: 0,
        inner: BlockSum::Fused,
    });
    assert!(matches!(
        matmul(&a, &Tensor::zeros(&[3, 2], Format::BF16), &bad),
        Err(ttrace::Error::InvalidParameter { .. })
    ));
    assert!(matches!(
        Recipe::by_name("fp9"),
        Err(ttrace::Error::UnknownName { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// The native kernel (packed operands, 6×16 register tiles, FMA for exact products, AVX2
    /// when available) gives the generic per-element path's bits for every shape, order and
    /// product mode, including signed zeros (zero operands) and FP32 inputs with rounded
    /// products; reductions up to 700 long cross the kernel's 256-step chunks inside and at
    /// the ends of blocks.
    #[test]
    fn native_kernel_is_the_generic_path(
        (m, k, n) in prop_oneof![
            (1usize..20, 1usize..80, 1usize..40),
            (1usize..14, 200usize..700, 1usize..34),
        ],
        seed in any::<u64>(),
        block in prop_oneof![1usize..40, 200usize..400],
        blocked in any::<bool>(), exact in any::<bool>(), f32_in in any::<bool>(),
        zeros in 0usize..5)
    {
        let input = if f32_in { Format::F32 } else { Format::BF16 };
        let mut a = seeded(m * k, seed, 2.0);
        let b = seeded(k * n, seed ^ 1, 2.0);
        let len = a.len();
        for i in 0..zeros.min(len) {
            a[(i * 7) % len] = if i % 2 == 0 { 0.0 } else { -0.0 };
        }
        let order = if blocked {
            Order::Blocked { block, inner: BlockSum::Sequential }
        } else {
            Order::Sequential
        };
        let products = if exact { Products::Exact } else { Products::Rounded(Format::F32) };
        let fast = Policy::new(input, Format::F32, Format::F32)
            .with_order(order)
            .with_products(products);
        let mut slow = fast.clone();
        slow.accumulation.overflow = Overflow::Saturating;
        let ta = t(&[m, k], a, input);
        let tb = t(&[k, n], b, input);
        let c1 = matmul(&ta, &tb, &fast).unwrap();
        let c2 = matmul(&ta, &tb, &slow).unwrap();
        let same = c1.values().iter().zip(c2.values()).all(|(x, y)| x.to_bits() == y.to_bits());
        prop_assert!(same, "{m}x{k}x{n} {:?} {:?} {input}", fast.accumulation.order, products);
    }
}

/// A product large enough for the kernel to split rows over threads gives the same bits with
/// 1, 2 and 3 threads.
#[test]
fn parallel_kernel_does_not_depend_on_the_thread_count() {
    let (m, k, n) = (101, 300, 150); // 4.5M multiply-adds: split into bands of 48 rows
    let a = t(&[m, k], seeded(m * k, 21, 2.0), Format::BF16);
    let b = t(&[k, n], seeded(k * n, 22, 2.0), Format::BF16);
    // FP32 accumulation (the packed kernel), BF16 and FP16 accumulators (the f32-lane kernel).
    for acc in [Format::F32, Format::BF16, Format::F16] {
        let p = Policy::new(Format::BF16, acc, acc);
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| matmul(&a, &b, &p).unwrap())
        };
        let one = run(1);
        for threads in [2, 3] {
            let c = run(threads);
            assert!(
                one.values()
                    .iter()
                    .zip(c.values())
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{acc} accumulator, {threads} threads"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// The column-vectorized kernels for generic accumulators (every addition rounded to
    /// BF16, FP16, TF32, FP8 or FP32, exact products, sequential order) — the f32-lane one
    /// (BF16, TF32, FP16 accumulators, inputs of at most 12 bits) and the exact-error one
    /// behind it — give, element for element, the bits of the plain emulated dot product,
    /// including double-rounding midpoints, signed zeros, and blocks that overflow or go
    /// subnormal and fall back.
    #[test]
    fn lanes_kernel_is_the_generic_path(
        m in 1usize..20, k in 1usize..60, n in 1usize..40, seed in any::<u64>(),
        acc_pick in 0usize..6, in_pick in 0usize..3,
        scale_pow in prop_oneof![-12i32..12, -66i32..-56, 55i32..64],
        sat in any::<bool>(), zeros in 0usize..4, integers in any::<bool>())
    {
        let accs = [Format::BF16, Format::F16, Format::TF32, Format::E4M3, Format::E5M2, Format::F32];
        let accf = accs[acc_pick];
        let input = [Format::F32, Format::BF16, Format::F16][in_pick];
        let scale = 2f64.powi(scale_pow);
        // Small integers make exact midpoints of the accumulator frequent (sums like 257 in
        // BF16); tiny and huge scales reach subnormal and overflowing sums.
        let gen = |len: usize, seed: u64| -> Vec<f64> {
            let v = seeded(len, seed, 1.0);
            if integers {
                v.iter().map(|x| (x * 24.0).round()).collect()
            } else {
                v.iter().map(|x| x * scale).collect()
            }
        };
        let mut a = gen(m * k, seed);
        let len = a.len();
        for i in 0..zeros.min(len) {
            a[(i * 5) % len] = if i % 2 == 0 { 0.0 } else { -0.0 };
        }
        let b = gen(k * n, seed ^ 7);
        let mut p = Policy::new(input, accf, accf);
        p.accumulation.overflow = if sat { Overflow::Saturating } else { Overflow::NonSaturating };
        let ta = t(&[m, k], a, input);
        let tb = t(&[k, n], b, input);
        let c = matmul(&ta, &tb, &p).unwrap();
        for i in 0..m {
            for j in 0..n {
                let col: Vec<f64> = (0..k).map(|kk| tb.values()[kk * n + j]).collect();
                let want = ttrace::dot(&ta.values()[i * k..(i + 1) * k], &col, &p.accumulation).unwrap();
                let want = accf.round(want, p.accumulation.overflow);
                let got = c.values()[i * n + j];
                prop_assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                    "{accf} {input} ({i},{j}): dot {want:e} vs matmul {got:e}");
            }
        }
    }
}

/// The one case double rounding would get wrong: a running sum far below a product that is
/// exactly a BF16 midpoint ((1 + 2^-4)² = 1.00100001₂), whose f64 sum rounds back onto the
/// midpoint; the exact error must break the tie (upward for a positive tiny sum, downward for a
/// negative one), in the vectorized kernel (8 columns) as in the plain dot product.
#[test]
fn lanes_kernel_breaks_midpoints_by_the_exact_error() {
    let q = 1.0 + 2f64.powi(-4);
    for tiny in [2f64.powi(-30), -(2f64.powi(-30))] {
        let a = t(&[1, 2], vec![tiny, q], Format::BF16);
        let b = t(
            &[2, 8],
            [vec![2f64.powi(-30); 8], vec![q; 8]].concat(),
            Format::BF16,
        );
        let p = Policy::new(Format::BF16, Format::BF16, Format::BF16);
        let c = matmul(&a, &b, &p).unwrap();
        // q² = 1 + 2^-3 + 2^-8 is the midpoint of 1 + 2^-3 and 1 + 2^-3 + 2^-7; ± 2^-60 decides.
        let want = if tiny > 0.0 {
            1.0 + 2f64.powi(-3) + 2f64.powi(-7)
        } else {
            1.0 + 2f64.powi(-3)
        };
        for &v in c.values() {
            assert_eq!(v, want, "tiny = {tiny:e}");
        }
        let col = vec![2f64.powi(-30), q];
        let d = ttrace::dot(a.values(), &col, &p.accumulation).unwrap();
        assert_eq!(d, want);
    }
}

/// Double rounding in FP16's subnormal range, where the f32-lane kernel's midpoint test (at
/// FP16's normal rounding bit) does not see the midpoint: s = 513·2^-24 (subnormal, odd) plus
/// p = 1025·2^-23 · 1023·2^-22 = 2^-25 − 2^-45. fl32(s + p) = s + 2^-25 is a midpoint whose
/// even neighbour is above, but the exact sum lies below it: the answer is s.
#[test]
fn fp16_subnormal_midpoints_are_not_double_rounded() {
    let s = 513.0 * 2f64.powi(-24);
    let (u, v) = (1025.0 * 2f64.powi(-23), 1023.0 * 2f64.powi(-22));
    let a = t(&[1, 2], vec![513.0 * 2f64.powi(-12), u], Format::F16);
    let b = t(
        &[2, 8],
        [vec![2f64.powi(-12); 8], vec![v; 8]].concat(),
        Format::F16,
    );
    let p = Policy::new(Format::F16, Format::F16, Format::F16);
    let c = matmul(&a, &b, &p).unwrap();
    for &x in c.values() {
        assert_eq!(x, s);
    }
    let d = ttrace::dot(a.values(), &[2f64.powi(-12), v], &p.accumulation).unwrap();
    assert_eq!(d, s);
}

/// The FP16-accumulator midpoint in the normal range: s = ±2^-24 (FP16's smallest subnormal)
/// then p = (1 + 2^-5)(1 + 2^-6) = 1 + 2^-5 + 2^-6 + 2^-11, an FP16 midpoint; fl32(s + p) = p
/// (an f32 tie, to even), so only the exact error knows the sum is above (s > 0) or below
/// (s < 0) the midpoint.
#[test]
fn fp16_midpoints_are_broken_by_the_exact_error() {
    let (q1, q2) = (1.0 + 2f64.powi(-5), 1.0 + 2f64.powi(-6));
    let base = 1.0 + 2f64.powi(-5) + 2f64.powi(-6);
    for sign in [1.0, -1.0] {
        let a = t(&[1, 2], vec![sign * 2f64.powi(-12), q1], Format::BF16);
        let b = t(
            &[2, 8],
            [vec![2f64.powi(-12); 8], vec![q2; 8]].concat(),
            Format::BF16,
        );
        let p = Policy::new(Format::BF16, Format::F16, Format::F16);
        let want = if sign > 0.0 {
            base + 2f64.powi(-10)
        } else {
            base
        };
        let c = matmul(&a, &b, &p).unwrap();
        for &x in c.values() {
            assert_eq!(x, want, "sign {sign}");
        }
        let d = ttrace::dot(a.values(), &[2f64.powi(-12), q2], &p.accumulation).unwrap();
        assert_eq!(d, want);
    }
}
