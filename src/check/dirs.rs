//! Checking two trace directories (`ttrace check REF_DIR CAND_DIR`): the candidate's shards are
//! merged into logical tensors one at a time and compared with the reference's.
//!
//! Two passes. The first reads every traced id of both runs once (tensors are streamed: one
//! tensor pair per worker in memory, kept in its stored format — an FP8 element is one byte —
//! from the file through the merge to the comparison, which decodes a piece at a time) and
//! keeps per-id statistics — norms of the reference and of
//! the difference, the candidate's layout, the norm gain of norm inputs — and the verdict's
//! error columns. The second prices each produced tensor's threshold without touching the
//! files:
//!
//! 1. the reference manifest's `threshold` when the producer priced one (`ttrace simulate
//!    --dump` records ttrace's composed thresholds there), unless [`PricingMode::Local`];
//! 2. else the local model of [`crate::check::price`] from the manifest's metadata (module
//!    kind and formats; the recipe) and the measured differences of the module's inputs — with
//!    the generic gain allowance when the manifest gives no module kind;
//! 3. else (an id outside the `{module}|…` naming convention, so its inputs are unknown)
//!    Megatron's 4·1.03^(L+1)·ε·‖ref‖ with L the number of layers seen in the ids.
//!
//! The report says which rule priced each tensor. The manifest's order is taken as execution
//! order; the first failing tensor names the module the failure is localized to (under the
//! local model a tensor fails only when its own inputs do not explain its difference).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::check::price::{
    gain_allowance, norm_gain_by, price_local, role, InputIndex, PriceContext, Pricing, TensorStat,
};
use crate::check::{
    apply_threshold, compare_stored, detect::DEFAULT_DELTA, CheckReport, Detection, Localization,
    TensorVerdict, NORM_SHARE,
};
use crate::engine::model::ModuleKind;
use crate::engine::trace::{TensorId, TensorRole};
use crate::error::{Error, Result};
use crate::format::Format;
use crate::io::guard::printable;
use crate::io::stored::Window;
use crate::io::{InferredLayout, TraceDir};
use crate::policy::{Pass, Recipe};

/// Which thresholds `ttrace check` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PricingMode {
    /// The producer's threshold where the reference manifest has one, else the local model.
    #[default]
    Auto,
    /// The local model everywhere (ignore producers' thresholds).
    Local,
}

/// The result of checking two trace directories.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DirCheck {
    /// The verdicts.
    pub report: CheckReport,
    /// How each verdict's threshold was priced (same order as the verdicts).
    pub pricing: Vec<Pricing>,
    /// Tensors per pricing rule, with the rule in words.
    pub pricing_summary: Vec<(Pricing, usize, String)>,
    /// Ids whose threshold is a fallback (generic local model or Megatron's rule).
    pub fallback: Vec<String>,
    /// The first failure, localized.
    pub localization: Option<Localization>,
    /// Where code that no traced module covers made a tensor a traced module consumes, in
    /// execution order: the gaps in what the trace sees.
    pub untraced: Vec<UntracedGap>,
    /// Layouts the candidate's writer could only guess (plain tensors of code it cannot see
    /// into), as inferred from the shards' and the reference's shapes.
    pub inferred: Vec<InferredLayout>,
    /// The mode used.
    pub mode: PricingMode,
    /// The arithmetic settings the traces recorded and the checker priced (autocast, FP32
    /// matmul and convolution precision), per run: (`reference` or `candidate`, the setting
    /// as `name=value`, how many tensors carry it).
    pub arithmetic: Vec<(String, String, usize)>,
    /// How the candidate's data-parallel ranks normalized their loss, where its tracer did
    /// not know and the checker settled it from the reference.
    pub loss: Option<crate::check::LossNormalization>,
}

/// A tensor a traced module consumes that untraced code made (its reference content equals no
/// earlier traced output): functional code, a module left out, autograd's gradient sums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UntracedGap {
    /// The module whose traced output last precedes the tensor in its pass, if any.
    pub after: Option<String>,
    /// The module that consumes it.
    pub before: String,
    /// The consumed tensor's id.
    pub tensor: String,
}

/// For each id, the module whose produced tensor last precedes it in the same pass (another
/// module than the id's own), in one pass over the ids: per pass the last producing module and
/// the last one before it that differs.
fn preceding_producers(ids: &[String]) -> Vec<Option<String>> {
    let mut last: HashMap<Pass, (String, Option<String>)> = HashMap::new();
    ids.iter()
        .map(|id| {
            let me = role(id)?;
            let before = last.get(&me.pass).and_then(|(l, prev)| {
                if *l != me.module {
                    Some(l.clone())
                } else {
                    prev.clone()
                }
            });
            if me.produced {
                match last.get_mut(&me.pass) {
                    Some((l, prev)) if *l != me.module => {
                        *prev = Some(std::mem::replace(l, me.module.clone()));
                    }
                    Some(_) => {}
                    None => {
                        last.insert(me.pass, (me.module.clone(), None));
                    }
                }
            }
            before
        })
        .collect()
}

fn layers(ids: &[String]) -> u32 {
    ids.iter()
        .filter_map(|id| id.strip_prefix("layers."))
        .filter_map(|r| r.split('.').next()?.parse::<u32>().ok())
        .max()
        .map(|m| m + 1)
        .unwrap_or(0)
}

/// The judged ids of a reference trace, in its order: every id except module inputs and
/// arriving gradients (under the naming convention those are other modules' outputs).
fn produced(reference: &TraceDir) -> Vec<String> {
    reference
        .ids()
        .iter()
        .filter(|id| role(id).is_none_or(|r| r.produced))
        .cloned()
        .collect()
}

/// Pass-one result for one id.
#[derive(Debug, Clone)]
struct Gathered {
    verdict: TensorVerdict,
    stat: TensorStat,
    /// Rank of a replica mismatch.
    rank: Option<usize>,
    /// A hash of the reference's stored content (which consumed tensor is which produced one).
    content: u64,
    /// The reference's shape.
    shape: Vec<usize>,
    /// A layout read as partial sums along a guessed axis (see `partial_instead`).
    inferred: Option<crate::shard::Layout>,
    /// The two runs store the tensor in different dtypes: said when it fails.
    dtype_change: Option<String>,
}

/// The words for replicas that differ; for a parameter gradient, also the other cause than a
/// missing reduction: gradients read before the engine reduced them.
fn replica_note(id: &str, e: &Error) -> String {
    if !id.ends_with("|param_grad") {
        return e.to_string();
    }
    format!(
        "{e} (parameter gradients must be read after the engine reduces them: Megatron's \
         finalize_model_grads, called at the end of its forward_backward_func, and DDP's or \
         FSDP's backward — trace the whole step; if it was, that reduction is missing)"
    )
}

/// A tensor whose replicas differ along an axis the writer only guessed as replicated (and
/// that is no parameter gradient, which no later tensor would check) read as partial sums
/// along it: what a collective not yet done leaves (the gradient of all-gathered keys under
/// context parallelism). `None` when the axis was known, or partial sums do not merge either.
/// A missing reduction is then caught where the unreduced value is used.
fn partial_instead(
    candidate: &mut TraceDir,
    id: &str,
    first: &Error,
) -> Result<Option<(crate::io::stored::Stored, crate::shard::Layout)>> {
    use crate::shard::{Axis, Placement};
    if role(id).is_none_or(|r| r.param_grad) {
        return Ok(None);
    }
    let Some(mut layout) = candidate.layout(id) else {
        return Ok(None);
    };
    let guessed = candidate.guessed(id).to_vec();
    let mut err = first;
    let mut owned;
    for _ in 0..3 {
        let Error::ReplicaMismatch { axis, .. } = err else {
            return Ok(None);
        };
        let Some(axis) = Axis::named(axis) else {
            return Ok(None);
        };
        if !guessed.contains(&axis) || layout.along(axis) != Placement::Replicate {
            return Ok(None);
        }
        layout = layout.with(axis, Placement::Partial);
        match candidate.logical_stored_as(id, layout) {
            Ok(c) => return Ok(Some((c, layout))),
            Err(e @ Error::ReplicaMismatch { .. }) => {
                owned = e;
                err = &owned;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// The format a module's results were rounded to whose exponent range is narrower than
/// FP32's (an autocast to FP16), from either run's record.
fn underflow_format(
    r: Option<&crate::io::ModuleInfo>,
    c: Option<&crate::io::ModuleInfo>,
) -> Option<Format> {
    [r, c]
        .into_iter()
        .flatten()
        .filter_map(|m| m.arith.autocast)
        .find(|f| f.emin() > Format::F32.emin())
}

/// Whether the values of `t` lie where `f` underflows: a root mean square below 16 times its
/// smallest normal value (a Gaussian tensor then has 5% or more of its elements subnormal in
/// `f`). Rounding there is to an absolute grid and values below half its spacing vanish — a
/// shrinkage toward zero that the scale test reads as a scale (it fired at 0.44 against 0.40
/// on the FP16-autocast input gradient of a clean tensor-parallel step, TP 8, whose elements
/// are about 10⁻⁵). Such tensors are tested by the norm and the sparse test alone.
fn in_subnormal_range(t: &crate::io::stored::Stored, f: Format) -> bool {
    let n = t.len();
    if n == 0 {
        return false;
    }
    let mut sum_sq = 0.0f64;
    let mut window = Window::new(t);
    window.visit(0, n, &mut |v| {
        sum_sq += v
            .iter()
            .filter(|x| x.is_finite())
            .map(|x| x * x)
            .sum::<f64>();
    });
    (sum_sq / n as f64).sqrt() < 16.0 * f.min_normal()
}

fn gather(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    id: &str,
    plan: &Plan,
) -> Result<Gathered> {
    let eps = plan.eps;
    // Both sides stay as stored (an FP8 element is one byte) and are decoded a piece at a
    // time by the comparison.
    let r = reference.logical_stored(id)?;
    let module = reference.module(id).cloned();
    let cand_module = candidate.module(id).cloned();
    let mut layout = candidate
        .layout(id)
        .unwrap_or_else(crate::shard::Layout::replicated);
    let mut inferred = None;
    let mut replicas: Option<(String, usize)> = None;
    let missing = candidate.missing_ranks(id).map(<[usize]>::to_vec);
    let stored = match &missing {
        // A parameter gradient some ranks lack: the parameter got no gradient there.
        Some(ranks) => Err(Error::Layout {
            id: id.to_string(),
            reason: format!(
                "rank{} {} hold{} no gradient of this parameter (every other rank does): it \
                 was not used there, or its gradient was dropped",
                if ranks.len() > 1 { "s" } else { "" },
                ranks
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                if ranks.len() > 1 { "" } else { "s" }
            ),
        }),
        None => candidate.logical_stored(id),
    };
    let (mut c, mut problem, mut rank) = match stored {
        Ok(c) => (Some(c), None, None),
        Err(e @ Error::Layout { .. }) if missing.is_some() => (
            None,
            Some(e.to_string()),
            missing.as_ref().and_then(|m| m.first().copied()),
        ),
        // Replicas that disagree are a finding (a missing synchronization); shards whose shapes
        // do not fit their layout are unusable input and end the check. The verdict's columns
        // (and the reference's sums, which pricing needs) then come from the reference alone.
        Err(e @ Error::ReplicaMismatch { rank, .. }) => match partial_instead(candidate, id, &e)? {
            Some((c, l)) => {
                layout = l;
                inferred = Some(l);
                replicas = Some((replica_note(id, &e), rank));
                (Some(c), None, None)
            }
            None => (None, Some(replica_note(id, &e)), Some(rank)),
        },
        Err(e) => return Err(e),
    };
    let detection = match underflow_format(module.as_ref(), candidate.module(id)) {
        Some(f) if in_subnormal_range(&r, f) => plan.detection.accumulated_in(f),
        _ => plan.detection,
    };
    let (mut verdict, mut sums) =
        compare_stored(id, &r, c.as_ref().unwrap_or(&r), 0.0, eps, detection);
    if let Some((why, at)) = replicas {
        // Read as partial sums, the replicas would differ from the reference by half its norm
        // or more (two nearly equal copies add to twice the value): they are replicas one of
        // which drifted, and the finding is that — naming the rank — not a 100% error.
        if sums.dn.is_nan() || sums.dn > 0.5 * sums.rn {
            layout = candidate
                .layout(id)
                .unwrap_or_else(crate::shard::Layout::replicated);
            inferred = None;
            if let Some(c) = c.take() {
                candidate.recycle(c);
            }
            (problem, rank) = (Some(why), Some(at));
            (verdict, sums) = compare_stored(id, &r, &r, 0.0, eps, detection);
        }
    }
    if let (Some(cand), None, None, false) = (c.as_ref(), &problem, rank, verdict.passed) {
        // A difference that lies in one rank's shard names the rank.
        rank = crate::check::blame::faulty_rank(&r, cand, &layout, &candidate.manifest().mesh, id);
    }
    let cand = c.as_ref().unwrap_or(&r);
    let cand_format = c.as_ref().map(|c| c.format());
    let dtype_change = cand_format.filter(|f| *f != r.format()).map(|f| {
        format!(
            "stored as {f} in the candidate but as {} in the reference (judged at the wider)",
            r.format()
        )
    });
    let (dn, rn, rmax) = (sums.dn, sums.rn, sums.rmax);
    let mut diff_norm = dn;
    if let Some(p) = problem {
        verdict.problem = Some(p);
        verdict.passed = false;
        verdict.ratio = f64::INFINITY;
        diff_norm = f64::INFINITY;
    }
    if verdict.nonfinite_mismatches > 0 || r.shape() != cand.shape() {
        diff_norm = f64::INFINITY;
    }
    let last_dim = r.shape().last().copied().unwrap_or(1);
    let is_norm_input = module
        .as_ref()
        .is_some_and(|m| m.kind == Some(ModuleKind::Norm))
        && role(id).is_some_and(|x| !x.produced && x.pass == Pass::Forward);
    let stat = TensorStat {
        ref_norm: rn,
        ref_max_abs: rmax,
        diff_norm,
        elements: r.len(),
        last_dim,
        ndim: r.shape().len(),
        // Priced at the wider of the two runs' dtypes where they differ.
        format: match cand_format {
            Some(f) if f.precision() > r.format().precision() => f,
            _ => r.format(),
        },
        layout,
        norm_gain: if is_norm_input {
            let mut window = Window::new(&r);
            norm_gain_by(r.len(), last_dim, &mut |s, e, f| window.visit(s, e, f))
        } else {
            1.0
        },
        module,
        cand_module,
    };
    let (content, shape) = (r.content_hash(), r.shape().to_vec());
    reference.recycle(r);
    if let Some(c) = c {
        candidate.recycle(c);
    }
    Ok(Gathered {
        verdict,
        stat,
        rank,
        content,
        shape,
        inferred,
        dtype_change,
    })
}

struct Plan {
    ids: Vec<String>,
    recipe: Option<Recipe>,
    depth: u32,
    eps: f64,
    /// The tests beyond the norm: no scale or bias test if either side accumulates a
    /// reduction below FP32 ([`Detection::accumulated_in`]).
    detection: Detection,
}

fn plan(reference: &TraceDir, candidate: &TraceDir) -> Result<Plan> {
    // One directory under two names (or a link to it) would pass whatever it holds.
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    };
    if same(reference.path(), candidate.path()) {
        return Err(Error::InvalidParameter {
            name: "candidate",
            reason: format!(
                "the candidate {} is the reference {} itself: a trace compared with itself \
                 proves nothing — give the traced parallel run",
                printable(&candidate.path().display().to_string()),
                printable(&reference.path().display().to_string())
            ),
        });
    }
    let (rw, cw) = (
        reference.manifest().mesh.world(),
        candidate.manifest().mesh.world(),
    );
    if rw > 1 && cw == 1 {
        // A sharded "reference" against a one-rank "candidate" is the two swapped: judged
        // so, the reference's shards would be held to thresholds priced for no sharding.
        return Err(Error::InvalidParameter {
            name: "reference",
            reason: format!(
                "the reference {} has {rw} ranks and the candidate {} one: are they swapped? \
                 The reference is the single-device run: ttrace check REFERENCE CANDIDATE",
                reference.path().display(),
                candidate.path().display()
            ),
        });
    }
    let ids = reference.ids().to_vec();
    if ids.is_empty() {
        return Err(Error::File {
            path: reference.path().display().to_string(),
            reason: "the reference trace holds no tensors: there is nothing to compare".into(),
            io: None,
        });
    }
    // A map lookup per id: linear in the number of tensors.
    if let Some(missing) = ids
        .iter()
        .find(|id| !candidate.contains(id) && candidate.missing_ranks(id).is_none())
    {
        return Err(Error::UnknownName {
            kind: "tensor of the reference trace that the candidate trace lacks",
            name: missing.clone(),
        });
    }
    // A tensor stored in another dtype by the candidate (a gradient reduced in BF16 where
    // the reference keeps FP32 main gradients) is judged, priced at the wider of the two,
    // and the change said where it fails (`gather`).
    let recipe = match &reference.manifest().recipe {
        Some(r) => Some(Recipe::by_name(r)?),
        None => None,
    };
    let train = recipe.as_ref().map(|r| r.activation_format);
    let judged = produced(reference);
    let depth = layers(&judged) + 1;
    // ε of the training dtype; without a recipe, of the coarsest stored dtype.
    let eps = match train {
        Some(f) => f.machine_epsilon(),
        None => reference
            .manifest()
            .tensors
            .iter()
            .map(|e| e.dtype)
            .min_by_key(|f| f.precision())
            .unwrap_or(Format::F32)
            .machine_epsilon(),
    };
    // The narrowest accumulation either side declares (a module's `accumulate`) or its recipe
    // implies: below FP32, rounding stagnates one way and the systematic tests do not hold.
    let declared = [reference, candidate].into_iter().flat_map(|t| {
        t.manifest()
            .tensors
            .iter()
            .filter_map(|e| e.module.as_ref().and_then(|m| m.accumulate))
    });
    let narrowest = declared
        .chain(recipe.as_ref().map(Recipe::narrowest_accumulator))
        .min_by_key(|f| f.precision())
        .unwrap_or(Format::F32);
    Ok(Plan {
        ids,
        recipe,
        depth,
        eps,
        detection: Detection::default().accumulated_in(narrowest),
    })
}

fn finish(
    plan: &Plan,
    gathered: Vec<Gathered>,
    producer: &HashMap<String, f64>,
    mesh: crate::shard::Mesh,
    kinds: &HashMap<String, ModuleKind>,
    mode: PricingMode,
    mut inferred: Vec<InferredLayout>,
) -> DirCheck {
    for (id, g) in plan.ids.iter().zip(&gathered) {
        if let Some(layout) = g.inferred {
            inferred.retain(|x| x.tensor != *id);
            inferred.push(InferredLayout {
                tensor: id.clone(),
                layout,
                fitting: 1,
            });
        }
    }
    let by_id: HashMap<&str, &Gathered> = plan
        .ids
        .iter()
        .map(String::as_str)
        .zip(gathered.iter())
        .collect();
    let ctx = PriceContext {
        mesh,
        recipe: plan.recipe.clone(),
        log_inv_delta: (1.0 / (DEFAULT_DELTA * NORM_SHARE)).ln(),
    };
    let stat = |j: &str| by_id.get(j).map(|g| &g.stat);
    let index = InputIndex::new(&plan.ids);
    let preceding = preceding_producers(&plan.ids);
    let mut produced_by: HashMap<(&str, Pass), Vec<&str>> = HashMap::new();
    for id in &plan.ids {
        if let Some(r) = TensorId::parse(id).filter(|t| t.produced()) {
            if !matches!(r.role, TensorRole::ParamGrad { .. }) {
                let module = &id[..r.module.len()];
                produced_by.entry((module, r.pass())).or_default().push(id);
            }
        }
    }
    let rel_of = |j: &str| stat(j).map(TensorStat::rel).filter(|x| x.is_finite());
    // What the untraced code that made consumed id `k` was given, as the largest relative
    // difference: the inputs of traced modules enclosing its consumer (an attention core
    // around its softmax); the tensors the module before the gap produced in this pass; in
    // the backward pass also the forward tensors the gap's backward reads (the consumer's
    // forward outputs, the preceding module's forward inputs).
    let gap_operands = |k: usize| -> f64 {
        let id = plan.ids[k].as_str();
        let Some(r) = role(id) else { return 0.0 };
        let mut ids: Vec<&str> = vec![];
        let mut name = r.module.as_str();
        while let Some(cut) = name.rfind('.') {
            name = &name[..cut];
            ids.extend(
                index
                    .of_module(name, r.pass)
                    .into_iter()
                    .map(String::as_str),
            );
        }
        if let Some(after) = preceding[k].as_deref() {
            ids.extend(produced_by.get(&(after, r.pass)).into_iter().flatten());
            if r.pass == Pass::Backward {
                let consumer = r.module.as_str();
                ids.extend(
                    produced_by
                        .get(&(consumer, Pass::Forward))
                        .into_iter()
                        .flatten(),
                );
                ids.extend(
                    index
                        .of_module(after, Pass::Forward)
                        .into_iter()
                        .map(String::as_str),
                );
            }
        }
        ids.into_iter().filter_map(rel_of).fold(0.0, f64::max)
    };
    // Consumed ids (module inputs, arriving gradients) carry their differences into their
    // modules' thresholds, so none goes unjudged: a model input (a forward input listed before
    // any produced tensor) must be identical; one equal in the reference to an earlier
    // produced tensor (the same content: the tensor passed between modules) may differ no
    // more than that tensor does — more was changed between the two, where nothing is traced;
    // any other (made by untraced code: autograd's sum of gradients, functional code) is
    // judged on the generic rule of `untraced_threshold`.
    let first_produced = plan
        .ids
        .iter()
        .position(|id| role(id).is_none_or(|r| r.produced))
        .unwrap_or(plan.ids.len());
    let mut same_content: HashMap<(u64, Vec<usize>), &str> = HashMap::new();
    // Per pass and shape (elements, last dimension): the largest relative difference of a
    // produced tensor so far.
    let mut upstream: HashMap<(Pass, usize, usize), f64> = HashMap::new();
    let mut verdicts = Vec::with_capacity(plan.ids.len());
    let mut pricing = Vec::with_capacity(plan.ids.len());
    for (k, id) in plan.ids.iter().enumerate() {
        let g = by_id[id.as_str()];
        let produced = role(id).is_none_or(|r| r.produced);
        let key = (g.content, g.shape.clone());
        let source = (!produced)
            .then(|| same_content.get(&key).copied())
            .flatten();
        if produced {
            same_content.entry(key).or_insert(id.as_str());
            let rel = g.stat.rel();
            if let (Some(r), true) = (role(id), rel.is_finite()) {
                let e = upstream
                    .entry((r.pass, g.stat.elements, g.stat.last_dim))
                    .or_insert(0.0f64);
                *e = e.max(rel);
            }
        }
        let broken = g.verdict.problem.is_some() || g.verdict.nonfinite_mismatches > 0;
        let priced = match (mode, producer.get(id)) {
            _ if !produced && (broken || k < first_produced) => (0.0, Pricing::ModelInput),
            _ if !produced => match source {
                // One rounding of its format may lie between (a cast, a collective).
                Some(p) => (
                    by_id[p].stat.diff_norm + g.stat.format.unit_roundoff() * g.stat.ref_norm,
                    Pricing::Carried,
                ),
                None => (
                    untraced_threshold(id, &upstream, gap_operands(k), plan, &g.stat),
                    Pricing::Untraced,
                ),
            },
            (PricingMode::Auto, Some(&t)) => (t, Pricing::Producer),
            _ => match price_local(id, &index, &stat, &ctx) {
                Some(p) => (p.threshold, p.pricing),
                None => (megatron(plan, &g.stat), Pricing::Megatron),
            },
        };
        let mut v = g.verdict.clone();
        if priced.1 == Pricing::InputFailed && v.problem.is_none() {
            // Not judged: the failing input is reported (and fails the check) itself.
            v.threshold = f64::INFINITY;
            v.ratio = 0.0;
            v.passed = v.nonfinite_mismatches == 0;
        } else if v.problem.is_none() {
            apply_threshold(&mut v, g.stat.diff_norm, g.stat.ref_norm, priced.0);
            // "Changed between the two" only when the norm says so: a test beyond the norm that
            // fires on a consumed copy of a tensor fires on the tensor itself (downstream of a
            // bug it is the same difference, not a second bug).
            let producer_passed = source
                .and_then(|p| verdicts.iter().rev().find(|x: &&TensorVerdict| x.id == p))
                .is_none_or(|x| x.passed);
            if let (false, None, Some(note)) = (v.passed, &v.problem, &g.dtype_change) {
                v.problem = Some(note.clone());
            }
            if let (false, Some(p), true, true) = (v.passed, source, v.ratio > 1.0, producer_passed)
            {
                v.problem = Some(format!(
                    "differs from the reference more than {} does ({:.3e} against {:.3e}), \
                     which it equals in the reference: changed between the two, where \
                     nothing is traced",
                    printable(p),
                    g.stat.diff_norm,
                    priced.0
                ));
            }
        }
        verdicts.push(v);
        pricing.push(priced.1);
    }
    let failures = verdicts.iter().filter(|v| !v.passed).count();
    let first = verdicts.iter().position(|v| !v.passed);
    let localization = first.map(|i| {
        let v = &verdicts[i];
        let r = role(&v.id);
        let module = r
            .as_ref()
            .map(|r| r.module.clone())
            .unwrap_or_else(|| v.id.clone());
        let detail = match (&v.problem, v.first_nonfinite) {
            (Some(p), _) => p.clone(),
            (None, Some(k)) => format!(
                "{} non-finite mismatches, first at flat index {k}",
                v.nonfinite_mismatches
            ),
            _ => v.failure_detail(plan.eps, Some(pricing[i].describe())),
        };
        // A consumed tensor that fails was changed where nothing is traced: name the gap.
        let born_after = r
            .as_ref()
            .filter(|r| !r.produced)
            .and_then(|_| preceding[i].clone());
        let detail = match &born_after {
            Some(a) => format!(
                "born in untraced code between module {} and module {module}: {detail}",
                printable(a)
            ),
            None => detail,
        };
        Localization {
            born_after,
            kind: kinds.get(&module).copied().or_else(|| {
                by_id[v.id.as_str()]
                    .stat
                    .module
                    .as_ref()
                    .and_then(|m| m.kind)
            }),
            module,
            pass: r.as_ref().map(|r| r.pass),
            parameter: r
                .as_ref()
                .filter(|r| r.param_grad)
                .and_then(|_| v.id.strip_suffix("|param_grad"))
                .map(str::to_string),
            tensor: v.id.clone(),
            rank: by_id[v.id.as_str()].rank,
            ratio: v.ratio,
            detail,
        }
    });
    let mut counts: std::collections::BTreeMap<Pricing, usize> = Default::default();
    for p in &pricing {
        *counts.entry(*p).or_default() += 1;
    }
    let fallback = verdicts
        .iter()
        .zip(&pricing)
        .filter(|(_, p)| matches!(p, Pricing::LocalGeneric | Pricing::Megatron))
        .map(|(v, _)| v.id.clone())
        .collect();
    let untraced = pricing
        .iter()
        .enumerate()
        .filter(|(_, p)| matches!(p, Pricing::Untraced))
        .filter_map(|(i, _)| {
            let before = role(&verdicts[i].id)?.module;
            Some(UntracedGap {
                after: preceding[i].clone(),
                before,
                tensor: verdicts[i].id.clone(),
            })
        })
        .collect();
    let mut arithmetic: std::collections::BTreeMap<(String, String), usize> = Default::default();
    for g in by_id.values() {
        for (side, m) in [
            ("reference", &g.stat.module),
            ("candidate", &g.stat.cand_module),
        ] {
            let Some(a) = m.as_ref().map(|m| &m.arith) else {
                continue;
            };
            for (name, f) in [
                ("autocast", a.autocast),
                ("fp32_matmul", a.fp32_matmul),
                ("fp32_conv", a.fp32_conv),
            ] {
                if let Some(f) = f.filter(|f| *f != Format::F32) {
                    *arithmetic
                        .entry((side.to_string(), format!("{name}={f}")))
                        .or_default() += 1;
                }
            }
        }
    }
    DirCheck {
        arithmetic: arithmetic
            .into_iter()
            .map(|((side, setting), n)| (side, setting, n))
            .collect(),
        report: CheckReport {
            first_failure: first.map(|i| verdicts[i].id.clone()),
            verdicts,
            failures,
            eps: plan.eps,
        },
        pricing,
        pricing_summary: counts
            .into_iter()
            .map(|(p, n)| (p, n, p.describe().to_string()))
            .collect(),
        fallback,
        localization,
        untraced,
        inferred,
        mode,
        loss: None,
    }
}

/// Megatron's 4·1.03^(L+1)·ε·‖ref‖, with ε the larger of the training dtype's and the
/// tensor's stored dtype's: a tensor stored in BF16 was rounded to BF16 at least once whatever
/// the recipe says. A tensor stored in a finer dtype than the training one keeps the training
/// dtype's ε: storage does not say in which precision it was computed (FP32 main gradients
/// summed from BF16 products, FP32 outputs of FP8 GEMMs), and this rule knows nothing else
/// about it. (The local model prices known modules by the formats they compute in.)
fn megatron(plan: &Plan, stat: &TensorStat) -> f64 {
    let eps = plan.eps.max(stat.format.machine_epsilon());
    4.0 * 1.03f64.powi(plan.depth as i32) * eps * stat.ref_norm
}

/// The threshold of a consumed tensor made by untraced code: the larger of Megatron's rule and
/// the generic gain allowance (κ = 3) times the largest relative difference upstream of it —
/// of an earlier produced tensor of its shape in the same pass (the addends of an autograd
/// sum, the operand of functional code; `upstream`, by pass, elements and last dimension), or
/// of an input of a traced module enclosing its consumer (`enclosing`: the operands of the
/// code inside an attention core) — times ‖ref‖. This is an allowance, not a bound: the
/// untraced code's conditioning is unknown.
fn untraced_threshold(
    id: &str,
    upstream: &HashMap<(Pass, usize, usize), f64>,
    enclosing: f64,
    plan: &Plan,
    me: &TensorStat,
) -> f64 {
    let up = role(id)
        .and_then(|r| upstream.get(&(r.pass, me.elements, me.last_dim)))
        .copied()
        .unwrap_or(0.0)
        .max(enclosing);
    megatron(plan, me).max(gain_allowance(None) * up * me.ref_norm)
}

fn side_info(reference: &TraceDir) -> (HashMap<String, f64>, HashMap<String, ModuleKind>) {
    let mut producer = HashMap::new();
    let mut kinds = HashMap::new();
    for id in reference.ids() {
        if let Some(t) = reference.threshold(id) {
            producer.insert(id.clone(), t);
        }
        if let (Some(r), Some(k)) = (role(id), reference.module_kind(id)) {
            if r.produced && !r.param_grad {
                kinds.insert(r.module, k);
            }
        }
    }
    (producer, kinds)
}

/// Check `candidate` against `reference` (see the module docs), one tensor at a time. Errors
/// are unusable input (a tensor the candidate lacks, unreadable files, shards whose shapes do
/// not fit their layout); replicas that disagree are a failing verdict naming the rank. `progress` is called once per traced id.
pub fn check_dirs(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    mode: PricingMode,
    progress: &dyn Fn(),
) -> Result<DirCheck> {
    let (mut resolved, inferred) = candidate.infer_guessed(reference)?;
    let candidate = &mut resolved;
    let loss = crate::check::loss::settle_dp_loss(reference, candidate)?;
    let plan = plan(reference, candidate)?;
    let mut out = Vec::with_capacity(plan.ids.len());
    for id in &plan.ids {
        out.push(gather(reference, candidate, id, &plan)?);
        progress();
    }
    let (producer, kinds) = side_info(reference);
    let check = DirCheck {
        loss,
        ..finish(
            &plan,
            out,
            &producer,
            candidate.manifest().mesh,
            &kinds,
            mode,
            inferred,
        )
    };
    Ok(unreduced_producer(candidate, check))
}

/// A first failure in a tensor consumed after module `m` (untraced code between), where `m`
/// handed its output to plain code as a partial sum ([`ModuleInfo::unreduced`]
/// (crate::io::ModuleInfo::unreduced)): the difference was born at `m`, whose missing
/// reduction its own output — merged as the sum it is — cannot show. The localization names
/// `m` and its output, and says why.
fn unreduced_producer(candidate: &TraceDir, mut check: DirCheck) -> DirCheck {
    let Some(loc) = check.localization.as_mut() else {
        return check;
    };
    let (Some(after), Some(Pass::Forward)) = (loc.born_after.clone(), loc.pass) else {
        return check;
    };
    let prefix = format!("{after}|fwd.output.");
    let hit = candidate.manifest().tensors.iter().find_map(|e| {
        let m = e.module.as_ref()?;
        (e.id.starts_with(&prefix) && !m.unreduced.is_empty()).then_some((e, m))
    });
    if let Some((e, m)) = hit {
        let axes: Vec<&str> = m.unreduced.iter().map(|a| a.name()).collect();
        loc.detail = format!(
            "module {} handed its output {} to plain code as a partial sum over {} (a DTensor \
             Partial() made local without its reduction): a missing all-reduce, seen where the \
             sum is used, in {}: {}",
            printable(&after),
            printable(&e.id),
            axes.join(" and "),
            printable(&loc.tensor),
            loc.detail
        );
        loc.tensor = e.id.clone();
        loc.kind = m.kind.or(loc.kind);
        loc.module = after;
        loc.born_after = None;
        // Every rank skipped it: the consumer's differing replica names no culprit.
        loc.rank = None;
        loc.ratio = f64::INFINITY;
    }
    check
}

/// The trace directories to compare for `reference` and `candidate` as a user names them: the
/// directories themselves when they hold a manifest, else the one traced step (`step{n}`, as
/// the Python tracer writes them) both hold. Several common steps are refused with the list
/// and the command to pick one; no manifest and no step is left to the reader's error.
///
/// # Examples
///
/// ```no_run
/// let (r, c) = ttrace::check::resolve_steps("traces/reference".as_ref(), "traces/candidate".as_ref())?;
/// # Ok::<(), ttrace::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::File`] naming the common steps when there are several, or the steps of each side
/// when they have none in common.
pub fn resolve_steps(reference: &Path, candidate: &Path) -> Result<(PathBuf, PathBuf)> {
    let has_manifest = |d: &Path| {
        d.join("manifest.json").exists()
            || std::fs::read_dir(d).is_ok_and(|it| {
                it.filter_map(|e| e.ok()).any(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    n.starts_with("manifest.rank") && n.ends_with(".json")
                })
            })
    };
    let steps = |d: &Path| -> Vec<(u64, String)> {
        let mut v: Vec<(u64, String)> = std::fs::read_dir(d)
            .map(|it| {
                it.filter_map(|e| e.ok())
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter_map(|e| {
                        let n = e.file_name().to_string_lossy().to_string();
                        let k = n.strip_prefix("step")?.parse::<u64>().ok()?;
                        has_manifest(&e.path()).then_some((k, n))
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    if has_manifest(reference) || has_manifest(candidate) {
        return Ok((reference.to_path_buf(), candidate.to_path_buf()));
    }
    let (rs, cs) = (steps(reference), steps(candidate));
    if rs.is_empty() && cs.is_empty() {
        return Ok((reference.to_path_buf(), candidate.to_path_buf()));
    }
    let common: Vec<&String> = rs
        .iter()
        .filter(|s| cs.contains(s))
        .map(|(_, n)| n)
        .collect();
    let list = |v: &[(u64, String)]| {
        v.iter()
            .map(|(_, n)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match common.as_slice() {
        [one] => Ok((reference.join(one), candidate.join(one))),
        [] => Err(Error::File {
            path: reference.display().to_string(),
            reason: format!(
                "holds traced steps ({}) and the candidate {} ({}): none in common",
                list(&rs),
                candidate.display(),
                list(&cs)
            ),
            io: None,
        }),
        many => Err(Error::File {
            path: reference.display().to_string(),
            reason: format!(
                "holds {} traced steps ({}): name one, e.g. ttrace check {} {}",
                many.len(),
                many.iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                reference.join(many[0]).display(),
                candidate.join(many[0]).display()
            ),
            io: None,
        }),
    }
}

/// [`check_dirs`] on directory paths, spread over the rayon thread pool: every worker reads a
/// contiguous run of tensors through its own reader (sharing the validated headers); the verdicts come back in the
/// reference's order, identical for any number of threads. Memory: one tensor pair per
/// worker.
pub fn check_dir_paths(
    reference: &Path,
    candidate: &Path,
    mode: PricingMode,
    progress: &(dyn Fn() + Sync),
) -> Result<DirCheck> {
    let (reference, candidate) = resolve_steps(reference, candidate)?;
    check_dir_traces(
        &TraceDir::open(&reference)?,
        &TraceDir::open(&candidate)?,
        mode,
        progress,
    )
}

/// [`check_dir_paths`] on traces already opened (their headers validated once; every worker
/// reads through its own [`TraceDir::share`]).
pub fn check_dir_traces(
    r0: &TraceDir,
    c0: &TraceDir,
    mode: PricingMode,
    progress: &(dyn Fn() + Sync),
) -> Result<DirCheck> {
    let (mut resolved, inferred) = c0.infer_guessed(r0)?;
    let loss = crate::check::loss::settle_dp_loss(&mut r0.share(), &mut resolved)?;
    let c0 = &resolved;
    let plan = plan(r0, c0)?;
    let (producer, kinds) = side_info(r0);
    let mesh = c0.manifest().mesh;
    let workers = crate::parallel::threads();
    // One run of tensors per worker: each opens its handles once and reuses their read and
    // value buffers for every tensor (smaller runs balanced load better but paid fresh pages
    // for every run's first tensors).
    let chunk = plan.ids.len().div_ceil(workers).max(1);
    let parts: Vec<Vec<Gathered>> = crate::parallel::map_chunks(&plan.ids, chunk, |part| {
        // Readers sharing the validated headers: memory for the metadata once.
        let (mut r, mut c) = (r0.share(), c0.share());
        part.iter()
            .map(|id| {
                let g = gather(&mut r, &mut c, id, &plan);
                progress();
                g
            })
            .collect::<Result<Vec<_>>>()
    })
    .into_iter()
    .collect::<Result<_>>()?;
    let check = DirCheck {
        loss,
        ..finish(
            &plan,
            parts.into_iter().flatten().collect(),
            &producer,
            mesh,
            &kinds,
            mode,
            inferred,
        )
    };
    Ok(unreduced_producer(c0, check))
}
