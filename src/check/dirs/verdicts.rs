//! The second pass of a directory check: which tensors are compared, each produced tensor's
//! threshold priced from the first pass's statistics, and the verdicts.

use super::*;

pub(super) struct Plan {
    pub(super) ids: Vec<String>,
    pub(super) recipe: Option<Recipe>,
    pub(super) depth: u32,
    pub(super) eps: f64,
    /// The tests beyond the norm: no scale or bias test if either side accumulates a
    /// reduction below FP32 ([`Detection::accumulated_in`]).
    pub(super) detection: Detection,
}

/// The reference's ids the check judges, in its order: all of them — but for a pipelined
/// candidate, whose stages each run their part of the model and no root module, the root
/// call's tensors it lacks (its input and output are other modules' tensors there).
pub(super) fn checked_ids(reference: &TraceDir, candidate: &TraceDir) -> Vec<String> {
    let mut ids = reference.ids().to_vec();
    if candidate.manifest().pipeline.is_some_and(|p| p.stages > 1) {
        ids.retain(|id| {
            candidate.contains(id) || TensorId::parse(id).is_none_or(|t| !t.module.is_empty())
        });
    }
    ids
}

pub(super) fn plan(reference: &TraceDir, candidate: &TraceDir) -> Result<Plan> {
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
    let ids = checked_ids(reference, candidate);
    if ids.is_empty() {
        return Err(Error::File {
            path: reference.path().display().to_string(),
            reason: "the reference trace holds no tensors: there is nothing to compare".into(),
            io: None,
        });
    }
    // A map lookup per id: linear in the number of tensors.
    if let Some(missing) = ids.iter().find(|id| {
        // A gradient the candidate lacks is a finding (none reached it), not an error.
        !candidate.contains(id)
            && candidate.missing_ranks(id).is_none()
            && TensorId::parse(id).is_none_or(|t| t.pass() == crate::policy::Pass::Forward)
    }) {
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

pub(super) fn finish(
    plan: &Plan,
    gathered: Vec<Gathered>,
    producer: &HashMap<String, f64>,
    // The candidate's mesh and the reference's, with the microbatches each step ran as.
    (mesh, ref_mesh, (microbatches, ref_microbatches)): (
        crate::trace::Mesh,
        crate::trace::Mesh,
        (usize, usize),
    ),
    kinds: &HashMap<String, ModuleKind>,
    mode: PricingMode,
    mut inferred: Vec<InferredLayout>,
) -> DirCheck {
    for (id, g) in plan.ids.iter().zip(&gathered) {
        if let Some(layout) = g.inferred.clone() {
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
        ref_mesh,
        microbatches,
        ref_microbatches,
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
            stage: None,
            microbatches: None,
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
pub(super) fn megatron(plan: &Plan, stat: &TensorStat) -> f64 {
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
pub(super) fn untraced_threshold(
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

pub(super) fn side_info(
    reference: &TraceDir,
) -> (HashMap<String, f64>, HashMap<String, ModuleKind>) {
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
