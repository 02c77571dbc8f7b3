//! The localizer: re-run every module of the sharded model on the *reference's own* inputs
//! (forward: its traced inputs; backward: its traced inputs and output gradient), so that an
//! error carried in from an earlier module cannot mask where a wrong result is born, and
//! report the first module — in execution order, forward then backward — whose own output
//! fails its *local* threshold (the difference its own arithmetic may add on identical inputs,
//! zero where the sharded arithmetic is the reference's). FP8 scales are checked first: a
//! per-tensor scale is replicated state, so ranks that disagree on it are reported at the
//! module that uses it.

use std::collections::HashMap;

use crate::shard::model::{ShardedEntry, ShardedGpt, ShardedStep};
use ttrace::check::{compare_tensor_with, Detection, Localization};
use ttrace::engine::Module;
use ttrace::engine::Pass;
use ttrace::trace::merge;
use ttrace::trace::TensorId;
use ttrace::trace::Trace;
use ttrace::Tensor;
use ttrace::{Error, Result};

fn layout_of(step: &ShardedStep, id: &str) -> Result<ttrace::trace::Layout> {
    step.entry(id)
        .map(|e| e.layout.clone())
        .ok_or_else(|| Error::UnknownName {
            kind: "traced tensor of the sharded step",
            name: id.to_string(),
        })
}

/// A failing tensor: (id, rank whose replica differs, error / threshold, what failed).
type Failure = (String, Option<usize>, f64, String);

struct Ctx<'a> {
    reference: &'a Trace,
    local: &'a HashMap<String, f64>,
    eps: f64,
    /// The tests beyond the norm, for the model's recipe.
    detection: Detection,
}

impl Ctx<'_> {
    /// The first failing entry of a replay, as (tensor, rank, ratio, detail).
    fn first_failure(
        &self,
        step: &ShardedStep,
        entries: &[ShardedEntry],
    ) -> Result<Option<Failure>> {
        for e in entries {
            let r = self.reference.require(&e.id)?;
            match merge(&e.shards, &e.layout, &step.mesh, &e.id, Some(r.shape())) {
                Err(Error::ReplicaMismatch { rank, axis, .. }) => {
                    return Ok(Some((
                        e.id.clone(),
                        Some(rank),
                        f64::INFINITY,
                        format!("replicas disagree along {axis}: rank {rank}'s copy differs"),
                    )))
                }
                Err(err) => return Ok(Some((e.id.clone(), None, f64::INFINITY, err.to_string()))),
                Ok(c) => {
                    let th = self.local.get(&e.id).copied().unwrap_or(0.0);
                    let v = compare_tensor_with(&e.id, r, &c, th, self.eps, self.detection);
                    if !v.passed {
                        let detail = if v.ratio > 1.0 {
                            format!(
                                "local error {:.3} ε against a local threshold of {:.3} ε",
                                v.rel_error_eps,
                                v.threshold / self.eps
                            )
                        } else {
                            v.failure_detail(self.eps, None)
                        };
                        return Ok(Some((e.id.clone(), None, v.worst_ratio(), detail)));
                    }
                }
            }
        }
        Ok(None)
    }
}

fn scale_disagreement(sharded: &ShardedGpt, keys: &[String]) -> Option<(String, String)> {
    for k in keys {
        if let Some(v) = sharded.rank_scales().get(k) {
            if let Some(r) = v.iter().position(|&s| s != v[0]) {
                return Some((
                    k.clone(),
                    format!(
                        "FP8 scale of {k} differs across ranks: rank 0 {:e}, rank {r} {:e}",
                        v[0], v[r]
                    ),
                ));
            }
        }
    }
    None
}

/// Localize the first wrong module of a sharded step (see the module docs). `local` gives the
/// absolute local threshold of every tensor a module produces (missing: 0, bit-identical);
/// `eps` is the unit of the messages. `Ok(None)`: every module's own output is within its
/// local threshold.
pub fn localize(
    sharded: &mut ShardedGpt,
    step: &ShardedStep,
    reference: &Trace,
    local: &HashMap<String, f64>,
    eps: f64,
) -> Result<Option<Localization>> {
    let ctx = Ctx {
        reference,
        local,
        eps,
        detection: Detection::default()
            .accumulated_in(sharded.model().recipe().narrowest_accumulator()),
    };
    let modules = sharded.model().modules().to_vec();
    let found =
        |m: &Module,
         pass: Pass,
         (tensor, rank, ratio, detail): (String, Option<usize>, f64, String)| {
            let parameter = tensor.strip_suffix("|param_grad").map(str::to_string);
            Localization {
                born_after: None,
                stage: None,
                microbatches: None,
                module: m.name.clone(),
                kind: Some(m.kind),
                pass: Some(pass),
                tensor,
                rank,
                parameter,
                ratio,
                detail,
            }
        };
    for m in &modules {
        let keys = [format!("{}.input", m.name), format!("{}.weight", m.name)];
        if let Some((k, detail)) = scale_disagreement(sharded, &keys) {
            return Ok(Some(found(
                m,
                Pass::Forward,
                (k, None, f64::INFINITY, detail),
            )));
        }
        let out = replay_forward(sharded, step, reference, m)?;
        if let Some(f) = ctx.first_failure(step, std::slice::from_ref(&out))? {
            return Ok(Some(found(m, Pass::Forward, f)));
        }
    }
    for m in modules.iter().rev() {
        if let Some((k, detail)) = scale_disagreement(sharded, &[format!("{}.grad", m.name)]) {
            return Ok(Some(found(
                m,
                Pass::Backward,
                (k, None, f64::INFINITY, detail),
            )));
        }
        let entries = replay_backward(sharded, step, reference, m)?;
        if let Some(f) = ctx.first_failure(step, &entries)? {
            return Ok(Some(found(m, Pass::Backward, f)));
        }
    }
    Ok(None)
}

/// Module `m`'s inputs as the reference traced them, with the sharded step's layouts.
fn reference_inputs<'a>(
    step: &ShardedStep,
    reference: &'a Trace,
    m: &Module,
) -> Result<Vec<(&'a Tensor, ttrace::trace::Layout)>> {
    (0..m.inputs.len())
        .map(|i| {
            let id = TensorId::fwd_input(&m.name, i).to_string();
            Ok((reference.require(&id)?, layout_of(step, &id)?))
        })
        .collect()
}

/// The sharded forward of `m` on the reference's inputs.
fn replay_forward(
    sharded: &mut ShardedGpt,
    step: &ShardedStep,
    reference: &Trace,
    m: &Module,
) -> Result<ShardedEntry> {
    let inputs = reference_inputs(step, reference, m)?;
    sharded.replay_forward(&m.name, &inputs)
}

/// The sharded backward of `m` on the reference's inputs and output gradient.
fn replay_backward(
    sharded: &mut ShardedGpt,
    step: &ShardedStep,
    reference: &Trace,
    m: &Module,
) -> Result<Vec<ShardedEntry>> {
    let inputs = reference_inputs(step, reference, m)?;
    let gid = TensorId::grad_output(&m.name, 0).to_string();
    let g = (reference.require(&gid)?, layout_of(step, &gid)?);
    sharded.replay_backward(&m.name, &inputs, g)
}

/// Every module's own outputs replayed as the localizer replays them (forward on the
/// reference's inputs, backward on those and the reference's output gradient), merged, by
/// canonical id: what the module's own arithmetic produces when nothing is carried in. The
/// sensitivity study perturbs these to measure the localizer's power
/// ([`crate::validate::sensitivity`]).
///
/// # Errors
/// A tensor the replay needs is missing from `reference` or `step`, or a replay's shards do
/// not merge (replicas that disagree).
pub fn replayed_outputs(
    sharded: &mut ShardedGpt,
    step: &ShardedStep,
    reference: &Trace,
) -> Result<HashMap<String, Tensor>> {
    let modules = sharded.model().modules().to_vec();
    let mut out = HashMap::new();
    for m in &modules {
        let mut entries = vec![replay_forward(sharded, step, reference, m)?];
        entries.extend(replay_backward(sharded, step, reference, m)?);
        for e in entries {
            let r = reference.require(&e.id)?;
            let merged = merge(&e.shards, &e.layout, &step.mesh, &e.id, Some(r.shape()))?;
            out.insert(e.id, merged);
        }
    }
    Ok(out)
}
