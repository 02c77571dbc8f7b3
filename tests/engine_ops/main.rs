//! Engine ops: F64 agreement with naive implementations, central-difference gradient checks,
//! and bit-identity with hand composition of the foundation's primitives under narrow policies.

use proptest::prelude::*;
use ttrace::engine::*;
use ttrace::{dot, sum, Accumulation, BlockSum, Combine, Format, Order, Overflow, Products};
use ttrace::{Policy, Recipe, Scaling, Tensor};

mod composition;
mod gradients;
mod kernels;

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

// ------------------------------------------------------------------ bit identity by hand

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

fn bf16(v: f64) -> f64 {
    Format::BF16.round(v, Overflow::NonSaturating)
}
