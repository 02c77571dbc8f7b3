//! Comparison thresholds for whole ops: matmul / linear (with FP8 quantization), sum, mean and
//! all-reduce, from the actual data (checking) or from summary statistics (planning).
//!
//! Each function prices "reference policy vs candidate policy on the same logical inputs", with
//! the exact arithmetic the engine performs (`engine::matmul`, `engine::nn`): the reduction,
//! then the trailing roundings (FP8 rescale in the accumulator format, bias addition, output
//! rounding).

use crate::bounds::compare::{
    grouped_threshold, residue_clusters, row_classes, tensor_threshold_weighted, Confidence,
    ElementDiff, Threshold, ThresholdSums,
};
use crate::bounds::fast::{Epilogue, FastSide, Right};
use crate::bounds::reduction::{
    planned_reduction_error, reduction_error, reduction_error_aligned, ReductionError, TermStats,
};
use crate::error::{Error, Result};
use crate::exact::ExactAccumulator;
use crate::format::Format;
use crate::order::{product_exponent, Accumulation, Order, Products};
use crate::policy::Policy;
use crate::policy::{quantize, Quantized};
use crate::tensor::Tensor;

mod matmul;
pub(crate) mod output;
mod plan;
mod sum;

pub use crate::bounds::op::model::Pricing;
pub use matmul::{matmul_threshold, matmul_threshold_priced, MatmulModel};
pub(crate) use output::{check_output, round_sides};
pub use plan::{plan_matmul, plan_sum, MatmulPlan};
use sum::*;
pub use sum::{allreduce_threshold, sum_threshold, sum_threshold_priced, AllReduceModel, SumModel};

fn scaled(e: ReductionError, f: f64) -> ReductionError {
    ReductionError {
        guaranteed: e.guaranteed * f.abs(),
        mean: e.mean * f,
        variance: e.variance * f * f,
        tie_bound: e.tie_bound * f.abs(),
    }
}

/// The most multiply-adds (over classes of identical rows of A and columns of B) that
/// [`Pricing::Auto`] and [`Pricing::Fast`] hand to the walk when the pass declines a
/// probabilistic threshold (structured data): 2²⁵, about 20 s on one thread at the walk's
/// 250 ns per multiply-add and side. Beyond it the pass's guaranteed threshold is returned
/// (`Threshold::confidence` is then [`Confidence::Guaranteed`]): an op of 4096³ would take
/// the walk about ten hours.
pub const WALK_BUDGET: u128 = 1 << 25;

/// The failure probability at which the engine's executions of the two declared orders test
/// the model behind a probabilistic threshold (`checked_by_executions`).
pub const MODEL_CHECK_DELTA: f64 = 1e-3;

/// Whether an order is a family (its executions are not one order).
fn is_family(order: &Order) -> bool {
    match order {
        Order::AnyOf(_) => true,
        Order::SplitK { inner, .. } => is_family(inner),
        _ => false,
    }
}

/// A probabilistic threshold that the engine's own executions of the two declared orders
/// (`executions`: both sides' outputs, or `None` where they cannot be run) check first. Under
/// the random-rounding model their difference stays within the model's threshold at
/// δ_s = min(δ, [`MODEL_CHECK_DELTA`]) but with probability δ_s; where it does not (the tensor
/// norm or one element), these data are structured in a way the model does not capture —
/// undetermined roundings that move together across elements, as near-constant products do —
/// and the guaranteed threshold is returned instead, marked [`Confidence::Guaranteed`]. A
/// threshold at δ therefore never falls below the difference of the declared executions, and
/// on data the model fits it is the model's (a spurious fallback has probability δ_s).
fn checked_by_executions(
    confidence: Confidence,
    build: &dyn Fn(Confidence) -> Threshold,
    executions: &dyn Fn() -> Option<(Vec<f64>, Vec<f64>)>,
) -> Threshold {
    let Confidence::Probabilistic { delta } = confidence else {
        return build(confidence);
    };
    let threshold = build(confidence);
    let Some((r, c)) = executions() else {
        return threshold;
    };
    if r.len() != c.len() || !r.iter().chain(&c).all(|v| v.is_finite()) {
        return threshold;
    }
    let (mut sq, mut max) = (0.0f64, 0.0f64);
    for (x, y) in r.iter().zip(&c) {
        let d = (y - x).abs();
        sq += d * d;
        max = max.max(d);
    }
    let check = build(Confidence::Probabilistic {
        delta: delta.min(MODEL_CHECK_DELTA),
    });
    if sq.sqrt() > check.abs_frobenius || max > check.per_element {
        build(Confidence::Guaranteed)
    } else {
        threshold
    }
}
