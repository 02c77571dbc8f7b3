//! The error of a tensor-core accumulation ([`Order::TensorCore`], alone or as the parts of a
//! split) and of an order of unknown kernel ([`Order::AnyOf`]).
//!
//! # Tensor cores (papers/bounds-reductions.md §2.5)
//! A tensor-core run is a function of its terms and of its configuration alone: every
//! truncation point follows from the exponents of the addends, and the accumulator's value
//! is the one the model computes. Given the data, the error of one execution is therefore
//! *determined*: [`ReductionError::mean`] is the emulated result minus the exact sum, and no
//! part of it is random. What the model cannot know — which blocking or split a vendor
//! kernel picks for a shape — is priced by a family of configurations ([`Order::AnyOf`]).
//!
//! The guaranteed bound holds for every input, step by step. With S the exact sum before a
//! block, G the bound so far on |c − S| (c the internal accumulator), q̄ = 2^(ē − F) where ē
//! is the largest alignment exponent of the block's products and of |S| + G:
//! * the products lose |tᵢ rem q| ≤ |tᵢ rem q̄| (q divides q̄: truncation toward zero to a
//!   multiple of q takes off t rem q, and (t rem q̄) rem q = t rem q);
//! * c loses less than q̄, and nothing when q̄ is at most the spacing of c's smallest
//!   possible binade (c has `acc_bits` significant bits);
//! * the block's sum T, a multiple of q ≥ q_ = 2^(e_ − F) (e_ from |S| − G), is exact in
//!   `acc_bits` bits when |T| < 2^acc_bits·q_, else loses less than 2^(1 − acc_bits)·|T|
//!   truncating (half that rounding to nearest), plus the accumulator's smallest spacing;
//! * promotion and split combinations round to nearest in their format: u·|value| each, the
//!   value bounded by the exact partial sums plus the errors so far (Higham 2002, Thm 2.2);
//! * independently of G, |c| ≤ M with M' = |T|max·(1 + r) + r_, |T|max ≤ M + Σ|tᵢ| of the
//!   block (truncation toward zero never grows a magnitude: r = r_ = 0; to nearest r = 2^−P
//!   and r_ half the smallest spacing). G is capped at M + |S| (|c − S| ≤ |c| + |S|), and the
//!   range check uses the smaller bound on |T|: with few accumulator bits the step-by-step
//!   bound grows by (1 + 2^(1−P)) per block and would otherwise report an overflow the sum
//!   cannot reach.

use crate::bounds::reduction::walk::two_sum;
use crate::bounds::reduction::{
    overflow_error, overflow_threshold, reduction_error_aligned, ReductionError,
};
use crate::error::Result;
use crate::format::{exponent_of, Format};
use crate::order::{
    part_range, reduce, truncate_to, Accumulation, AlignedTerms, Ctx, Order, TensorCoreSum,
};

/// Statistics of one execution of an order that contains a tensor core: the exact error of
/// the emulated execution as the determined part, the step-by-step guaranteed bound.
/// `exps[i]` is the alignment exponent of `terms[i]` (see `TensorCoreSum`).
pub(crate) fn tensor_core_error(
    terms: &[f64],
    exps: &[Option<i32>],
    acc: &Accumulation,
) -> Result<ReductionError> {
    let ctx = Ctx {
        acc: acc.accumulator,
        overflow: acc.overflow,
    };
    let (guaranteed, exact) = bound(&acc.order, terms, exps, acc)?;
    let emulated = reduce(
        &AlignedTerms::new(terms, exps),
        0..terms.len(),
        &acc.order,
        ctx,
    );
    if !emulated.is_finite() {
        return Err(overflow_error(
            acc.accumulator,
            emulated.abs(),
            "a tensor-core sum",
        ));
    }
    let mean = (emulated - exact.0) - exact.1;
    Ok(ReductionError {
        guaranteed,
        mean,
        variance: 0.0,
        // The subtraction above rounds twice in f64.
        tie_bound: 2.0 * f64::EPSILON * (emulated.abs() + mean.abs()),
    })
}

/// The exact sum of `terms` as an unevaluated pair (hi, lo).
fn exact_sum(terms: &[f64]) -> (f64, f64) {
    terms
        .iter()
        .fold((0.0, 0.0), |acc, &t| add_pair(acc, (t, 0.0)))
}

/// (guaranteed bound on the error, exact sum as (hi, lo)) of one execution of `order`.
fn bound(
    order: &Order,
    terms: &[f64],
    exps: &[Option<i32>],
    acc: &Accumulation,
) -> Result<(f64, (f64, f64))> {
    let f = acc.accumulator;
    match order {
        Order::TensorCore(tc) => {
            let chunk = tc.promote.unwrap_or(terms.len()).max(1);
            let (u, half_sub) = (f.unit_roundoff(), f.min_subnormal() / 2.0);
            let mut total = 0.0;
            let mut first = true;
            let mut prefix = (0.0, 0.0);
            for (ts, es) in terms.chunks(chunk).zip(exps.chunks(chunk)) {
                let (g, s) = run_bound(tc, ts, es, f)?;
                total += g;
                prefix = add_pair(prefix, s);
                // The run's result enters the register (exactly when the accumulator holds
                // acc_bits bits), or is added to it: one rounding to nearest each.
                if !first || tc.acc_bits > f.precision() {
                    let v = (prefix.0 + prefix.1).abs() + total;
                    check_range(f, v)?;
                    total += u * v + half_sub;
                }
                first = false;
            }
            Ok((total * (1.0 + 1e-12), prefix))
        }
        Order::SplitK {
            parts,
            inner,
            partial,
            ..
        } => {
            let (u, half_sub) = (partial.unit_roundoff(), partial.min_subnormal() / 2.0);
            let rounds = !inner.result_format(f).is_subset_of(*partial);
            let (mut total, mut abs, mut exact) = (0.0, 0.0, (0.0, 0.0));
            for j in 0..*parts {
                let r = part_range(j, *parts, terms.len());
                let inner_acc = Accumulation {
                    order: (**inner).clone(),
                    ..acc.clone()
                };
                let (mut g, s) = if inner.has_tensor_core() {
                    bound(inner, &terms[r.clone()], &exps[r.clone()], &inner_acc)?
                } else {
                    let e = reduction_error_aligned(&terms[r.clone()], None, &inner_acc, false)?;
                    (e.guaranteed, exact_sum(&terms[r]))
                };
                let v = (s.0 + s.1).abs();
                if rounds {
                    g += u * (v + g) + half_sub;
                }
                total += g;
                abs += v + g;
                exact = add_pair(exact, s);
            }
            // parts − 1 additions, whatever their order: each rounds a value of magnitude at
            // most Σ|partials| plus the errors so far.
            for _ in 1..*parts {
                check_range(*partial, abs + total)?;
                total += u * (abs + total) + half_sub;
            }
            Ok((total * (1.0 + 1e-12), exact))
        }
        other => {
            let a = Accumulation {
                order: other.clone(),
                ..acc.clone()
            };
            let e = reduction_error_aligned(terms, None, &a, false)?;
            Ok((e.guaranteed, exact_sum(terms)))
        }
    }
}

fn add_pair(a: (f64, f64), b: (f64, f64)) -> (f64, f64) {
    let (s, err) = two_sum(a.0, b.0);
    (s, a.1 + b.1 + err)
}

fn check_range(f: Format, magnitude: f64) -> Result<()> {
    if magnitude >= overflow_threshold(f) || !magnitude.is_finite() {
        return Err(overflow_error(f, magnitude, "a tensor-core partial sum"));
    }
    Ok(())
}

fn exponent(v: f64) -> Option<i32> {
    if v > 0.0 && v.is_finite() {
        Some(exponent_of(v))
    } else {
        None
    }
}

fn max_opt(a: Option<i32>, b: Option<i32>) -> Option<i32> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// The guaranteed bound of one run of the internal accumulator over `terms` (from 0), with
/// the exact sum (module docs).
fn run_bound(
    tc: &TensorCoreSum,
    terms: &[f64],
    exps: &[Option<i32>],
    f: Format,
) -> Result<(f64, (f64, f64))> {
    let p = tc.acc_bits as i32;
    let eps = match tc.rounding {
        crate::order::AccRounding::Truncate => crate::format::pow2(1 - p),
        crate::order::AccRounding::Nearest => crate::format::pow2(-p),
    };
    let spacing = f.min_subnormal();
    // How much larger than |T| the accumulator can be after rounding T (module docs).
    let (grow, grow_floor) = match tc.rounding {
        crate::order::AccRounding::Truncate => (0.0, 0.0),
        crate::order::AccRounding::Nearest => (crate::format::pow2(-p), spacing / 2.0),
    };
    let mut s = (0.0f64, 0.0f64);
    let mut g = 0.0f64;
    // A bound on |c| from magnitudes alone, independent of g.
    let mut m = 0.0f64;
    let mut processed = 0usize;
    for (ts, es) in terms.chunks(tc.block).zip(exps.chunks(tc.block)) {
        let a_blk = es.iter().copied().fold(None, max_opt);
        let s_abs = (s.0 + s.1).abs();
        let (c_hi, c_lo) = ((s_abs + g).min(m), s_abs - g);
        let e_hi = max_opt(a_blk, exponent(c_hi));
        let Some(e_hi) = e_hi else {
            // No addend and a zero accumulator: nothing happens.
            continue;
        };
        let q_hi = tc.quantum(e_hi);
        let mut lost = 0.0;
        for &t in ts {
            lost += (t - truncate_to(t, q_hi)).abs();
        }
        lost *= 1.0 + ts.len() as f64 * f64::EPSILON;
        let c_err = if c_hi == 0.0 {
            0.0
        } else {
            match exponent(c_lo) {
                Some(e) if q_hi <= crate::format::pow2((e - p + 1).max(-1074)).max(spacing) => 0.0,
                _ => q_hi.min(c_hi),
            }
        };
        let block = exact_sum(ts);
        let next = add_pair(s, block);
        let abs: f64 =
            ts.iter().map(|t| t.abs()).sum::<f64>() * (1.0 + ts.len() as f64 * f64::EPSILON);
        let t_max = ((next.0 + next.1).abs() + g + lost + c_err).min(m + abs);
        check_range(f, t_max)?;
        let e_lo = max_opt(a_blk, exponent(c_lo));
        let q_lo = e_lo.map_or(spacing, |e| tc.quantum(e));
        let fits = t_max < q_lo * crate::format::pow2(p);
        let final_err = if fits { 0.0 } else { eps * t_max } + spacing;
        m = (t_max * (1.0 + grow) + grow_floor) * (1.0 + 2.0 * f64::EPSILON);
        s = next;
        // |c − S| ≤ |c| + |S|: the step-by-step bound never exceeds what magnitudes allow.
        g = (g + lost + c_err + final_err).min(m + (s.0 + s.1).abs() * (1.0 + f64::EPSILON));
        processed += 1;
    }
    // Every step's bound was summed in f64 (one rounding each).
    Ok((g * (1.0 + (processed as f64 + 1.0) * f64::EPSILON), s))
}

/// The statistics of an order of unknown kernel: every member's, merged so that each
/// member's determined part lies within mean ± tie_bound, with the largest guaranteed bound
/// and variance. A split-K whose parts run a family is the family of split-Ks whose parts all
/// run the same member (parts of one shape get one kernel).
pub(crate) fn family_error(
    terms: &[f64],
    exps: Option<&[Option<i32>]>,
    acc: &Accumulation,
    is_dot: bool,
    members: &[Order],
) -> Result<ReductionError> {
    let mut stats = Vec::with_capacity(members.len());
    for m in members {
        let a = Accumulation {
            order: m.clone(),
            ..acc.clone()
        };
        stats.push(reduction_error_aligned(terms, exps, &a, is_dot)?);
    }
    Ok(merge_family(&stats))
}

/// Merge the statistics of a family's members (see [`family_error`]).
pub(crate) fn merge_family(stats: &[ReductionError]) -> ReductionError {
    let lo = stats.iter().map(|e| e.mean).fold(f64::INFINITY, f64::min);
    let hi = stats
        .iter()
        .map(|e| e.mean)
        .fold(f64::NEG_INFINITY, f64::max);
    if !(lo.is_finite() && hi.is_finite()) {
        return ReductionError::default();
    }
    let mid = lo + (hi - lo) / 2.0;
    let guaranteed = stats.iter().map(|e| e.guaranteed).fold(0.0, f64::max);
    ReductionError {
        guaranteed,
        mean: mid,
        variance: stats.iter().map(|e| e.variance).fold(0.0, f64::max),
        tie_bound: stats.iter().map(|e| e.tie_bound).fold(0.0, f64::max)
            + (hi - lo) / 2.0 * (1.0 + f64::EPSILON),
    }
}

/// A split-K whose inner order is a family, as the family of split-Ks (see
/// [`family_error`]); `None` when the order holds no nested family.
pub(crate) fn lift_family(order: &Order) -> Option<Vec<Order>> {
    order.has_family().then(|| order.members())
}
