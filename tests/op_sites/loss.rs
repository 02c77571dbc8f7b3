//! Cross-entropy sites priced through the registry's cross-entropy ops (`check::loss_site`):
//! a manifest whose loss site names its op (`"op": "cross_entropy"`) has its loss and its
//! logits' gradient judged against the exact values of both runs' logits plus the ops' own
//! rounding.
//!
//! Oracle: the runs' losses and gradients are made here by a kernel written in this file in
//! `f32` — the rows' exponentials summed forward on the reference, backward on the candidate,
//! whose logits are split over two tensor-parallel ranks along the vocabulary (a
//! vocabulary-parallel loss; the shards cut by index arithmetic) and differ from the
//! reference's by a few units of FP32 — and the exact values are a naive f64 loop here too. A
//! row whose target is torch's `ignore_index` (−100) is left out of the mean and has a zero
//! gradient. A correct candidate must pass with thresholds no smaller than the exact carried
//! differences; a loss or a gradient scaled by 1 + 2⁻¹⁴ must fail at the site; a candidate
//! whose rows are split over data ranks is left to the local model.

use std::collections::HashMap;
use std::path::Path;

use ttrace::check::{check_dir_paths, Pricing, PricingMode};
use ttrace::io::write_trace_dir;
use ttrace::trace::{Axis, Layout, Mesh, ModuleKind, Placement};
use ttrace::{Format, Tensor};

const ROWS: usize = 12;
const VOCAB: usize = 64;
const IGNORED: usize = 5;

/// Logits of the row and class (f32 values), moved by `moved` units of FP32 on the candidate.
fn logits(seed: u64, moved: f64) -> Vec<f64> {
    (0..ROWS * VOCAB)
        .map(|i| {
            let x = ((i as u64 * 2654435761 + seed * 97) % 1000) as f64 / 125.0 - 4.0;
            let wiggle = if i % 3 == 0 {
                moved * 2f64.powi(-23) * x
            } else {
                0.0
            };
            (x + wiggle) as f32 as f64
        })
        .collect()
}

fn targets() -> Vec<f64> {
    (0..ROWS)
        .map(|r| {
            if r == IGNORED {
                -100.0
            } else {
                ((r * 7 + 3) % VOCAB) as f64
            }
        })
        .collect()
}

/// The mean loss and the gradient (dloss 1) as an f32 kernel computes them, the exponentials
/// summed forward or backward.
fn kernel(z: &[f64], t: &[f64], backward: bool) -> (f64, Vec<f64>) {
    let kept = t.iter().filter(|&&x| x >= 0.0).count() as f32;
    let (mut sum, mut grad) = (0.0f32, vec![0.0; ROWS * VOCAB]);
    for r in 0..ROWS {
        if t[r] < 0.0 {
            continue;
        }
        let row: Vec<f32> = z[r * VOCAB..(r + 1) * VOCAB]
            .iter()
            .map(|&x| x as f32)
            .collect();
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let e: Vec<f32> = row.iter().map(|x| (x - m).exp()).collect();
        let s: f32 = if backward {
            e.iter().rev().sum()
        } else {
            e.iter().sum()
        };
        let target = t[r] as usize;
        sum += m + s.ln() - row[target];
        for j in 0..VOCAB {
            let y = if j == target { 1.0 } else { 0.0 };
            grad[r * VOCAB + j] = ((e[j] / s - y) / kept) as f64;
        }
    }
    ((sum / kept) as f64, grad)
}

/// The exact mean loss and gradient in f64.
fn exact(z: &[f64], t: &[f64]) -> (f64, Vec<f64>) {
    let kept = t.iter().filter(|&&x| x >= 0.0).count() as f64;
    let (mut sum, mut grad) = (0.0, vec![0.0; ROWS * VOCAB]);
    for r in (0..ROWS).filter(|&r| t[r] >= 0.0) {
        let row = &z[r * VOCAB..(r + 1) * VOCAB];
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let l = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        sum += l - row[t[r] as usize];
        for j in 0..VOCAB {
            let y = if j == t[r] as usize { 1.0 } else { 0.0 };
            grad[r * VOCAB + j] = ((row[j] - l).exp() - y) / kept;
        }
    }
    (sum / kept, grad)
}

/// A trace of the site on `ranks` ranks along `axis`: the logits and gradient split along
/// `dim` (1: the vocabulary over tp; 0: the rows over dp), the targets and scalars replicated
/// (dp: split along the rows too, the loss each rank's own).
fn write(dir: &Path, z: &[f64], loss: f64, grad: &[f64], axis: Option<(Axis, usize)>) {
    let t = targets();
    let (mesh, ranks) = match &axis {
        Some((a, n)) => (Mesh::new([(a.clone(), *n)]).unwrap(), *n),
        None => (Mesh::single(), 1),
    };
    let dp = axis.as_ref().is_some_and(|(a, _)| *a == Axis::DP);
    let dim = if dp { 0 } else { 1 };
    let f = Format::F32;
    let cut = |x: &[f64], k: usize| -> Tensor {
        if dim == 1 {
            let w = VOCAB / ranks;
            let v = (0..ROWS)
                .flat_map(|r| x[r * VOCAB + k * w..r * VOCAB + (k + 1) * w].to_vec())
                .collect();
            Tensor::from_vec(&[ROWS, w], v, f).unwrap()
        } else {
            let h = ROWS / ranks;
            Tensor::from_vec(
                &[h, VOCAB],
                x[k * h * VOCAB..(k + 1) * h * VOCAB].to_vec(),
                f,
            )
            .unwrap()
        }
    };
    let mut split = Layout::replicated();
    let mut rows = Layout::replicated();
    if let Some((a, _)) = axis {
        split.set(a.clone(), Placement::Split { dim, groups: 1 });
        rows.set(a.clone(), Placement::Split { dim: 0, groups: 1 });
    }
    let scalar = |v: f64| Tensor::from_vec(&[], vec![v], f).unwrap();
    let vector = |k: usize| {
        if dp {
            let h = ROWS / ranks;
            Tensor::from_vec(&[h], t[k * h..(k + 1) * h].to_vec(), f).unwrap()
        } else {
            Tensor::from_vec(&[ROWS], t.clone(), f).unwrap()
        }
    };
    let entries: Vec<(String, Layout, Vec<Tensor>)> = vec![
        (
            "ce|fwd.input.0".into(),
            split.clone(),
            (0..ranks).map(|k| cut(z, k)).collect(),
        ),
        (
            "ce|fwd.input.1".into(),
            if dp {
                rows.clone()
            } else {
                Layout::replicated()
            },
            (0..ranks).map(vector).collect(),
        ),
        (
            "ce|fwd.output.0".into(),
            Layout::replicated(),
            vec![scalar(loss); ranks],
        ),
        (
            "ce|grad.output.0".into(),
            Layout::replicated(),
            vec![scalar(1.0); ranks],
        ),
        (
            "ce|grad.input.0".into(),
            split,
            (0..ranks).map(|k| cut(grad, k)).collect(),
        ),
    ];
    let kinds: HashMap<String, ModuleKind> = entries
        .iter()
        .map(|(id, _, _)| (id.clone(), ModuleKind::Loss))
        .collect();
    write_trace_dir(dir, &mesh, None, &entries, &kinds, &HashMap::new()).unwrap();
    super::name_op(dir, "cross_entropy");
}

/// Check a candidate (loss and gradient made by `cand`) against the reference; return the
/// loss's and the gradient's (verdict, pricing), and the exact carried differences.
#[allow(clippy::type_complexity)]
fn judge(
    name: &str,
    seed: u64,
    cand: &dyn Fn(&[f64]) -> (f64, Vec<f64>),
    axis: (Axis, usize),
) -> Vec<(ttrace::check::TensorVerdict, Pricing, f64, f64)> {
    let t = targets();
    let (zr, zc) = (logits(seed, 0.0), logits(seed, 3.0));
    let (lr, gr) = kernel(&zr, &t, false);
    let (lc, gc) = cand(&zc);
    let (rd, cd) = (
        super::temp("loss-sites", &format!("{name}-ref")),
        super::temp("loss-sites", &format!("{name}-cand")),
    );
    write(&rd, &zr, lr, &gr, None);
    write(&cd, &zc, lc, &gc, Some(axis));
    let check = check_dir_paths(&rd, &cd, PricingMode::Auto, &|| {}).unwrap();
    let (er, ec) = (exact(&zr, &t), exact(&zc, &t));
    let norm = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
    let dg: Vec<f64> = er.1.iter().zip(&ec.1).map(|(a, b)| a - b).collect();
    let out = ["ce|fwd.output.0", "ce|grad.input.0"]
        .iter()
        .zip([(lr.abs(), (er.0 - ec.0).abs()), (norm(&gr), norm(&dg))])
        .map(|(id, (n, carried))| {
            let k = check
                .report
                .verdicts
                .iter()
                .position(|v| v.id == *id)
                .unwrap();
            (
                check.report.verdicts[k].clone(),
                check.pricing[k],
                n,
                carried,
            )
        })
        .collect();
    for d in [rd, cd] {
        let _ = std::fs::remove_dir_all(d);
    }
    out
}

#[test]
fn a_vocabulary_parallel_loss_passes_with_thresholds_above_the_exact_carried_differences() {
    let t = targets();
    for seed in 0..4 {
        let got = judge("clean", seed, &|z| kernel(z, &t, true), (Axis::TP, 2));
        for (v, pricing, norm, carried) in got {
            assert_eq!(pricing, Pricing::Op, "{} seed {seed}", v.id);
            assert!(v.passed, "{} seed {seed}: ratio {}", v.id, v.ratio);
            assert!(carried > 0.0, "{} seed {seed}", v.id);
            assert!(v.threshold * norm >= carried, "{} seed {seed}", v.id);
        }
    }
}

#[test]
fn a_scaled_loss_or_gradient_fails_and_data_parallel_rows_keep_the_local_model() {
    let t = targets();
    let scale = 1.0 + 2f64.powi(-14);
    for seed in 0..4 {
        let loss = |z: &[f64]| {
            let (l, g) = kernel(z, &t, true);
            ((l * scale) as f32 as f64, g)
        };
        let got = judge("loss", seed, &loss, (Axis::TP, 2));
        assert!(!got[0].0.passed, "seed {seed}: ratio {}", got[0].0.ratio);
        let grad = |z: &[f64]| {
            let (l, g) = kernel(z, &t, true);
            (l, g.iter().map(|x| (x * scale) as f32 as f64).collect())
        };
        let got = judge("grad", seed, &grad, (Axis::TP, 2));
        assert!(
            got[0].0.passed && !got[1].0.passed,
            "seed {seed}: ratio {}",
            got[1].0.ratio
        );
    }
    let got = judge("dp", 0, &|z| kernel(z, &t, true), (Axis::DP, 2));
    assert!(got.iter().all(|(_, p, _, _)| *p != Pricing::Op));
}
