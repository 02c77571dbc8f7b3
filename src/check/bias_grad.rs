//! The element test of a linear layer's bias gradient, from its arriving gradient.
//!
//! A linear layer's bias gradient sums its arriving gradient over the tokens, gᵢ = Σₜ dyₜᵢ
//! (dY `T × out`, T the tokens of every leading dimension). Where the trace holds dY of both
//! runs, each element's difference is known up to the runs' own roundings, and a bias
//! corrupted in a few elements — the NCCL #1950 class on the smallest tensors of a layer — is
//! found where the norm over the whole gradient, or the pooled sparse test (which leaves
//! parameter gradients alone, `verdict::detect`), cannot see it. The bound is **guaranteed**:
//!
//! * with Sᵢ = Σₜ dyₜᵢ and Aᵢ = Σₜ |dyₜᵢ| of each run's recorded dY (evaluated in `f64`), the
//!   runs' exact sums differ by S_c − S_r, so the test is on |Dᵢ − (S_c − S_r)ᵢ|;
//! * a run that rounds dY to a coarser format q first (autocast) moves its sum by at most
//!   u_q·A + T·λ_q/2 and its terms' magnitudes by a factor 1 + u_q (plus λ_q/2 each) — allowed
//!   whether it rounds or not;
//! * each run sums in any order in its accumulation format: γ_T·Σ|terms| (Higham, *Accuracy
//!   and Stability of Numerical Algorithms*, 2nd ed., Lemma 3.1), and P partial sums over
//!   ranks that split the tokens, rounded and added in the output format, γ_P·(1 + γ_T)·Σ|terms|
//!   more (`weight_grad::kernel_coefficients`);
//! * each rounds its result to the output format: u_out·(1 + 2u_out)·|g| + λ_out/2;
//! * where the candidate's dY is read divided by the data-parallel divisor (a local-mean loss,
//!   `check::loss`), its quotients are rounded again (u_s·A + T·λ_s/2 in dY's stored format s,
//!   λ alone for a power of two) and the engine's division of the gradient rounds once more.
//!
//! As for the weight gradient (`check::weight_grad`, whose conditions this shares: one call of
//! the layer, no FP8), the reference's own gradient is first checked to be its dY's sum
//! within the same bound: a bias shared with another module, a gradient rescaled or
//! accumulated over steps, or a dY that is not this gradient's, takes the test off.
//! `papers/checking.md` §7.

use crate::check::weight_grad::{
    arithmetic, coarsest, gradient_of, kernel_coefficients, read_pair, setting, within_spacing,
    Arithmetic, MAX_LISTED,
};
use crate::format::Format;
use crate::io::TraceDir;
use crate::policy::Recipe;
use crate::trace::id::TensorId;
use crate::trace::stored::Stored;
use crate::verdict::{Detector, Finding};

/// Values decoded at a time.
const PIECE: usize = 1 << 14;

/// The column sums of an arriving-gradient pair (its last dimension's indices are the
/// columns), evaluated in `f64`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sums {
    /// Rows: the elements over the columns (the tokens T).
    pub(crate) rows: usize,
    /// Σₜ rₜᵢ and Σₜ |rₜᵢ| (the reference's).
    pub(crate) reference: (Vec<f64>, Vec<f64>),
    /// Σₜ cₜᵢ and Σₜ |cₜᵢ| (the candidate's).
    pub(crate) candidate: (Vec<f64>, Vec<f64>),
}

/// The column sums of a pair stored with `cols` columns, in one pass. `None` when a value is
/// not finite or the shapes do not hold whole rows.
pub(crate) fn sums((r, c): (&Stored, &Stored), cols: usize) -> Option<Sums> {
    if cols == 0 || r.len() != c.len() || r.len() % cols != 0 {
        return None;
    }
    let zero = || (vec![0.0; cols], vec![0.0; cols]);
    let (mut rs, mut cs) = (zero(), zero());
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let step = PIECE.max(cols) / cols * cols;
    for start in (0..r.len()).step_by(step) {
        let end = (start + step).min(r.len());
        r.decode_range(start, end, &mut a);
        c.decode_range(start, end, &mut b);
        for (ra, cb) in a.chunks_exact(cols).zip(b.chunks_exact(cols)) {
            for (k, (&x, &y)) in ra.iter().zip(cb).enumerate() {
                rs.0[k] += x;
                rs.1[k] += x.abs();
                cs.0[k] += y;
                cs.1[k] += y.abs();
            }
        }
    }
    let finite = |v: &[f64]| v.iter().all(|x| x.is_finite());
    (finite(&rs.1) && finite(&cs.1)).then_some(Sums {
        rows: r.len() / cols,
        reference: rs,
        candidate: cs,
    })
}

/// One run's allowance for its own sum of `abs` = Σ|dy| (see the module docs), without the
/// final rounding: k·((1 + u_q)·A + T·λ_q/2) + u_q·A + T·λ_q/2, plus the `f64` evaluation's
/// error γ_T(f64)·A (twice: the sum and the magnitudes).
fn run_allowance(k: f64, q: Option<Format>, rows: usize, abs: f64) -> f64 {
    let (u, l) = q.map_or((0.0, 0.0), |q| (q.unit_roundoff(), q.min_subnormal()));
    let moved = u * abs + rows as f64 * l / 2.0;
    let evaluation = 2.0 * Format::F64.gamma(rows).unwrap_or(f64::INFINITY) * abs;
    k * ((1.0 + u) * abs + rows as f64 * l / 2.0) + moved + evaluation
}

/// Whether the reference's bias gradient `g` is the sum of its recorded arriving gradient,
/// every element within its run's allowance plus its final rounding.
pub(crate) fn consistent(g: &Stored, dy: &Sums, arith: &Arithmetic) -> bool {
    let Some((k_ref, _)) = kernel_coefficients(arith, dy.rows) else {
        return false;
    };
    if g.len() != dy.reference.0.len() {
        return false;
    }
    let (u, l) = (arith.out.unit_roundoff(), arith.out.min_subnormal());
    let mut vals = Vec::new();
    g.decode_range(0, g.len(), &mut vals);
    vals.iter()
        .zip(dy.reference.0.iter().zip(&dy.reference.1))
        .all(|(&v, (&s, &a))| {
            let allowed = run_allowance(k_ref, arith.quantize.0, dy.rows, a)
                + u * (1.0 + 2.0 * u) * v.abs()
                + l / 2.0;
            v.is_finite() && (v - s).abs() <= allowed * (1.0 + 1e-9)
        })
}

/// The element test of the pair of bias gradients `(r, c)` with their arriving gradients'
/// column sums `dy`: every element's |Dᵢ − (S_c − S_r)ᵢ| against its bound. The finding's
/// estimate is the worst element's excess over its scale A_r (Σ|dy| of the reference) in ε,
/// its threshold that element's bound in ε, the ratio their quotient; beside it, the indices
/// of the elements beyond their bounds (the first [`MAX_LISTED`]). `None` when the bound does
/// not exist (γ_T undefined) or the shapes do not fit.
pub(crate) fn element_test(
    r: &Stored,
    c: &Stored,
    dy: &Sums,
    arith: &Arithmetic,
    eps: f64,
) -> Option<(Finding, Vec<usize>)> {
    let n = dy.reference.0.len();
    if r.len() != n || c.len() != n {
        return None;
    }
    let (k_ref, k_cand) = kernel_coefficients(arith, dy.rows)?;
    let spacing_format = coarsest(&[arith.out, r.format(), c.format()]);
    let (u, l) = (
        spacing_format.unit_roundoff(),
        spacing_format.min_subnormal(),
    );
    let (mut a, mut b) = (Vec::new(), Vec::new());
    r.decode_range(0, n, &mut a);
    c.decode_range(0, n, &mut b);
    // The candidate's read quotients of a divided dY lie this far from the exact ones.
    let read = arith.read_rounding();
    let mut worst: Option<(f64, usize, f64, f64)> = None; // (ratio, at, excess, bound)
    let mut listed = Vec::new();
    let mut count = 0usize;
    for i in 0..n {
        let (rv, cv) = (a[i], b[i]);
        let excess = ((cv - rv) - (dy.candidate.0[i] - dy.reference.0[i])).abs();
        if !excess.is_finite() {
            return None;
        }
        let a_c = dy.candidate.1[i];
        let bound = (run_allowance(k_ref, arith.quantize.0, dy.rows, dy.reference.1[i])
            + run_allowance(k_cand, arith.quantize.1, dy.rows, a_c)
            + read.0 * a_c
            + dy.rows as f64 * read.1
            + 2.0 * u * rv.abs().max(cv.abs()) * (1.0 + 2.0 * u)
            + l
            + arith.division_rounding(cv))
            * (1.0 + 1e-9);
        if excess > bound {
            count += 1;
            if listed.len() < MAX_LISTED {
                listed.push(i);
            }
        }
        let ratio = if bound > 0.0 { excess / bound } else { 0.0 };
        if worst.is_none_or(|w| ratio > w.0) {
            worst = Some((ratio, i, excess, bound));
        }
    }
    let (ratio, at, excess, bound) = worst.unwrap_or((0.0, 0, 0.0, 0.0));
    let scale = dy
        .reference
        .1
        .get(at)
        .copied()
        .unwrap_or(0.0)
        .max(f64::MIN_POSITIVE);
    let finding = Finding {
        detector: Detector::Sparse,
        estimate: excess / scale / eps,
        threshold: bound / scale / eps,
        ratio,
        fired: count > 0,
        at: worst.map(|w| w.1),
        count,
    };
    Some((finding, listed))
}

/// The element test of the bias gradient `id` compared as `(r, c)`, where it applies: a
/// linear layer's bias, called once, whose arriving gradient both traces hold, in formats
/// other than FP8, and whose reference gradient is that gradient's sum; with the elements
/// beyond their bounds (see [`element_test`]).
pub(crate) fn finding(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    id: &str,
    (r, c): (&Stored, &Stored),
    recipe: Option<&Recipe>,
    eps: f64,
) -> Option<(Finding, Vec<usize>)> {
    let module = gradient_of(id, "bias", 1, (r, c))?;
    let dy_id = TensorId::grad_output(&module, 0).to_string();
    let setting = setting(reference, candidate, id, &module, &[&dy_id], (r, c), recipe)?;
    if let Some(f) = within_spacing(r, c, setting.out, eps) {
        // No element differs by more than the final roundings allow: nothing to find, and dY
        // need not be read. (An element whose dY moved while it did not is the dY's finding.)
        return Some((f, Vec::new()));
    }
    let cols = r.shape()[0];
    let (dy, dy_ranks) = read_pair(reference, candidate, &dy_id, cols, |a, b| {
        sums((a, b), cols)
    })?;
    let arith = arithmetic(
        reference,
        candidate,
        id,
        &setting,
        &[(&dy_id, dy_ranks)],
        &dy_id,
    );
    if !consistent(r, &dy, &arith) {
        return None;
    }
    element_test(r, c, &dy, &arith, eps)
}

#[cfg(test)]
mod tests;
