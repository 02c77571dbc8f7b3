//! Cross-entropy sites priced through the op registry's `cross_entropy` and
//! `cross_entropy_grad` ops instead of the local model's allowance (`papers/checking.md` §8).
//!
//! A traced cross-entropy whose manifest entry names the op (`"op": "cross_entropy"`: the mean
//! over its rows, no class weights, no label smoothing) holds the logits `{site}|fwd.input.0`
//! ([rows, vocab]) and the targets `{site}|fwd.input.1` (class indices stored as floats; a
//! target outside the vocabulary — torch's `ignore_index` — leaves its row out of the mean and
//! of the gradient) in both traces. Two of its tensors are priced through the ops:
//!
//! * the loss `{site}|fwd.output.0`: carried = |L(z_c) − L(z_r)|, L the mean over the kept rows
//!   of lse(z) − z_target in f64; own = `cross_entropy_threshold` on the reference's kept
//!   logits;
//! * the logits' gradient `{site}|grad.input.0`: carried = ‖g_c·(softmax(z_c) − e_t) −
//!   g_r·(softmax(z_r) − e_t)‖_F / rows (g each run's arriving gradient of the loss,
//!   `{site}|grad.output.0`; the left-out rows are zero in both); own =
//!   `cross_entropy_grad_threshold` with g_r.
//!
//! Both runs' roundings are priced as a kernel of unknown order (`order=any` on both sides:
//! every order the family holds, on either side), the logits read in their stored format and
//! accumulated in FP32, the result rounded to its stored format. The threshold is carried +
//! own. The local model stays where the op does not apply: targets that differ between the
//! runs (they are judged themselves) or are not integers, a candidate whose logits or loss are
//! split or partial along a mesh axis of more than one rank other than the vocabulary's
//! (data parallelism: each rank's mean is over its own rows, which the merged loss does not
//! say), microbatches (a loss per microbatch), formats that differ between the runs, FP64, no
//! kept row, or more than [`WORK_LIMIT`] logits.

use crate::bounds::{cross_entropy_grad_threshold, cross_entropy_threshold, Confidence, Op};
use crate::check::price::OpMeasure;
use crate::format::Format;
use crate::io::TraceDir;
use crate::policy::Policy;
use crate::tensor::Tensor;
use crate::trace::id::{TensorId, TensorRole};
use crate::trace::{Axis, Placement};

/// The most logits (rows · vocabulary) a cross-entropy site is priced through the op with:
/// beyond it the local model prices it.
pub const WORK_LIMIT: usize = 1 << 24;

/// The kept rows of a site: logits [kept, vocab] and their targets.
struct Kept {
    rows: Vec<usize>,
    targets: Vec<usize>,
    vocab: usize,
}

/// The op measure of a cross-entropy site's loss or logits gradient `id`, or `None` where the
/// op does not apply (module docs); `delta` is the check's per-tensor failure probability.
pub(crate) fn measure(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    id: &str,
    delta: f64,
) -> Option<OpMeasure> {
    let t = TensorId::parse(id)?;
    let gradient = match t.role {
        TensorRole::FwdOutput(0) => false,
        TensorRole::GradInput(0) => true,
        _ => return None,
    };
    if reference.module(id)?.op? != Op::CrossEntropy {
        return None;
    }
    if candidate.manifest().microbatches() > 1 || reference.manifest().microbatches() > 1 {
        return None;
    }
    let site = &t.module;
    let (zid, tid) = (format!("{site}|fwd.input.0"), format!("{site}|fwd.input.1"));
    let (gid, lid) = (
        format!("{site}|grad.output.0"),
        format!("{site}|fwd.output.0"),
    );
    // Data or context parallelism: each rank's mean is over its own rows.
    let mesh = candidate.mesh_of(id).clone();
    let split = [&zid, &lid, id].into_iter().any(|i| {
        candidate.layout(i).is_some_and(|l| {
            mesh.axes().iter().any(|(a, n)| {
                *n > 1
                    && match l.along(a) {
                        Placement::Replicate => false,
                        // The vocabulary (the logits' last dimension) split over tensor-parallel
                        // ranks: a vocabulary-parallel loss, one mean over every row.
                        Placement::Split { dim: 1, .. } => !(*a == Axis::TP && *i != lid),
                        _ => true,
                    }
            })
        })
    });
    if split {
        return None;
    }
    let zshape = reference.logical_shape(&zid)?;
    let [rows, vocab] = zshape[..] else {
        return None;
    };
    if rows * vocab > WORK_LIMIT || reference.logical_shape(&tid)? != [rows] {
        return None;
    }
    let format = reference.dtype(&zid)?;
    let out = reference.dtype(id)?;
    if candidate.dtype(&zid)? != format || candidate.dtype(id)? != out {
        return None;
    }
    if format.precision() > Format::F32.precision() || out.precision() > Format::F32.precision() {
        return None;
    }
    let targets = reference.logical(&tid).ok()?;
    if candidate.logical(&tid).ok()?.values() != targets.values() {
        return None;
    }
    let kept = kept(targets.values(), vocab)?;
    let zr = reference.logical(&zid).ok()?;
    let zc = candidate.logical(&zid).ok()?;
    if zc.shape() != zr.shape() {
        return None;
    }
    let (r, c) = (rows_of(&zr, &kept), rows_of(&zc, &kept));
    let policy: Policy = format!("in={format},acc=f32,out={out},order=any")
        .parse()
        .ok()?;
    let confidence = Confidence::probabilistic(delta).ok()?;
    let logits = Tensor::from_vec(&[kept.rows.len(), vocab], r, format).ok()?;
    let r = logits.values();
    if gradient {
        let g = |dir: &mut TraceDir| -> Option<f64> {
            let t = dir.logical(&gid).ok()?;
            (t.len() == 1).then(|| t.values()[0])
        };
        let (gr, gc) = (g(reference)?, g(candidate)?);
        let n = kept.rows.len() as f64;
        let mut carried2 = 0.0;
        for (k, &target) in kept.targets.iter().enumerate() {
            let row = |z: &[f64]| softmax(&z[k * vocab..(k + 1) * vocab]);
            let (pr, pc) = (row(r), row(&c));
            for j in 0..vocab {
                let e = if j == target { 1.0 } else { 0.0 };
                let d = (gc * (pc[j] - e) - gr * (pr[j] - e)) / n;
                carried2 += d * d;
            }
        }
        let own =
            cross_entropy_grad_threshold(&logits, &kept.targets, gr, &policy, &policy, confidence)
                .ok()?;
        let m = OpMeasure {
            carried: carried2.sqrt(),
            own: own.abs_frobenius,
        };
        return (m.carried.is_finite() && m.own.is_finite()).then_some(m);
    }
    let loss = |z: &[f64]| -> f64 {
        let sum: f64 = kept
            .targets
            .iter()
            .enumerate()
            .map(|(k, &target)| {
                let row = &z[k * vocab..(k + 1) * vocab];
                lse(row) - row[target]
            })
            .sum();
        sum / kept.rows.len() as f64
    };
    let own = cross_entropy_threshold(&logits, &kept.targets, &policy, &policy, confidence).ok()?;
    let m = OpMeasure {
        carried: (loss(&c) - loss(r)).abs(),
        own: own.abs_frobenius,
    };
    (m.carried.is_finite() && m.own.is_finite()).then_some(m)
}

/// The rows whose target lies in the vocabulary (the others are left out, as torch's
/// `ignore_index` leaves them); `None` for a target that is not an integer or no kept row.
fn kept(targets: &[f64], vocab: usize) -> Option<Kept> {
    let mut k = Kept {
        rows: vec![],
        targets: vec![],
        vocab,
    };
    for (i, &t) in targets.iter().enumerate() {
        if t.fract() != 0.0 || !t.is_finite() {
            return None;
        }
        if t >= 0.0 && t < vocab as f64 {
            k.rows.push(i);
            k.targets.push(t as usize);
        }
    }
    (!k.rows.is_empty()).then_some(k)
}

/// The kept rows of [rows, vocab] logits, row-major.
fn rows_of(z: &Tensor, kept: &Kept) -> Vec<f64> {
    let v = kept.vocab;
    kept.rows
        .iter()
        .flat_map(|&i| z.values()[i * v..(i + 1) * v].iter().copied())
        .collect()
}

/// log Σ exp(z) in f64, shifted by the maximum.
fn lse(z: &[f64]) -> f64 {
    let m = z.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
    m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

/// softmax(z) in f64.
fn softmax(z: &[f64]) -> Vec<f64> {
    let l = lse(z);
    z.iter().map(|x| (x - l).exp()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_outside_the_vocabulary_are_left_out_and_fractions_refused() {
        let k = kept(&[3.0, -100.0, 0.0, 4.0], 4).unwrap();
        assert_eq!((k.rows, k.targets), (vec![0, 2], vec![3, 0]));
        assert!(kept(&[1.5], 4).is_none());
        assert!(kept(&[-100.0, -100.0], 4).is_none());
    }
}
