//! The element test of a linear layer's weight gradient, from its operands.
//!
//! A weight gradient sums one product per token, G = dYᵀX (dY the gradient arriving at the
//! layer's output, `T × out`; X its input, `T × in`; T the tokens of every leading dimension),
//! and a few dominant terms can move single elements far beyond what their row, column and
//! tensor do — which is why the pooled sparse test leaves parameter gradients alone
//! (`verdict::detect`). Where the trace holds the layer's operands, each element gets a bound
//! of its own instead, **guaranteed** (no distribution assumed), from the operands' column
//! norms alone:
//!
//! * aᵢ = ‖dY_{:,i}‖, bⱼ = ‖X_{:,j}‖ (the reference's), αᵢ, βⱼ the same of the two runs'
//!   differences, so that by Cauchy–Schwarz Σₜ |dyₜᵢ xₜⱼ| ≤ aᵢbⱼ and the exact products of
//!   the two runs' operands differ by at most αᵢbⱼ + aᵢβⱼ + αᵢβⱼ;
//! * each run may round the operands to a coarser format first (autocast, TF32: q_r, q_c):
//!   rounding to nearest moves a value by at most u of it (plus half the format's smallest
//!   subnormal λ), so the differences' norms grow by (u_{q_r} + u_{q_c})·max(|r|, |c|) +
//!   (λ_{q_r} + λ_{q_c})/2 per element — over the elements that differ where both runs round
//!   alike, over every element where one rounds otherwise (TF32 on one side) — and the norms
//!   by a factor 1 + max u (plus √T·max λ/2);
//! * each run sums its products in any order in the accumulation format (unit u, FP32 unless
//!   declared): |fl(Σ) − Σ| ≤ γ_T·Σ|terms|, γ_T = Tu/(1 − Tu) (Higham, *Accuracy and Stability
//!   of Numerical Algorithms*, 2nd ed., Lemma 3.1 and §3.1: any order, any blocking);
//! * a run that splits the tokens over P ranks rounds each partial sum to the combining format
//!   and adds the P of them: at most γ_P·Σ|terms| more (`split_factor`);
//! * both round the result to their output format: the stored values differ by at most the
//!   exact ones' difference plus 2u_out·max(|r|, |c|)(1 + 2u_out) + λ_out.
//!
//! An element whose difference exceeds its bound cannot be round-off — under the assumptions
//! stated: the recorded input and output gradient are this layer's operands of its only call
//! in the step (a second call, `{module}#1`, is not tested), and the gradient is dYᵀX (not
//! clipped or rescaled). The reference's own gradient is checked to be that product first (Freivalds' projection on a random sign
//! vector, with the same bound): a parameter shared with another module, a gradient scaled up,
//! or operands that are not this gradient's take the test off. FP8 operands are not tested
//! here (scales that differ between runs move every element). `papers/checking.md` §7.
//!
//! The bound is worst-case, so its power comes from the differences being small: a BF16
//! gradient whose operands are equal in both runs (a tensor-parallel MLP's first layer) has a
//! bound of one unit in the last place plus the accumulation's γ_T·aᵢbⱼ, and four elements
//! scaled by 1.5 — the NCCL #1950 class — are found where the norm cannot see them.

use crate::check::price::{split_factor, Reduced};
use crate::format::Format;
use crate::io::{ModuleInfo, TraceDir};
use crate::policy::{OpClass, Pass, Recipe};
use crate::trace::id::{TensorId, TensorRole};
use crate::trace::stored::Stored;
use crate::trace::{Layout, ModuleKind};
use crate::verdict::{Detector, Finding};

/// Values decoded at a time.
const PIECE: usize = 1 << 14;

/// Elements beyond their bounds listed by the test (for naming the rank that holds them).
pub(crate) const MAX_LISTED: usize = 1024;

/// Column statistics of an operand pair (the last dimension's indices are the columns).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Columns {
    /// Rows: the elements over the columns (the tokens T).
    pub(crate) rows: usize,
    /// ‖r_{:,k}‖ (the reference's column norms), times 1 + u_q, plus √T·λ_q/2.
    pub(crate) norm: Vec<f64>,
    /// ‖(c − r)_{:,k}‖ plus the moves of the runs' roundings to their formats (see the module
    /// docs), by the triangle inequality.
    pub(crate) diff: Vec<f64>,
    /// Σₜ rₜₖ·wₜ for the row weights w, when given (the projection's second half).
    pub(crate) projected: Vec<f64>,
    /// Σₖ rₜₖ·vₖ for each row t, for the column weights v, when given (its first half).
    pub(crate) row_dots: Vec<f64>,
}

/// The column statistics of a pair stored with `cols` columns, the runs rounding to `q` (the
/// reference's format, the candidate's; `None`: no rounding) before their products, in one
/// pass; with
/// column weights v, each row's Σₖ rₜₖvₖ, with row weights w, each column's Σₜ rₜₖwₜ (the
/// reference's values). `None` when a value is not finite or the shapes do not hold whole
/// rows (or the row weights are too few).
pub(crate) fn columns(
    (r, c): (&Stored, &Stored),
    cols: usize,
    q: (Option<Format>, Option<Format>),
    col_weights: Option<&[f64]>,
    row_weights: Option<&[f64]>,
) -> Option<Columns> {
    if cols == 0
        || r.len() != c.len()
        || r.len() % cols != 0
        || col_weights.is_some_and(|v| v.len() != cols)
        || row_weights.is_some_and(|w| w.len() != r.len() / cols)
    {
        return None;
    }
    let rows = r.len() / cols;
    let ul = |q: Option<Format>| q.map_or((0.0, 0.0), |q| (q.unit_roundoff(), q.min_subnormal()));
    let ((ur, lr), (uc, lc)) = (ul(q.0), ul(q.1));
    // The moves of both roundings, and whether they happen where the pair is equal too.
    let (uq, lq) = (ur + uc, (lr + lc) / 2.0);
    let everywhere = q.0 != q.1;
    let (u_max, l_max) = (ur.max(uc), lr.max(lc));
    let mut norm2 = vec![0.0; cols];
    let mut diff2 = vec![0.0; cols];
    let mut flip2 = vec![0.0; cols];
    let mut projected = vec![0.0; if row_weights.is_some() { cols } else { 0 }];
    let mut row_dots = Vec::with_capacity(if col_weights.is_some() { rows } else { 0 });
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let step = PIECE.max(cols) / cols * cols;
    for start in (0..r.len()).step_by(step) {
        let end = (start + step).min(r.len());
        r.decode_range(start, end, &mut a);
        c.decode_range(start, end, &mut b);
        for (row, (ra, cb)) in a.chunks_exact(cols).zip(b.chunks_exact(cols)).enumerate() {
            // Branch-free, so that it vectorizes; a value that is not finite leaves a sum
            // that is not (checked at the end).
            for (((n, e), (&x, &y)), f) in norm2
                .iter_mut()
                .zip(diff2.iter_mut())
                .zip(ra.iter().zip(cb))
                .zip(flip2.iter_mut())
            {
                let d = y - x;
                *n += x * x;
                *e += d * d;
                if uq > 0.0 {
                    let differs = f64::from(u8::from(everywhere || d != 0.0));
                    let fl = (uq * x.abs().max(y.abs()) + lq) * differs;
                    *f += fl * fl;
                }
            }
            if let Some(v) = col_weights {
                row_dots.push(ra.iter().zip(v).map(|(x, v)| x * v).sum());
            }
            if let Some(w) = row_weights {
                let wt = w[start / cols + row];
                for (p, &x) in projected.iter_mut().zip(ra) {
                    *p += x * wt;
                }
            }
        }
    }
    let finite = |v: &[f64]| v.iter().all(|x| x.is_finite());
    if !finite(&norm2) || !finite(&diff2) || !finite(&flip2) || !finite(&row_dots) {
        return None;
    }
    let diff = diff2
        .iter()
        .zip(&flip2)
        .map(|(d, f)| d.sqrt() + f.sqrt())
        .collect();
    let norm = norm2
        .iter()
        .map(|n| (1.0 + u_max) * n.sqrt() + (rows as f64).sqrt() * l_max / 2.0)
        .collect();
    Some(Columns {
        rows,
        norm,
        diff,
        projected,
        row_dots,
    })
}

/// How the two runs computed the gradient, beyond its operands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Arithmetic {
    /// The accumulation format of the products' sums.
    pub(crate) accumulate: Format,
    /// The format results (and partial sums) are rounded to: the coarser of the stored and
    /// the autocast dtypes.
    pub(crate) out: Format,
    /// Partial sums each run combines (1: none), the reference's and the candidate's.
    pub(crate) partials: (usize, usize),
    /// The format each run rounds the operands to before their products, if coarser: the
    /// reference's, the candidate's.
    pub(crate) quantize: (Option<Format>, Option<Format>),
    /// Where the candidate's arriving gradient is read divided by the data-parallel divisor
    /// (each rank averaged its loss over its own share: `check::loss`): the format the
    /// quotients are stored in again, and whether the divisor is a power of two. The engine
    /// divided the gradient's partial sums or result by the same divisor.
    pub(crate) divided: Option<(Format, bool)>,
}

impl Arithmetic {
    /// How far a read quotient of the candidate's arriving gradient may lie from the exact
    /// one: (relative, absolute) — u of its stored format unless the divisor is a power of
    /// two, and half its smallest subnormal (underflow) either way.
    pub(crate) fn read_rounding(&self) -> (f64, f64) {
        match self.divided {
            None => (0.0, 0.0),
            Some((f, pow2)) => (
                if pow2 { 0.0 } else { f.unit_roundoff() },
                f.min_subnormal() / 2.0,
            ),
        }
    }

    /// The engine's division of the candidate's result `c` by the divisor: one rounding more,
    /// u_out(1 + 2u_out)|c| + λ_out/2 (λ_out/2 alone for a power of two).
    pub(crate) fn division_rounding(&self, c: f64) -> f64 {
        let (u, l) = (self.out.unit_roundoff(), self.out.min_subnormal());
        match self.divided {
            None => 0.0,
            Some((_, true)) => l / 2.0,
            Some((_, false)) => u * (1.0 + 2.0 * u) * c.abs() + l / 2.0,
        }
    }
}

/// The element bound's coefficients: for the reference's scale s = aᵢbⱼ and the candidate's
/// s_c = (aᵢ + αᵢ)(bⱼ + βⱼ), the kernels' and combinations' part is k_ref·s + k_cand·s_c.
///
/// The P partial sums each err by at most γ_T of their terms' magnitudes, so their own
/// magnitudes sum to at most (1 + γ_T)·Σ|terms|, and combining them adds γ_P of that.
pub(crate) fn kernel_coefficients(arith: &Arithmetic, rows: usize) -> Option<(f64, f64)> {
    let g = arith.accumulate.gamma(rows)?;
    let comb = |p: usize| {
        if p > 1 {
            arith.out.gamma(p).map(|gp| gp * (1.0 + g))
        } else {
            Some(0.0)
        }
    };
    let k_cand = g + comb(arith.partials.1)?;
    // The engine's division of the candidate's partial sums by a divisor that is not a power
    // of two rounds each of them once more.
    let divided = matches!(arith.divided, Some((_, false)));
    let k_cand = if divided {
        k_cand + arith.out.unit_roundoff() * (1.0 + k_cand)
    } else {
        k_cand
    };
    Some((g + comb(arith.partials.0)?, k_cand))
}

/// Whether the reference's gradient `g` (`out × in`) is the product of its operands: with a
/// random sign vector v over the inputs, |(G v)ᵢ − Σₜ dyₜᵢ (X v)ₜ| within the element bound
/// summed over the row (the reference alone: no difference terms), plus the `f64`
/// evaluation's error. `dy.projected` holds Σₜ dyₜᵢ (X v)ₜ, `xv_abs` Σⱼ bⱼ|vⱼ| = Σⱼ bⱼ.
pub(crate) fn consistent(
    g: &Stored,
    signs: &[f64],
    dy: &Columns,
    x: &Columns,
    arith: &Arithmetic,
) -> bool {
    let (out, inn) = (dy.norm.len(), x.norm.len());
    if g.len() != out * inn || signs.len() != inn {
        return false;
    }
    let Some((k_ref, _)) = kernel_coefficients(arith, dy.rows) else {
        return false;
    };
    let u_out = arith.out.unit_roundoff();
    let l_out = arith.out.min_subnormal();
    // The reference multiplied its operands rounded to q: |q(y)q(x) − yx| ≤ (2u_q + u_q²)|yx|
    // (the norms carry q's subnormal floor already).
    let uq = arith.quantize.0.map_or(0.0, Format::unit_roundoff);
    let k_ref = k_ref + 2.0 * uq + uq * uq;
    let b_sum: f64 = x.norm.iter().sum();
    let mut vals = Vec::new();
    for i in 0..out {
        g.decode_range(i * inn, (i + 1) * inn, &mut vals);
        let (mut gv, mut spacing) = (0.0, 0.0);
        for (&v, &s) in vals.iter().zip(signs) {
            if !v.is_finite() {
                return false;
            }
            gv += v * s;
            // The reference's rounding of its result: at most u_out of it (plus λ/2).
            spacing += u_out * v.abs() * (1.0 + 2.0 * u_out) + l_out;
        }
        let a = dy.norm[i];
        let allowed = k_ref * a * b_sum + spacing;
        // The f64 sums here: each of the ≤ T + in terms errs relatively by at most
        // (T + in)·2⁻⁵³ of the sum of magnitudes, which a·Σb and Σ|G| bound.
        let slack = 1e-12 * (a * b_sum + spacing / u_out.max(f64::MIN_POSITIVE));
        if (gv - dy.projected[i]).abs() > allowed + slack {
            return false;
        }
    }
    true
}

/// The element test of the pair of weight gradients `(r, c)` (`out × in`, row i the output's
/// column i, column j the input's), with the operands' columns `dy` (`out` columns) and `x`
/// (`in` columns): every element against its bound (module docs). The finding's estimate is
/// the worst element's difference over its scale aᵢbⱼ in ε, its threshold that element's
/// bound in ε, the ratio their quotient; beside it, the flat indices of the elements beyond
/// their bounds (the first [`MAX_LISTED`]). `None` when the bound does not exist (γ_T
/// undefined) or the shapes do not fit.
pub(crate) fn element_test(
    r: &Stored,
    c: &Stored,
    dy: &Columns,
    x: &Columns,
    arith: &Arithmetic,
    eps: f64,
) -> Option<(Finding, Vec<usize>)> {
    let (out, inn) = (dy.norm.len(), x.norm.len());
    if r.len() != out * inn || c.len() != r.len() || dy.rows != x.rows {
        return None;
    }
    let (k_ref, k_cand) = kernel_coefficients(arith, dy.rows)?;
    let spacing_format = coarsest(&[arith.out, r.format(), c.format()]);
    let (u_out, l_out) = (
        spacing_format.unit_roundoff(),
        spacing_format.min_subnormal(),
    );
    let mut worst: Option<(f64, usize, f64, f64)> = None; // (ratio, at, |D|, bound)
    let mut count = 0usize;
    let mut listed = Vec::new();
    let (mut a_vals, mut b_vals) = (Vec::new(), Vec::new());
    for i in 0..out {
        r.decode_range(i * inn, (i + 1) * inn, &mut a_vals);
        c.decode_range(i * inn, (i + 1) * inn, &mut b_vals);
        let (a, al) = (dy.norm[i], dy.diff[i]);
        for (j, (&rv, &cv)) in a_vals.iter().zip(&b_vals).enumerate() {
            let d = (cv - rv).abs();
            if d == 0.0 {
                continue;
            }
            if !d.is_finite() {
                return None;
            }
            let (b, be) = (x.norm[j], x.diff[j]);
            let s = a * b;
            let carried = al * b + a * be + al * be;
            let bound = carried
                + k_ref * s
                + k_cand * (a + al) * (b + be)
                + 2.0 * u_out * rv.abs().max(cv.abs()) * (1.0 + 2.0 * u_out)
                + l_out
                + arith.division_rounding(cv);
            // The f64 evaluation of the bound errs by far less than this.
            let bound = bound * (1.0 + 1e-9);
            if d > bound {
                count += 1;
                if listed.len() < MAX_LISTED {
                    listed.push(i * inn + j);
                }
            }
            let ratio = d / bound;
            if worst.is_none_or(|w| ratio > w.0) {
                worst = Some((ratio, i * inn + j, d, bound));
            }
        }
    }
    let (ratio, at, d, bound) = worst.unwrap_or((0.0, 0, 0.0, 0.0));
    let scale = if at < r.len() {
        let (i, j) = (at / inn, at % inn);
        (dy.norm[i] * x.norm[j]).max(f64::MIN_POSITIVE)
    } else {
        f64::MIN_POSITIVE
    };
    let finding = Finding {
        detector: Detector::Sparse,
        estimate: d / scale / eps,
        threshold: bound / scale / eps,
        ratio,
        fired: count > 0,
        at: worst.map(|w| w.1),
        count,
    };
    Some((finding, listed))
}

/// The element test's finding where no element of the pair differs by more than the part
/// of its bound that the final roundings make, 2u_out·max(|r|, |c|)(1 + 2u_out) + λ_out in
/// the coarsest of `out` and the stored formats (a sufficient condition: every bound holds
/// it); estimate and threshold relative to the element's magnitude max(|r|, |c|). `None`
/// where some element differs by more.
pub(crate) fn within_spacing(r: &Stored, c: &Stored, out: Format, eps: f64) -> Option<Finding> {
    let f = coarsest(&[out, r.format(), c.format()]);
    let (u, l) = (f.unit_roundoff(), f.min_subnormal());
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut worst: Option<(f64, usize, f64, f64)> = None;
    for start in (0..r.len()).step_by(PIECE) {
        let end = (start + PIECE).min(r.len());
        r.decode_range(start, end, &mut a);
        c.decode_range(start, end, &mut b);
        for (k, (&x, &y)) in a.iter().zip(&b).enumerate() {
            let d = (y - x).abs();
            if d == 0.0 {
                continue;
            }
            let m = x.abs().max(y.abs());
            let bound = (2.0 * u * m * (1.0 + 2.0 * u) + l) * (1.0 + 1e-9);
            if d.is_nan() || d > bound {
                return None;
            }
            let ratio = d / bound;
            if worst.is_none_or(|w| ratio > w.0) {
                worst = Some((ratio, start + k, d / m, bound / m));
            }
        }
    }
    let (ratio, at, estimate, threshold) = worst.map_or((0.0, None, 0.0, 0.0), |w| {
        (w.0, Some(w.1), w.2 / eps, w.3 / eps)
    });
    Some(Finding {
        detector: Detector::Sparse,
        estimate,
        threshold,
        ratio,
        fired: false,
        at,
        count: 0,
    })
}

/// The coarsest of `formats` (fewest significand bits).
pub(crate) fn coarsest(formats: &[Format]) -> Format {
    formats
        .iter()
        .copied()
        .reduce(crate::verdict::coarser)
        .unwrap_or(Format::F32)
}

/// A sign vector of length `n` (±1), the same for the same `name`.
pub(crate) fn signs(n: usize, name: &str) -> Vec<f64> {
    let mut g = crate::random::SplitMix64::for_name(name, 0);
    (0..n)
        .map(|_| if g.next_u64() >> 63 == 0 { 1.0 } else { -1.0 })
        .collect()
}

/// The operands the element tests of `id` read where it is a linear layer's weight gradient
/// (its input and arriving gradient) or bias gradient (its arriving gradient,
/// `check::bias_grad`), else nothing.
pub(crate) fn operands(reference: &TraceDir, id: &str) -> Vec<String> {
    let Some(t) = TensorId::parse(id) else {
        return Vec::new();
    };
    let TensorRole::ParamGrad { param } = &t.role else {
        return Vec::new();
    };
    if reference.module(id).and_then(|m| m.kind) != Some(ModuleKind::Linear) {
        return Vec::new();
    }
    let dy = TensorId::grad_output(&t.module, 0).to_string();
    match param.as_str() {
        "weight" => vec![TensorId::fwd_input(&t.module, 0).to_string(), dy],
        "bias" => vec![dy],
        _ => Vec::new(),
    }
}

/// How both runs computed a linear layer's parameter gradient beyond its operands, where its
/// element test applies: the layer called once, its operands `operand_ids` held by both
/// traces, no FP8. `None` elsewhere.
pub(crate) struct Setting {
    /// The format each run rounds the operands to before their products, if coarser than
    /// they are stored in (autocast, TF32): the reference's, the candidate's.
    pub(crate) quantize: (Option<Format>, Option<Format>),
    /// The coarsest format the results and partial sums are rounded to.
    pub(crate) out: Format,
    /// The narrowest accumulation format either run declares (FP32 unless declared; F64
    /// where every tensor is F64).
    pub(crate) accumulate: Format,
}

/// The [`Setting`] of the gradient `id` (a parameter of a linear layer) compared as `(r, c)`
/// with the operands `operand_ids`.
pub(crate) fn setting(
    reference: &TraceDir,
    candidate: &TraceDir,
    id: &str,
    module_name: &str,
    operand_ids: &[&str],
    (r, c): (&Stored, &Stored),
    recipe: Option<&Recipe>,
) -> Option<Setting> {
    let module = reference.module(id).cloned();
    let cand_module = candidate.module(id).cloned();
    if module.as_ref().and_then(|m| m.kind) != Some(ModuleKind::Linear) {
        return None;
    }
    // A second call (`{module}#1`, any of its tensors) sums its own products into the
    // gradient.
    let again = format!("{module_name}#1|");
    if [reference, candidate]
        .iter()
        .any(|d| d.ids().iter().any(|i| i.starts_with(&again)))
        || !operand_ids
            .iter()
            .all(|i| reference.contains(i) && candidate.contains(i))
    {
        return None;
    }
    let infos = [module.as_ref(), cand_module.as_ref()];
    // FP8 operands, declared or by the recipe: not tested here.
    let policy = recipe.map(|rc| rc.policy(OpClass::MatmulGradWeight, Pass::Backward).clone());
    let fp8 = |f: Format| matches!(f, Format::E4M3 | Format::E5M2);
    if infos.iter().flatten().any(|m| m.quantize.is_some_and(fp8))
        || policy
            .as_ref()
            .is_some_and(|p| fp8(p.input()) || fp8(p.rhs()))
    {
        return None;
    }
    // The operands' stored formats, from the manifests (every shard's).
    let formats: Vec<Format> = [reference, candidate]
        .iter()
        .flat_map(|d| d.manifest().tensors.iter())
        .filter(|e| operand_ids.contains(&e.id.as_str()))
        .map(|e| e.dtype)
        .collect();
    if formats.iter().any(|f| fp8(*f)) {
        return None;
    }
    let operand_format = coarsest(&formats);
    let setting = |m: &ModuleInfo| {
        [
            m.arith.autocast,
            m.arith
                .fp32_matmul
                .filter(|_| operand_format == Format::F32),
            m.quantize,
        ]
    };
    let q_of = |m: Option<&ModuleInfo>| {
        m.into_iter()
            .flat_map(setting)
            .chain(
                policy
                    .as_ref()
                    .map(|p| [Some(p.input()), Some(p.rhs())])
                    .into_iter()
                    .flatten(),
            )
            .flatten()
            .filter(|f| f.precision() < operand_format.precision())
            .min_by_key(|f| f.precision())
    };
    let quantize = (
        q_of(module.as_ref()),
        q_of(cand_module.as_ref().or(module.as_ref())),
    );
    let rounded = infos
        .iter()
        .flatten()
        .filter_map(|m| m.arith.autocast)
        .chain(infos.iter().flatten().filter_map(|m| m.combine));
    let out = coarsest(
        &[r.format(), c.format()]
            .into_iter()
            .chain(rounded)
            .collect::<Vec<_>>(),
    );
    let wide = [r.format(), c.format(), operand_format]
        .iter()
        .all(|f| *f == Format::F64);
    let accumulate = infos
        .iter()
        .flatten()
        .filter_map(|m| m.accumulate)
        .chain(policy.as_ref().map(|p| p.accumulator()))
        .chain([if wide { Format::F64 } else { Format::F32 }])
        .min_by_key(|f| f.precision())
        .unwrap_or(Format::F32);
    Some(Setting {
        quantize,
        out,
        accumulate,
    })
}

/// The module whose parameter `param` has the gradient `id`, where the pair `(r, c)` has
/// `dims` dimensions and equal shapes.
pub(crate) fn gradient_of(
    id: &str,
    param: &str,
    dims: usize,
    (r, c): (&Stored, &Stored),
) -> Option<String> {
    let t = TensorId::parse(id)?;
    let fits = r.shape().len() == dims && r.shape() == c.shape();
    match t.role {
        TensorRole::ParamGrad { param: p } if p == param && fits => Some(t.module),
        _ => None,
    }
}

/// The element test of the parameter gradient `id` compared as `(r, c)`, where it applies: a
/// linear layer's weight, called once, whose input and arriving gradient both traces hold, in
/// formats other than FP8, and whose reference gradient is the product of its operands; with
/// the elements beyond their bounds (see [`element_test`]).
pub(crate) fn finding(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    id: &str,
    (r, c): (&Stored, &Stored),
    recipe: Option<&Recipe>,
    eps: f64,
) -> Option<(Finding, Vec<usize>)> {
    let module = gradient_of(id, "weight", 2, (r, c))?;
    let x_id = TensorId::fwd_input(&module, 0).to_string();
    let dy_id = TensorId::grad_output(&module, 0).to_string();
    let setting = setting(
        reference,
        candidate,
        id,
        &module,
        &[&x_id, &dy_id],
        (r, c),
        recipe,
    )?;
    let (q, out) = (setting.quantize, setting.out);
    let (out_dim, in_dim) = (r.shape()[0], r.shape()[1]);
    if let Some(f) = within_spacing(r, c, out, eps) {
        // No element differs by more than the final roundings allow, which every element's
        // bound contains: the operands need not be read.
        return Some((f, Vec::new()));
    }
    let v = signs(in_dim, id);
    // The input first (its rows' projections on v), then the arriving gradient: one pair held
    // at a time.
    let (x, x_ranks) = operand(reference, candidate, &x_id, in_dim, q, (Some(&v), None))?;
    let (dy, dy_ranks) = operand(
        reference,
        candidate,
        &dy_id,
        out_dim,
        q,
        (None, Some(&x.row_dots)),
    )?;
    if x.rows != dy.rows {
        return None;
    }
    let arith = arithmetic(
        reference,
        candidate,
        id,
        &setting,
        &[(&x_id, x_ranks), (&dy_id, dy_ranks)],
        &dy_id,
    );
    let mut dy = dy;
    widen_for_division(&mut dy, arith.divided);
    if !consistent(r, &v, &dy, &x, &arith) {
        return None;
    }
    element_test(r, c, &dy, &x, &arith, eps)
}

/// The arriving gradient's columns where the candidate's is read divided (see
/// [`Arithmetic::divided`]): its true operand is the read quotient moved by that rounding, so
/// each column's difference grows by the move's norm, u_s·‖c_{:,i}‖ + √T·λ_s/2 with
/// ‖c_{:,i}‖ ≤ aᵢ + αᵢ.
pub(crate) fn widen_for_division(dy: &mut Columns, divided: Option<(Format, bool)>) {
    if let Some((f, pow2)) = divided {
        let u = if pow2 { 0.0 } else { f.unit_roundoff() };
        let floor = (dy.rows as f64).sqrt() * f.min_subnormal() / 2.0;
        for (d, n) in dy.diff.iter_mut().zip(&dy.norm) {
            *d += u * (n + *d) + floor;
        }
    }
}

/// The coarsest format the trace stores the tensor `id` in (any shard's).
pub(crate) fn dy_format(dir: &TraceDir, id: &str) -> Format {
    coarsest(
        &dir.manifest()
            .tensors
            .iter()
            .filter(|e| e.id == id)
            .map(|e| e.dtype)
            .collect::<Vec<_>>(),
    )
}

/// Column and row weights of a projection (see [`columns`]).
type Weights<'a> = (Option<&'a [f64]>, Option<&'a [f64]>);

/// The columns of the operand `id` of both runs (`cols` of them), and its number of
/// dimensions; the pair is read, passed over once, and handed back.
fn operand(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    id: &str,
    cols: usize,
    q: (Option<Format>, Option<Format>),
    (col_weights, row_weights): Weights<'_>,
) -> Option<(Columns, usize)> {
    read_pair(reference, candidate, id, cols, |r, c| {
        columns((r, c), cols, q, col_weights, row_weights)
    })
}

/// `f` of the operand `id` of both runs, read whole and handed back after, where both are
/// held with the same shape and `cols` columns; with its number of dimensions.
pub(crate) fn read_pair<T>(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    id: &str,
    cols: usize,
    f: impl FnOnce(&Stored, &Stored) -> Option<T>,
) -> Option<(T, usize)> {
    let r = reference.logical_stored(id).ok()?;
    let c = match candidate.logical_stored(id) {
        Ok(c) => c,
        Err(_) => {
            reference.recycle(r);
            return None;
        }
    };
    let fits = r.shape() == c.shape() && r.shape().last() == Some(&cols);
    let ranks = r.shape().len();
    let result = fits.then(|| f(&r, &c)).flatten();
    reference.recycle(r);
    candidate.recycle(c);
    result.map(|x| (x, ranks))
}

/// How both runs computed the gradient `id` of a linear layer in `setting`, its operands
/// `operands` (id, number of dimensions) read, `dy_id` the arriving gradient: the partial
/// sums of each run (the mesh axes that split the tokens) and the division of the
/// candidate's arriving gradient.
pub(crate) fn arithmetic(
    reference: &TraceDir,
    candidate: &TraceDir,
    id: &str,
    setting: &Setting,
    operands: &[(&str, usize)],
    dy_id: &str,
) -> Arithmetic {
    let layout = |d: &TraceDir, i: &str| d.layout(i).unwrap_or_else(Layout::replicated);
    let partials = |d: &TraceDir| {
        let ins: Vec<(Layout, usize)> = operands
            .iter()
            .map(|(i, ranks)| (layout(d, i), *ranks))
            .collect();
        // Microbatches accumulate the gradient as ranks do: one partial sum each.
        split_factor(
            &layout(d, id),
            &ins,
            &d.manifest().mesh,
            Some(Reduced::AllButLast),
        )
        .max(1)
            * d.manifest().microbatches()
    };
    Arithmetic {
        accumulate: setting.accumulate,
        out: setting.out,
        partials: (partials(reference), partials(candidate)),
        quantize: setting.quantize,
        divided: candidate
            .divisor_of(dy_id)
            .map(|d| (dy_format(candidate, dy_id), d.is_power_of_two())),
    }
}

#[cfg(test)]
pub(crate) mod tests;
