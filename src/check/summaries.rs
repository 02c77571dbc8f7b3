//! Comparing two summary traces (`papers/summaries.md`): what a few statistics per tensor can
//! prove about the difference of two runs, and what they cannot.
//!
//! Per step both traces hold, per tensor: the shards' statistics are merged into the logical
//! tensor's (split and cp-chunked shards add, a replicated tensor is one rank's copy — the
//! others must agree bit for bit — and a partial sum cannot be merged), and a **lower bound**
//! L on ‖c − r‖₂ over the finite elements is computed from them. A difference is *proven* when
//! L exceeds the threshold, so a full check with that threshold would fail too; a different
//! count of NaN or ±∞ is proven outright. Nothing is ever proven equal: a permutation of the
//! elements leaves every statistic unchanged, so "no difference proven" is the most a summary
//! comparison says — never a pass.
//!
//! The bounds, for m finite elements on both sides (each statistic an interval that holds its
//! f64 summation error, γ_{n+s+2}·Σ|terms| for n elements in s shards summed in any order):
//! - spread: ‖D‖² ≥ (Δs₁)²/m + (‖c⊥‖ − ‖r⊥‖)², where x⊥ = x − mean(x), ‖x⊥‖² = s₂ − s₁²/m
//!   (D's components along the all-ones vector and orthogonal to it);
//! - norm: ‖D‖ ≥ |‖c‖ − ‖r‖| (the triangle inequality);
//! - absolute sum: ‖D‖ ≥ |Σ|c| − Σ|r|| / √m;
//! - extremes: ‖D‖ ≥ ‖sort(c) − sort(r)‖ restricted to the k largest and k smallest positions
//!   (sorting is a contraction in ℓ₂: ⟨sort c, sort r⟩ ≥ ⟨c, r⟩ by the rearrangement
//!   inequality), the two ends summed when 2k ≤ m.
//!
//! Thresholds are relative (τ/‖r‖, as in a full check's report): one for every tensor, or per
//! id from the JSON report of a full check of an earlier step (`report.verdicts[*].threshold`).

use std::collections::HashMap;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::io::guard::printable;
use crate::io::summary::{Summary, SummaryEntry, SummaryRun, SummaryStep};
use crate::trace::{Axis, Layout, Mesh, Placement};

const U: f64 = f64::EPSILON / 2.0;

/// The relative thresholds a summary comparison judges lower bounds against.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SummaryThresholds {
    /// For every tensor without one of its own.
    pub rtol: Option<f64>,
    /// Per id (from a full check's report).
    pub per_id: HashMap<String, f64>,
}

impl SummaryThresholds {
    /// The relative thresholds of a full check's JSON report (`ttrace check --json`): its
    /// `report.verdicts[*].{id, threshold}` (a null threshold, one the check could not price,
    /// gives none).
    pub fn from_check_report(text: &str) -> Result<SummaryThresholds> {
        let bad = |reason: String| Error::InvalidParameter {
            name: "thresholds",
            reason,
        };
        let v = crate::io::guard::parse_json_strict(text.as_bytes()).map_err(bad)?;
        let verdicts = v
            .get("report")
            .and_then(|r| r.get("verdicts"))
            .and_then(|x| x.as_array())
            .ok_or_else(|| bad("not a ttrace check report (no report.verdicts)".into()))?;
        let mut per_id = HashMap::new();
        for x in verdicts {
            let id = x.get("id").and_then(|i| i.as_str());
            // JSON has no infinity: a threshold the check could not price is null, and gives
            // the tensor none here.
            let t = x
                .get("threshold")
                .filter(|t| !t.is_null())
                .map(|t| t.as_f64());
            match (id, t) {
                (Some(_), None) => {}
                (Some(id), Some(Some(t))) if t.is_finite() && t >= 0.0 => {
                    per_id.insert(id.to_string(), t);
                }
                _ => {
                    return Err(bad(
                        "a verdict without an id, or whose threshold is not a non-negative \
                         number (or null)"
                            .into(),
                    ))
                }
            }
        }
        Ok(SummaryThresholds { rtol: None, per_id })
    }

    fn of(&self, id: &str) -> Option<f64> {
        self.per_id.get(id).copied().or(self.rtol)
    }
}

/// What a pair of summaries proves about one tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Proof {
    /// The lower bound exceeds the threshold: a full check would fail.
    BeyondThreshold,
    /// The runs' NaN, +∞ or −∞ counts differ: an element is non-finite on one side only.
    NonFinite {
        /// NaN, +∞, −∞ of the reference.
        reference: [u64; 3],
        /// The same of the candidate.
        candidate: [u64; 3],
    },
    /// A replicated tensor's copies disagree (the candidate's, or the reference's).
    ReplicasDisagree {
        /// `reference` or `candidate`.
        run: &'static str,
        /// The axis of the replication.
        axis: String,
        /// The first rank whose copy's statistics differ from its group's first copy's.
        rank: usize,
    },
}

/// One tensor's lower bound.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorBound {
    /// The id.
    pub id: String,
    /// A lower bound on ‖c − r‖₂ over the finite elements.
    pub lower: f64,
    /// `lower` / ‖r‖ (∞ for a nonzero bound on a zero reference).
    pub rel_lower: f64,
    /// The statistic that gave it (`spread`, `norm`, `absolute sum`, `extremes`).
    pub by: &'static str,
    /// The relative threshold it was judged against, if any.
    pub threshold: Option<f64>,
    /// What is proven, if anything.
    pub proof: Option<Proof>,
}

/// One step of a summary comparison.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepComparison {
    /// The training step.
    pub step: u64,
    /// Tensors compared (a lower bound computed).
    pub compared: usize,
    /// The tensor with the largest relative lower bound.
    pub largest: Option<TensorBound>,
    /// Tensors proven to differ, in execution order.
    pub proven: Vec<TensorBound>,
    /// Tensors that could not be compared, with the reason.
    pub not_comparable: Vec<(String, String)>,
}

/// The comparison of two summary traces.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SummaryCheck {
    /// Per step both hold, in step order.
    pub steps: Vec<StepComparison>,
    /// Steps only one run holds: (reference's count, candidate's count).
    pub unmatched_steps: (usize, usize),
    /// What was left out of the traces and why.
    pub notes: Vec<String>,
    /// Whether any threshold applied (without one, only non-finite counts and replicas can
    /// prove a difference).
    pub thresholds: bool,
}

impl SummaryCheck {
    /// Differences proven, over all steps.
    pub fn proven(&self) -> usize {
        self.steps.iter().map(|s| s.proven.len()).sum()
    }

    /// The first step and tensor proven to differ.
    pub fn first_proven(&self) -> Option<(u64, &TensorBound)> {
        self.steps
            .iter()
            .find_map(|s| s.proven.first().map(|t| (s.step, t)))
    }
}

/// A statistic known to lie in `[lo, hi]`.
#[derive(Clone, Copy, Debug)]
struct Iv {
    lo: f64,
    hi: f64,
}

impl Iv {
    fn around(v: f64, err: f64) -> Iv {
        Iv {
            lo: v - err,
            hi: v + err,
        }
    }
    fn sqrt(self) -> Iv {
        Iv {
            lo: self.lo.max(0.0).sqrt() * (1.0 - 2.0 * U),
            hi: self.hi.max(0.0).sqrt() * (1.0 + 2.0 * U),
        }
    }
}

/// The least distance between two intervals, rounded down (its subtraction's error taken off).
fn gap(a: Iv, b: Iv) -> f64 {
    let d = |x: f64, y: f64| (x - y) - 4.0 * U * (x.abs() + y.abs());
    d(a.lo, b.hi).max(d(b.lo, a.hi)).max(0.0)
}

/// The merged logical tensor of one run.
struct Merged {
    shape: Vec<usize>,
    n: u64,
    summary: Summary,
    /// Shards summed (for the summation error).
    shards: u64,
}

impl Merged {
    fn finite(&self) -> u64 {
        self.summary.finite(self.n)
    }
    fn counts(&self) -> [u64; 3] {
        [self.summary.nan, self.summary.pinf, self.summary.ninf]
    }
    /// γ for the sums: n elements, `shards` partial sums, one more rounding of the squares.
    fn gamma(&self) -> f64 {
        let k = self.n.saturating_add(self.shards).saturating_add(2) as f64 * U;
        // Beyond 2⁵² elements (only a hostile file claims that many) no bound holds.
        if k < 0.5 {
            k / (1.0 - k)
        } else {
            f64::INFINITY
        }
    }
    fn s1(&self) -> Iv {
        let g = self.gamma();
        Iv::around(self.summary.sum, g * self.summary.sum_abs * (1.0 + 2.0 * g))
    }
    fn nonneg(&self, v: f64) -> Iv {
        let g = self.gamma();
        Iv {
            lo: v * (1.0 - 2.0 * g),
            hi: v * (1.0 + 2.0 * g),
        }
    }
}

/// Why shards give no logical tensor's statistics: they cannot be merged, or replicas
/// disagree (a finding).
enum Unmerged {
    NotComparable(String),
    Replicas { axis: String, rank: usize },
}

/// Merge one id's shards (`by_rank[r]`, every rank's entry) under `layout`.
fn merge(
    by_rank: &[&SummaryEntry],
    layout: &Layout,
    mesh: &Mesh,
) -> std::result::Result<Merged, Unmerged> {
    // The mesh's axes of more than one rank (by position in the mesh).
    let axes: Vec<usize> = (0..mesh.axes().len())
        .filter(|&k| mesh.axes()[k].1 > 1)
        .collect();
    let name = |k: usize| &mesh.axes()[k].0;
    let mut shape = by_rank[0].shape.clone();
    for &k in &axes {
        let (a, size) = (name(k), mesh.axes()[k].1);
        match layout.along(a) {
            Placement::Partial => {
                return Err(Unmerged::NotComparable(format!(
                    "a partial sum over {}: the statistics of a sum are not those of its addends",
                    a.name()
                )))
            }
            Placement::Split { dim, .. } | Placement::CpChunks { dim } => {
                if dim >= shape.len() {
                    return Err(Unmerged::NotComparable(format!(
                        "its layout splits dimension {dim} of a shard of shape {shape:?}"
                    )));
                }
                // A shape no tensor could have (a hostile file) is not compared.
                shape[dim] = match shape[dim].checked_mul(size) {
                    Some(d) => d,
                    None => {
                        return Err(Unmerged::NotComparable(format!(
                            "its merged shape overflows (dimension {dim} of {shape:?} times {size})"
                        )))
                    }
                };
            }
            Placement::Replicate => {}
        }
    }
    let replicated: Vec<usize> = axes
        .iter()
        .copied()
        .filter(|&k| layout.along(name(k)) == Placement::Replicate)
        .collect();
    let mut members = vec![];
    for (r, e) in by_rank.iter().enumerate() {
        if e.shape != by_rank[0].shape {
            return Err(Unmerged::NotComparable(format!(
                "shards of different shapes ({:?} on rank 0, {:?} on rank {r})",
                by_rank[0].shape, e.shape
            )));
        }
        let c = mesh.coords(r);
        match replicated.iter().find(|&&k| c[k] != 0) {
            None => members.push(*e),
            Some(&k) => {
                let mut first = c.clone();
                replicated.iter().for_each(|&b| first[b] = 0);
                if by_rank[mesh.rank(&first)].summary != e.summary {
                    return Err(Unmerged::Replicas {
                        axis: name(k).name().to_string(),
                        rank: r,
                    });
                }
            }
        }
    }
    let mut s = Summary::empty(0);
    let mut n: u64 = 0;
    let overflow = || Unmerged::NotComparable("its merged element count overflows".into());
    for e in &members {
        let x = &e.summary;
        // Each shard's counts are at most its elements, so they cannot overflow where the
        // element count does not.
        n = n.checked_add(e.elements()).ok_or_else(overflow)?;
        s.nan += x.nan;
        s.pinf += x.pinf;
        s.ninf += x.ninf;
        s.sum += x.sum;
        s.sum_sq += x.sum_sq;
        s.sum_abs += x.sum_abs;
        s.top.extend_from_slice(&x.top);
        s.bottom.extend_from_slice(&x.bottom);
    }
    if !(s.sum.is_finite() && s.sum_sq.is_finite() && s.sum_abs.is_finite()) {
        return Err(Unmerged::NotComparable(
            "its merged sums overflow f64".into(),
        ));
    }
    // The union's min(k, finite) largest values are among the shards' min(kᵢ, finiteᵢ)
    // largest when k ≤ every kᵢ (and the smallest likewise).
    let k = members.iter().map(|e| e.summary.k).min().unwrap_or(1);
    s.k = k;
    s.top.sort_by(|a, b| b.total_cmp(a));
    s.bottom.sort_by(|a, b| a.total_cmp(b));
    let finite = s.finite(n) as usize;
    s.top.truncate(k.min(finite));
    s.bottom.truncate(k.min(finite));
    Ok(Merged {
        shape,
        n,
        summary: s,
        shards: members.len() as u64,
    })
}

/// Merge, settling guessed split axes from the reference's shape: a guessed split that gives
/// a shape other than `want` is tried as a replication.
fn merge_settled(
    by_rank: &[&SummaryEntry],
    mesh: &Mesh,
    want: Option<&[usize]>,
) -> std::result::Result<Merged, Unmerged> {
    let e = by_rank[0];
    let guessed: Vec<Axis> = e
        .guessed
        .iter()
        .filter(|a| {
            matches!(
                e.layout.along(a),
                Placement::Split { .. } | Placement::CpChunks { .. }
            )
        })
        .cloned()
        .collect();
    let first = merge(by_rank, &e.layout, mesh);
    let (Some(want), false) = (want, guessed.is_empty()) else {
        return first;
    };
    if matches!(&first, Ok(m) if m.shape == want) {
        return first;
    }
    for mask in 1u32..(1 << guessed.len()) {
        let mut layout = e.layout.clone();
        for (i, a) in guessed.iter().enumerate() {
            if mask & (1 << i) != 0 {
                layout.set(a.clone(), Placement::Replicate);
            }
        }
        let m = merge(by_rank, &layout, mesh);
        if matches!(&m, Ok(x) if x.shape == want) {
            return m;
        }
    }
    first
}

/// The lower bound on ‖c − r‖₂ over the finite elements and the statistic that gave it
/// (both sides with `m` finite elements).
fn lower_bound(r: &Merged, c: &Merged) -> (f64, &'static str) {
    let m = r.finite();
    if m == 0 {
        return (0.0, "norm");
    }
    let mf = m as f64;
    let sm = mf.sqrt() * (1.0 + 2.0 * U);
    let (r2, c2) = (r.nonneg(r.summary.sum_sq), c.nonneg(c.summary.sum_sq));
    let mut best = (gap(c2.sqrt(), r2.sqrt()), "norm");
    let mut take = |v: f64, by: &'static str| {
        if v > best.0 {
            best = (v, by);
        }
    };
    take(
        gap(c.nonneg(c.summary.sum_abs), r.nonneg(r.summary.sum_abs)) / sm,
        "absolute sum",
    );
    // Spread: the component along the all-ones vector and the one orthogonal to it.
    let (r1, c1) = (r.s1(), c.s1());
    let perp = |s1: Iv, s2: Iv| {
        let sq = |x: f64| x * x;
        let (lo_sq, hi_sq) = if s1.lo <= 0.0 && s1.hi >= 0.0 {
            (0.0, sq(s1.lo).max(sq(s1.hi)))
        } else {
            (sq(s1.lo).min(sq(s1.hi)), sq(s1.lo).max(sq(s1.hi)))
        };
        let d = |x: f64, y: f64| x - y - 4.0 * U * (x.abs() + y.abs());
        let u = |x: f64, y: f64| x - y + 4.0 * U * (x.abs() + y.abs());
        Iv {
            lo: d(s2.lo, hi_sq * (1.0 + 2.0 * U) / mf),
            hi: u(s2.hi, lo_sq * (1.0 - 2.0 * U) / mf),
        }
        .sqrt()
    };
    let along = gap(c1, r1) / sm;
    let across = gap(perp(c1, c2), perp(r1, r2));
    take(
        (along * along + across * across).sqrt() * (1.0 - 4.0 * U),
        "spread",
    );
    // Extremes: sorted order statistics, the two ends disjoint when 2k ≤ m.
    let ends = |a: &[f64], b: &[f64]| -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| {
                let d = (x - y).abs() * (1.0 - 2.0 * U);
                d * d
            })
            .sum::<f64>()
    };
    let (top, bottom) = (
        ends(&c.summary.top, &r.summary.top),
        ends(&c.summary.bottom, &r.summary.bottom),
    );
    let k = c.summary.top.len().min(r.summary.top.len()) as u64;
    let ext = if 2 * k <= m {
        top + bottom
    } else {
        top.max(bottom)
    };
    let scale = 1.0 - (4 * k + 8) as f64 * U;
    take(ext.sqrt() * scale, "extremes");
    best
}

/// One step's ids in order, and each id's entries in rank order.
type ById<'a> = (Vec<&'a str>, HashMap<&'a str, Vec<&'a SummaryEntry>>);

/// The entries of one step by id, each with its every rank's entry.
fn by_id(lines: &[SummaryStep]) -> Result<ById<'_>> {
    let mut order = vec![];
    let mut map: HashMap<&str, Vec<&SummaryEntry>> = HashMap::new();
    for line in lines {
        for e in &line.tensors {
            let v = map.entry(e.id.as_str()).or_default();
            if v.is_empty() {
                order.push(e.id.as_str());
            }
            v.push(e);
        }
    }
    let world = lines.len();
    if let Some(id) = order.iter().find(|id| map[*id].len() != world) {
        return Err(Error::UnknownName {
            kind: "tensor",
            name: format!(
                "{} (step {}: not summarized by every rank)",
                printable(id),
                lines[0].step
            ),
        });
    }
    Ok((order, map))
}

/// Compare one step both traces hold.
fn compare_step(
    r: &[SummaryStep],
    c: &[SummaryStep],
    thresholds: &SummaryThresholds,
) -> Result<StepComparison> {
    let (rmesh, cmesh) = (r[0].mesh.clone(), c[0].mesh.clone());
    let (rorder, rmap) = by_id(r)?;
    let (corder, cmap) = by_id(c)?;
    let mut out = StepComparison {
        step: r[0].step,
        compared: 0,
        largest: None,
        proven: vec![],
        not_comparable: vec![],
    };
    let mut skip = |id: &str, why: String| out.not_comparable.push((id.to_string(), why));
    let mut bounds = vec![];
    for id in rorder {
        let Some(cs) = cmap.get(id) else {
            skip(id, "not in the candidate".into());
            continue;
        };
        let both = merge(&rmap[id], &rmap[id][0].layout, &rmesh)
            .map_err(|u| (u, "reference"))
            .and_then(|rm| {
                merge_settled(cs, &cmesh, Some(&rm.shape))
                    .map(|cm| (rm, cm))
                    .map_err(|u| (u, "candidate"))
            });
        let (rm, cm) = match both {
            Ok(pair) => pair,
            Err((Unmerged::NotComparable(why), _)) => {
                skip(id, why);
                continue;
            }
            Err((Unmerged::Replicas { axis, rank }, run)) => {
                bounds.push(replicas(id, run, &axis, rank));
                continue;
            }
        };
        if cm.shape != rm.shape {
            skip(
                id,
                format!("shapes differ: {:?} against {:?}", cm.shape, rm.shape),
            );
            continue;
        }
        let threshold = thresholds.of(id);
        if cm.counts() != rm.counts() {
            bounds.push(TensorBound {
                id: id.to_string(),
                lower: f64::INFINITY,
                rel_lower: f64::INFINITY,
                by: "non-finite counts",
                threshold,
                proof: Some(Proof::NonFinite {
                    reference: rm.counts(),
                    candidate: cm.counts(),
                }),
            });
            continue;
        }
        let (lower, by) = lower_bound(&rm, &cm);
        let rn = rm.nonneg(rm.summary.sum_sq).sqrt();
        let rel_lower = if lower == 0.0 {
            0.0
        } else if rn.lo > 0.0 {
            lower / rn.lo
        } else {
            f64::INFINITY
        };
        let beyond = threshold.is_some_and(|t| lower > t * rn.hi);
        bounds.push(TensorBound {
            id: id.to_string(),
            lower,
            rel_lower,
            by,
            threshold,
            proof: beyond.then_some(Proof::BeyondThreshold),
        });
    }
    for id in corder {
        if !rmap.contains_key(id) {
            skip(id, "not in the reference".into());
        }
    }
    for b in bounds {
        out.compared += 1;
        if out
            .largest
            .as_ref()
            .is_none_or(|l| b.rel_lower > l.rel_lower)
        {
            out.largest = Some(b.clone());
        }
        if b.proof.is_some() {
            out.proven.push(b);
        }
    }
    Ok(out)
}

fn replicas(id: &str, run: &'static str, axis: &str, rank: usize) -> TensorBound {
    TensorBound {
        id: id.to_string(),
        lower: 0.0,
        rel_lower: 0.0,
        by: "replicas",
        threshold: None,
        proof: Some(Proof::ReplicasDisagree {
            run,
            axis: axis.to_string(),
            rank,
        }),
    }
}

/// Compare two summary traces, step by step (the steps both hold).
///
/// # Errors
/// A malformed summary file ([`Error::File`]), ranks that disagree on a step or a mesh, a
/// tensor not summarized by every rank of one run ([`Error::UnknownName`]), and no step or
/// no tensor in common, or one directory given twice ([`Error::InvalidParameter`]: a
/// comparison of nothing is never reported).
///
/// # Examples
/// ```no_run
/// use ttrace::check::{compare_summaries, SummaryThresholds};
/// use ttrace::io::summary::SummaryRun;
/// let mut r = SummaryRun::open("ref".as_ref())?;
/// let mut c = SummaryRun::open("cand".as_ref())?;
/// let t = SummaryThresholds { rtol: Some(1e-2), ..Default::default() };
/// let out = compare_summaries(&mut r, &mut c, &t)?;
/// println!("{} differences proven", out.proven());
/// # Ok::<(), ttrace::Error>(())
/// ```
pub fn compare_summaries(
    reference: &mut SummaryRun,
    candidate: &mut SummaryRun,
    thresholds: &SummaryThresholds,
) -> Result<SummaryCheck> {
    // One directory under two names (or a link to it) holds the same statistics whatever
    // they are: nothing can be proven, so the comparison is refused (as a full check's is).
    let same = match (
        reference.path().canonicalize(),
        candidate.path().canonicalize(),
    ) {
        (Ok(x), Ok(y)) => x == y,
        _ => reference.path() == candidate.path(),
    };
    if same {
        return Err(Error::InvalidParameter {
            name: "candidate",
            reason: format!(
                "the candidate {} is the reference {} itself: a summary trace compared with \
                 itself proves nothing — give the other run's",
                printable(&candidate.path().display().to_string()),
                printable(&reference.path().display().to_string())
            ),
        });
    }
    let mut steps = vec![];
    let (mut only_r, mut only_c) = (0, 0);
    let mut r = reference.next_step()?;
    let mut c = candidate.next_step()?;
    while let (Some(rs), Some(cs)) = (&r, &c) {
        let (a, b) = (rs[0].step, cs[0].step);
        if a < b {
            only_r += 1;
            r = reference.next_step()?;
        } else if b < a {
            only_c += 1;
            c = candidate.next_step()?;
        } else {
            steps.push(compare_step(rs, cs, thresholds)?);
            r = reference.next_step()?;
            c = candidate.next_step()?;
        }
    }
    while r.is_some() {
        only_r += 1;
        r = reference.next_step()?;
    }
    while c.is_some() {
        only_c += 1;
        c = candidate.next_step()?;
    }
    let nothing = |reason: String| Error::InvalidParameter {
        name: "summaries",
        reason,
    };
    if steps.is_empty() {
        return Err(nothing(format!(
            "no step in common ({only_r} step(s) in {}, {only_c} in {}): nothing compared",
            reference.path().display(),
            candidate.path().display()
        )));
    }
    if steps.iter().all(|s| s.compared == 0) {
        let why = steps[0]
            .not_comparable
            .first()
            .map(|(id, why)| format!(" ({}: {why})", printable(id)))
            .unwrap_or_default();
        return Err(nothing(format!(
            "no tensor could be compared in {} step(s){why}",
            steps.len()
        )));
    }
    let mut notes = std::mem::take(&mut reference.notes);
    notes.append(&mut candidate.notes);
    Ok(SummaryCheck {
        steps,
        unmatched_steps: (only_r, only_c),
        notes,
        thresholds: thresholds.rtol.is_some() || !thresholds.per_id.is_empty(),
    })
}
