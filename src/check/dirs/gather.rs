//! The first pass of a directory check: every traced id of both runs read once, merged and
//! compared, its statistics and error columns kept.

use super::*;

/// For each id, the module whose produced tensor last precedes it in the same pass (another
/// module than the id's own), in one pass over the ids: per pass the last producing module and
/// the last one before it that differs.
pub(super) fn preceding_producers(ids: &[String]) -> Vec<Option<String>> {
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

pub(super) fn layers(ids: &[String]) -> u32 {
    ids.iter()
        .filter_map(|id| id.strip_prefix("layers."))
        .filter_map(|r| r.split('.').next()?.parse::<u32>().ok())
        .max()
        .map(|m| m + 1)
        .unwrap_or(0)
}

/// The judged ids of a reference trace, in its order: every id except module inputs and
/// arriving gradients (under the naming convention those are other modules' outputs).
pub(super) fn produced(reference: &TraceDir) -> Vec<String> {
    reference
        .ids()
        .iter()
        .filter(|id| role(id).is_none_or(|r| r.produced))
        .cloned()
        .collect()
}

/// Pass-one result for one id.
#[derive(Debug, Clone)]
pub(super) struct Gathered {
    pub(super) verdict: TensorVerdict,
    pub(super) stat: TensorStat,
    /// Rank of a replica mismatch.
    pub(super) rank: Option<usize>,
    /// A hash of the reference's stored content (which consumed tensor is which produced one).
    pub(super) content: u64,
    /// The reference's shape.
    pub(super) shape: Vec<usize>,
    /// A layout read as partial sums along a guessed axis (see `partial_instead`).
    pub(super) inferred: Option<crate::trace::Layout>,
    /// The two runs store the tensor in different dtypes: said when it fails.
    pub(super) dtype_change: Option<String>,
}

/// The words for replicas that differ; for a parameter gradient, also the other cause than a
/// missing reduction: gradients read before the engine reduced them.
pub(super) fn replica_note(id: &str, e: &Error) -> String {
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
pub(super) fn partial_instead(
    candidate: &mut TraceDir,
    id: &str,
    first: &Error,
) -> Result<Option<(crate::trace::stored::Stored, crate::trace::Layout)>> {
    use crate::trace::{Axis, Placement};
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
        if !guessed.contains(&axis) || layout.along(&axis) != Placement::Replicate {
            return Ok(None);
        }
        layout.set(axis, Placement::Partial);
        match candidate.logical_stored_as(id, &layout) {
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
pub(super) fn underflow_format(
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
pub(super) fn in_subnormal_range(t: &crate::trace::stored::Stored, f: Format) -> bool {
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

pub(super) fn gather(
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
        .unwrap_or_else(crate::trace::Layout::replicated);
    let mut inferred = None;
    let mut replicas: Option<(String, usize)> = None;
    let missing = candidate.missing_ranks(id).map(<[usize]>::to_vec);
    // A gradient the candidate holds on no rank (the plan lets only gradients be absent): no
    // gradient flowed back to it there.
    let absent = missing.is_none() && !candidate.contains(id);
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
        None if absent => Err(Error::Layout {
            id: id.to_string(),
            reason: "the candidate holds no such gradient on any rank: none flowed back to it \
                     (a tensor detached on its way, a backward skipped)"
                .into(),
        }),
        None => candidate.logical_stored(id),
    };
    let (mut c, mut problem, mut rank) = match stored {
        Ok(c) => (Some(c), None, None),
        Err(e @ Error::Layout { .. }) if missing.is_some() || absent => (
            None,
            Some(e.to_string()),
            missing.as_ref().and_then(|m| m.first().copied()),
        ),
        // Replicas that disagree are a finding (a missing synchronization); shards whose shapes
        // do not fit their layout are unusable input and end the check. The verdict's columns
        // (and the reference's sums, which pricing needs) then come from the reference alone.
        Err(e @ Error::ReplicaMismatch { rank, .. }) => match partial_instead(candidate, id, &e)? {
            Some((c, l)) => {
                layout = l.clone();
                inferred = Some(l);
                replicas = Some((replica_note(id, &e), rank));
                (Some(c), None, None)
            }
            None => (None, Some(replica_note(id, &e)), Some(rank)),
        },
        Err(e) => return Err(e),
    };
    let narrow = role(id).and_then(|me| {
        crate::check::price::cpu_narrow_accumulation(
            module.as_ref().and_then(|m| m.kind),
            &me,
            module.as_ref(),
            cand_module.as_ref(),
            r.format(),
        )
    });
    let detection = match (
        underflow_format(module.as_ref(), candidate.module(id)),
        narrow,
    ) {
        (Some(f), _) if in_subnormal_range(&r, f) => plan.detection.accumulated_in(f),
        // Sums accumulated below FP32 stagnate one way: no scale or bias test.
        (_, Some(f)) => plan.detection.accumulated_in(f),
        _ => plan.detection,
    };
    let (mut verdict, mut sums) =
        compare_stored(id, &r, c.as_ref().unwrap_or(&r), 0.0, eps, detection);
    if let (Some(cand), Some((axis, k))) = (c.as_ref(), candidate.owner(id)) {
        if let Some(why) = routed_differently(r.shape(), cand.shape(), axis, k) {
            verdict.problem = Some(why);
        }
    }
    if let Some((why, at)) = replicas {
        // Read as partial sums, the replicas would differ from the reference by half its norm
        // or more (two nearly equal copies add to twice the value): they are replicas one of
        // which drifted, and the finding is that — naming the rank — not a 100% error.
        if sums.dn.is_nan() || sums.dn > 0.5 * sums.rn {
            layout = candidate
                .layout(id)
                .unwrap_or_else(crate::trace::Layout::replicated);
            inferred = None;
            if let Some(c) = c.take() {
                candidate.recycle(c);
            }
            (problem, rank) = (Some(why), Some(at));
            (verdict, sums) = compare_stored(id, &r, &r, 0.0, eps, detection);
        }
    }
    let mut exceeding = Vec::new();
    // A linear's weight or bias gradient: each element against its own bound from the layer's
    // operands (the pooled sparse test leaves parameter gradients alone).
    if let (Some(cand), None, 0, true, true) = (
        c.as_ref(),
        &problem,
        verdict.nonfinite_mismatches,
        detection.enabled,
        detection.sparse,
    ) {
        let recipe = plan.recipe.as_ref();
        let tested =
            crate::check::weight_grad::finding(reference, candidate, id, (&r, cand), recipe, eps)
                .or_else(|| {
                    crate::check::bias_grad::finding(
                        reference,
                        candidate,
                        id,
                        (&r, cand),
                        recipe,
                        eps,
                    )
                });
        if let Some((f, beyond)) = tested {
            verdict.passed &= !f.fired;
            verdict.findings.push(f);
            exceeding = beyond;
        }
    }
    if let (Some(cand), None, None, false) = (c.as_ref(), &problem, rank, verdict.passed) {
        // A difference that lies in one rank's shard names the rank; so do elements beyond
        // their own bounds that all lie in one.
        // An owned id (an expert's) is merged over its owner's ranks: the rank named is one
        // of them.
        let mesh = candidate.mesh_of(id);
        rank = crate::check::blame::faulty_rank(&r, cand, &layout, mesh, id)
            .or_else(|| crate::check::blame::rank_holding(&exceeding, r.shape(), &layout, mesh, id))
            .map(|k| candidate.global_rank(id, k));
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
    let is_norm_input = is_norm_input(id, module.as_ref());
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
        ref_layout: reference
            .layout(id)
            .unwrap_or_else(crate::trace::Layout::replicated),
        norm_gain: if is_norm_input {
            let mut window = Window::new(&r);
            norm_gain_by(r.len(), last_dim, &mut |s, e, f| window.visit(s, e, f))
        } else {
            1.0
        },
        chain_error: match narrow_norm_grad(id, module.as_ref(), cand_module.as_ref(), r.format()) {
            Some(f) => {
                let mut window = Window::new(&r);
                crate::check::chain::chain_error(r.len(), last_dim, f, &mut |s, e, f| {
                    window.visit(s, e, f)
                })
            }
            None => 0.0,
        },
        op: if diff_norm.is_finite() {
            let delta = DEFAULT_DELTA * NORM_SHARE;
            crate::check::attention_site::measure(reference, candidate, id, delta)
                .or_else(|| crate::check::loss_site::measure(reference, candidate, id, delta))
        } else {
            None
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

/// The narrow format a norm's parameter gradients are summed in on the CPU where `id` is the
/// gradient arriving at that norm (its rows are their terms: the chain is run on it).
fn narrow_norm_grad(
    id: &str,
    module: Option<&crate::io::ModuleInfo>,
    cand_module: Option<&crate::io::ModuleInfo>,
    format: Format,
) -> Option<Format> {
    let arriving = role(id).is_some_and(|x| !x.produced && x.pass == Pass::Backward);
    (arriving && module.is_some_and(|m| m.kind == Some(ModuleKind::Norm)))
        .then(|| crate::check::price::narrow_on_cpu(module, cand_module, format))
        .flatten()
}

/// Whether `id` is a norm's forward input (its norm gain is measured on the data).
fn is_norm_input(id: &str, module: Option<&crate::io::ModuleInfo>) -> bool {
    module.is_some_and(|m| m.kind == Some(ModuleKind::Norm))
        && role(id).is_some_and(|x| !x.produced && x.pass == Pass::Forward)
}

/// Where both runs store an id's shards (see [`TraceDir::storage`]).
type StorageKey = (Vec<(String, String)>, Vec<(String, String)>);

/// First-pass results by where both runs store them: a tensor passed between modules is
/// stored once by the tracer under two ids (the producer's output, the consumer's input),
/// and read, merged and compared once for both (in the tp_demo step, 11 of 30 ids).
#[derive(Default)]
pub(super) struct Aliases(HashMap<StorageKey, (String, Gathered)>);

/// [`gather`], or the result of an earlier id stored in the same places in both runs when
/// nothing that depends on the id differs: the same layouts in both runs, the same pass and
/// parameter-gradient role (which tests run; whether the loss normalization divides it), no
/// norm gain or narrow chain to measure, no FP16 range test, no merge problem or blamed rank.
pub(super) fn gather_reusing(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    id: &str,
    plan: &Plan,
    aliases: &mut Aliases,
) -> Result<Gathered> {
    let owned = |v: Vec<(&str, &str)>| -> Vec<(String, String)> {
        v.into_iter()
            .map(|(f, k)| (f.to_string(), k.to_string()))
            .collect()
    };
    let key: Option<StorageKey> = match (reference.storage(id), candidate.storage(id)) {
        (Some(r), Some(c)) => Some((owned(r), owned(c))),
        _ => None,
    };
    if let Some((first, g)) = key.as_ref().and_then(|k| aliases.0.get(k)) {
        if let Some(g) = reused(reference, candidate, id, first, g) {
            return Ok(g);
        }
    }
    let g = gather(reference, candidate, id, plan)?;
    let clean = g.verdict.problem.is_none() && g.rank.is_none() && g.inferred.is_none();
    if let (Some(k), true) = (key, clean) {
        aliases
            .0
            .entry(k)
            .or_insert_with(|| (id.to_string(), g.clone()));
    }
    Ok(g)
}

fn reused(
    reference: &TraceDir,
    candidate: &TraceDir,
    id: &str,
    first: &str,
    g: &Gathered,
) -> Option<Gathered> {
    let class = |x: &str| {
        TensorId::parse(x).map(|t| {
            let grad = matches!(t.role, TensorRole::ParamGrad { .. });
            (t.pass(), grad)
        })
    };
    if class(id) != class(first)
        || reference.layout(id) != reference.layout(first)
        || candidate.layout(id) != candidate.layout(first)
        || candidate.missing_ranks(id).is_some()
        || !candidate.contains(id)
    {
        return None;
    }
    let (module, cand_module) = (reference.module(id), candidate.module(id));
    let range_tested = |m: Option<&crate::io::ModuleInfo>, c| underflow_format(m, c).is_some();
    // A chain to run, were the data narrow (measured on it, like the norm gain).
    let narrow = |x: &str, m: Option<&crate::io::ModuleInfo>, c| {
        narrow_norm_grad(x, m, c, crate::format::Format::BF16).is_some()
    };
    if is_norm_input(id, module)
        || is_norm_input(first, reference.module(first))
        || narrow(id, module, cand_module)
        || narrow(first, reference.module(first), candidate.module(first))
        || range_tested(module, cand_module)
        || range_tested(reference.module(first), candidate.module(first))
    {
        return None;
    }
    let mut g = g.clone();
    g.verdict.id = id.to_string();
    g.stat.module = module.cloned();
    g.stat.cand_module = cand_module.cloned();
    Some(g)
}

/// For an expert's tensor (held by coordinate `k` of `axis`) whose rows differ in number from
/// the reference's, all else alike: what that says about the routing.
fn routed_differently(
    reference: &[usize],
    candidate: &[usize],
    axis: &crate::trace::Axis,
    k: usize,
) -> Option<String> {
    let (&[r0, ref r_rest @ ..], &[c0, ref c_rest @ ..]) = (reference, candidate) else {
        return None;
    };
    (r0 != c0 && r_rest == c_rest).then(|| {
        format!(
            "routing: the expert (held by {axis} coordinate {k}) got {c0} rows where the \
             reference's got {r0} — {} tokens {} (dropped at a capacity, or routed to another \
             expert)",
            r0.abs_diff(c0),
            if c0 < r0 { "fewer" } else { "more" }
        )
    })
}
