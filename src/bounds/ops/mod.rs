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
use crate::order::{product_exponent, Accumulation, Products};
use crate::policy::Policy;
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

pub use crate::bounds::checked::MODEL_CHECK_DELTA;
use crate::bounds::checked::{checked_by_executions, each_member};
