//! How the candidate's data-parallel ranks normalized their loss, settled from the reference
//! where the tracer did not know ([`DpLoss::Auto`]).
//!
//! Under data parallelism each rank's loss covers its share of the batch; under context
//! parallelism, its share of each sequence. If it is normalized by the global count (tokens or
//! samples of the whole batch), the ranks' activation gradients are the reference's, split
//! along the batch (and the sequence); if each rank averages over its own share (the usual
//! DDP / FSDP / torchtitan loop), they are dp·cp times the reference's — or dp or cp times,
//! where the engine averages over one axis and counts globally over the other. All are
//! correct training — the engine's gradient reduction makes the parameter gradients agree —
//! and nothing in one rank's trace tells them apart. The reference does: the first few
//! loss-dependent gradients of the backward pass (those nearest the loss, before a bug deep
//! in the model could mix into them) are compared read as stored and divided by each of
//! dp·cp, dp and cp, and the reading whose relative Frobenius difference is smallest is taken
//! for the whole trace. A planted scale of exactly one of those factors on every activation
//! gradient is indistinguishable from that normalization and is not found; any other factor
//! (a per-rank token count, Megatron-LM #7452) is, since no reading then fits.
//!
//! A trace of M microbatches (a pipeline schedule, gradient accumulation) adds one more
//! choice: each microbatch's loss may be its own mean (torch's pipeline schedules with
//! `scale_grads`, which divide the accumulated parameter gradients by M at the end), making
//! every activation gradient M times the reference's, or the global mean's share (torchtitan
//! rescales each microbatch's loss by 1/M). The readings are then those above times 1 or M.

use serde::Serialize;

use crate::error::Result;
use crate::io::{DpLoss, TraceDir};
use crate::trace::Axis;

/// How many loss-dependent gradients settle the normalization.
const PROBES: usize = 4;

/// How the candidate's data-parallel ranks normalized their loss, as the checker settled it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LossNormalization {
    /// Each rank averaged its loss over its own share of the batch (or of the sequence): the
    /// loss-dependent tensors (activation gradients split along dp or cp, scalars summed over
    /// them) were read divided by `divisor`. Else normalized by the global count: read as
    /// stored.
    pub local_mean: bool,
    /// The data-parallel size.
    pub dp: usize,
    /// The context-parallel size.
    pub cp: usize,
    /// The microbatches each step ran as (1: none).
    pub microbatches: usize,
    /// What the loss-dependent tensors were read divided by: dp·cp, dp or cp for a local mean,
    /// 1 for the global count — times the microbatches where each microbatch's loss was its
    /// own mean.
    pub divisor: usize,
    /// The gradients compared, in execution order (empty when none could be: then read as
    /// stored).
    pub tensors: Vec<String>,
    /// ‖c/(dp·cp·M) − r‖/‖r‖ over them (M the microbatches).
    pub error_local: f64,
    /// ‖c − r‖/‖r‖ over them.
    pub error_global: f64,
    /// ‖c/divisor − r‖/‖r‖ over them, for the divisor taken.
    pub error_chosen: f64,
}

impl LossNormalization {
    /// The finding in words.
    pub fn describe(&self) -> String {
        let mut ranks = match (self.dp, self.cp) {
            (1, 1) => String::new(),
            (dp, 1) => format!("dp = {dp}"),
            (1, cp) => format!("cp = {cp}"),
            (dp, cp) => format!("dp = {dp}, cp = {cp}"),
        };
        if self.microbatches > 1 {
            let mb = format!("{} microbatches", self.microbatches);
            ranks = if ranks.is_empty() {
                mb
            } else {
                format!("{ranks}, {mb}")
            };
        }
        if self.tensors.is_empty() {
            return format!(
                "loss normalization under data parallelism or microbatches ({ranks}) not \
                 stated by the \
                 tracer and not settled (no activation gradient to compare): read as stored"
            );
        }
        let how = if self.local_mean && self.dp * self.cp == 1 {
            format!(
                "each microbatch's loss was its own mean ({ranks}): activation gradients read \
                 divided by {}",
                self.divisor
            )
        } else if self.local_mean {
            let share = if self.cp > 1 {
                "its own share of the batch's tokens"
            } else {
                "its own share of the batch"
            };
            format!(
                "each rank averaged its loss over {share} ({ranks}): activation gradients \
                 read divided by {}",
                self.divisor
            )
        } else {
            "the loss was normalized by the global batch: activation gradients read as stored"
                .to_string()
        };
        // The reading taken, and the other that matters: as stored for a local mean, the
        // widest local mean for the global count.
        let (other, at) = if self.local_mean {
            (self.error_global, 1)
        } else {
            (self.error_local, self.dp * self.cp * self.microbatches)
        };
        let read = |d: usize| {
            if d == 1 {
                "as stored".to_string()
            } else {
                format!("divided by {d}")
            }
        };
        format!(
            "loss normalization settled from the reference (the tracer did not know): {how} \
             (relative difference {:.2e} {}, {:.2e} {}, over {} gradient{} from {})",
            self.error_chosen,
            read(self.divisor),
            other,
            read(at),
            self.tensors.len(),
            if self.tensors.len() == 1 { "" } else { "s" },
            self.tensors[0]
        )
    }
}

/// Settle the candidate's loss normalization when its manifest leaves it to the checker, and
/// set `candidate` to read its loss-dependent tensors accordingly. `None` when the manifest
/// states it (or there is neither data nor context parallelism).
pub(crate) fn settle_dp_loss(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
) -> Result<Option<LossNormalization>> {
    let mesh = &candidate.manifest().mesh;
    let (dp, cp) = (mesh.size(&Axis::DP), mesh.size(&Axis::CP));
    let m = candidate.manifest().microbatches();
    if candidate.manifest().dp_loss != Some(DpLoss::Auto) || dp * cp * m < 2 {
        return Ok(None);
    }
    candidate.set_dp_divisor(None);
    // In the reference's order, which is execution order (a pipelined candidate lists each
    // stage's tensors apart).
    let ids: Vec<String> = reference
        .ids()
        .iter()
        .filter(|id| {
            crate::trace::TensorId::parse(id)
                .is_some_and(|t| t.pass() == crate::policy::Pass::Backward)
                && candidate
                    .layout(id)
                    .is_some_and(|l| candidate.loss_dependent(id, &l))
                && candidate.contains(id)
        })
        .cloned()
        .collect();
    // The readings: as stored first (ties keep it), then the local means, widest first, each
    // with the microbatches' own means or without.
    let mut divisors: Vec<usize> = vec![];
    for d in [1, dp * cp, dp, cp] {
        for k in [1, m] {
            if !divisors.contains(&(d * k)) {
                divisors.push(d * k);
            }
        }
    }
    let mut sq = vec![0.0f64; divisors.len()];
    let mut norm = 0.0f64;
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
        let mut s = vec![0.0f64; divisors.len()];
        let mut n = 0.0;
        for (&x, &y) in r.values().iter().zip(c.values()) {
            if !(x.is_finite() && y.is_finite()) {
                continue;
            }
            for (acc, &d) in s.iter_mut().zip(&divisors) {
                *acc += (y / d as f64 - x).powi(2);
            }
            n += x * x;
        }
        if n > 0.0 {
            for (total, x) in sq.iter_mut().zip(s) {
                *total += x;
            }
            norm += n;
            used.push(id);
        }
    }
    let found = !used.is_empty();
    let best = if found {
        (0..divisors.len()).fold(0, |b, i| if sq[i] < sq[b] { i } else { b })
    } else {
        0
    };
    let divisor = divisors[best];
    candidate.set_dp_divisor((divisor > 1).then_some(divisor));
    let rel = |x: f64| if found { (x / norm).sqrt() } else { f64::NAN };
    let at = |d: usize| {
        divisors
            .iter()
            .position(|&x| x == d)
            .map_or(f64::NAN, |i| rel(sq[i]))
    };
    Ok(Some(LossNormalization {
        local_mean: divisor > 1,
        dp,
        cp,
        microbatches: m,
        divisor,
        tensors: used,
        error_local: at(dp * cp * m),
        error_global: at(1),
        error_chosen: rel(sq[best]),
    }))
}
