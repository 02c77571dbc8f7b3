//! Bit-identity with hand composition of the primitives under narrow policies: matmul as dot then round, FP8 as quantize-dot-rescale, softmax and LayerNorm step by step, MX block scaling.

use super::*;

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
