//! How the candidate's data-parallel ranks normalized their loss, settled from the reference
//! where the tracer did not know ([`DpLoss::Auto`]).
//!
//! Under data parallelism each rank's loss covers its share of the batch. If it is normalized
//! by the global count (tokens or samples of the whole batch), the ranks' activation gradients
//! are the reference's, split along the batch; if each rank averages over its own share (the
//! usual DDP / FSDP loop), they are dp times the reference's. Both are correct training — the
//! engine's gradient reduction (a mean or a sum over dp) makes the parameter gradients agree —
//! and nothing in one rank's trace tells them apart. The reference does: the first few
//! loss-dependent gradients of the backward pass (those nearest the loss, before a bug deep
//! in the model could mix into them) are compared both ways, and the hypothesis whose relative
//! Frobenius difference is smaller is taken for the whole trace. A planted scale of exactly dp
//! on every activation gradient is indistinguishable from the other normalization and is not
//! found; any other factor (a per-rank token count, Megatron-LM #7452) is, since neither
//! hypothesis then fits.

use serde::Serialize;

use crate::error::Result;
use crate::io::{DpLoss, TraceDir};

/// How many loss-dependent gradients settle the normalization.
const PROBES: usize = 4;

/// How the candidate's data-parallel ranks normalized their loss, as the checker settled it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LossNormalization {
    /// Each rank averaged its loss over its own share of the batch: the loss-dependent
    /// tensors (activation gradients split along dp, scalars summed over dp) were read divided
    /// by `dp`. Else normalized by the global count: read as stored.
    pub local_mean: bool,
    /// The data-parallel size.
    pub dp: usize,
    /// The gradients compared, in execution order (empty when none could be: then read as
    /// stored).
    pub tensors: Vec<String>,
    /// ‖c/dp − r‖/‖r‖ over them.
    pub error_local: f64,
    /// ‖c − r‖/‖r‖ over them.
    pub error_global: f64,
}

impl LossNormalization {
    /// The finding in words.
    pub fn describe(&self) -> String {
        let dp = self.dp;
        if self.tensors.is_empty() {
            return format!(
                "loss normalization under data parallelism (dp = {dp}) not stated by the \
                 tracer and not settled (no activation gradient to compare): read as stored"
            );
        }
        let how = if self.local_mean {
            format!(
                "each rank averaged its loss over its own share of the batch: activation \
                 gradients read divided by dp = {dp}"
            )
        } else {
            "the loss was normalized by the global batch: activation gradients read as stored"
                .to_string()
        };
        format!(
            "loss normalization settled from the reference (the tracer did not know): {how} \
             (relative difference {:.2e} divided, {:.2e} as stored, over {} gradient{} from {})",
            self.error_local,
            self.error_global,
            self.tensors.len(),
            if self.tensors.len() == 1 { "" } else { "s" },
            self.tensors[0]
        )
    }
}

/// Settle the candidate's loss normalization when its manifest leaves it to the checker, and
/// set `candidate` to read its loss-dependent tensors accordingly. `None` when the manifest
/// states it (or there is no data parallelism).
pub(crate) fn settle_dp_loss(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
) -> Result<Option<LossNormalization>> {
    let dp = candidate.manifest().mesh.dp;
    if candidate.manifest().dp_loss != Some(DpLoss::Auto) || dp < 2 {
        return Ok(None);
    }
    candidate.set_dp_divisor(None);
    let ids: Vec<String> = candidate
        .ids()
        .iter()
        .filter(|id| {
            crate::engine::TensorId::parse(id)
                .is_some_and(|t| t.pass() == crate::policy::Pass::Backward)
                && candidate
                    .layout(id)
                    .is_some_and(|l| TraceDir::loss_dependent(id, &l))
                && reference.layout(id).is_some()
        })
        .cloned()
        .collect();
    let (mut local, mut global, mut norm) = (0.0f64, 0.0f64, 0.0f64);
    let mut used = vec![];
    for id in ids {
        if used.len() == PROBES {
            break;
        }
        // A tensor whose shards do not merge is judged (and reported) by the check itself.
        let (Ok(r), Ok(c)) = (reference.logical_stored(&id), candidate.logical_stored(&id)) else {
            continue;
        };
        if r.shape() != c.shape() {
            continue;
        }
        let (r, c) = (r.decode(), c.decode());
        let (mut l, mut g, mut n) = (0.0, 0.0, 0.0);
        for (&x, &y) in r.values().iter().zip(c.values()) {
            if !(x.is_finite() && y.is_finite()) {
                continue;
            }
            l += (y / dp as f64 - x).powi(2);
            g += (y - x).powi(2);
            n += x * x;
        }
        if n > 0.0 {
            (local, global, norm) = (local + l, global + g, norm + n);
            used.push(id);
        }
    }
    let found = !used.is_empty();
    let local_mean = found && local < global;
    candidate.set_dp_divisor(local_mean.then_some(dp));
    let rel = |x: f64| if found { (x / norm).sqrt() } else { f64::NAN };
    Ok(Some(LossNormalization {
        local_mean,
        dp,
        tensors: used,
        error_local: rel(local),
        error_global: rel(global),
    }))
}
