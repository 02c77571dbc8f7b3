//! Comparison thresholds for scaled dot-product attention, O = softmax(s·QKᵀ + mask)·V of one
//! head, each side in its form (standard, or online/flash with its key block) and order, on
//! the same Q, K, V (`papers/bounds-attention.md`).
//!
//! What is executed is the engine's attention (`engine::attention`): S = fl(fl(QKᵀ)·s) in the
//! accumulator A with s = ra(1/√d); standard: P = fl_I(softmax(S)) then O = P·V accumulated in
//! A; online with key block B: per block e = ra(exp(ra(S − m_B))), l_B = Σ e, O_B = fl_I(e)·V_B,
//! merged with α = ra(exp(ra(m_old − m))), β = ra(exp(ra(m_B − m))), then O = O/l; O rounded to
//! the output format. Every value below is the exact one (computed in f64 from the inputs
//! rounded to I); u is the unit roundoff 2^-p of A, u_I of I.
//!
//! Per query row i (unmasked keys j, n_i of them, R_i = max S − min S, nb key blocks) and
//! output column l, with P the exact probabilities, O_il = Σ P_ij V_jl and W_il = Σ P_ij |V_jl|:
//! * scores: |ΔS_ij| ≤ γ_{d+2}·T_ij, T_ij = s·Σ_t |q_it k_jt| (the dot's d roundings, the
//!   products' and the scale's; Higham, *Accuracy and Stability*, 2nd ed., §3.1);
//! * numerators, each a product of factors (1 + δ): the subtraction S − m (u·R_i, an absolute
//!   error of the exponent), the exponential, the rounding to I, the division, and online the
//!   factor chain — one β (u·R_i + 2u) and the α's after it (u·Σ|Δm| + 2u each, Σ|Δm| ≤ R_i);
//! * the denominator, a sum of positive terms: n_i + 3nb roundings of partial sums of positive
//!   terms (the merges' two products and sum), plus its terms' own errors;
//! * P·V: γ_{n_i + 3nb + 1} relative to W_il (each rounding of a partial sum, the products'
//!   and the merges', at most u times a partial sum bounded by W_il).
//!
//! **Guaranteed.** A score error of at most Δ_i in row i moves every P_ij by a factor within
//! e^{±2Δ_i} (the numerator by e^{±Δ}, the denominator too), and every other error is a factor
//! (1 + δ) on a positive term P_ij·|V_jl|; so one side's |O_il − O_il^exact| ≤ W_il·(e^E − 1),
//! E = 2Δ_i + ν_i + σ_i + γ'_PV, each a bound on the logarithm of its factors: a rounding
//! (1 + δ), |δ| ≤ a, by a/(1 − a) (1 − a ≥ e^{−a/(1−a)}), an absolute error e of an exponent
//! by e, the subtractions S − m seeing the computed scores' range R_i + 2Δ_i. The two sides' bounds add, and the output rounding adds one ulp of
//! the larger value (`ElementDiff::round_both`).
//!
//! **Probabilistic** (first order, the uniform model: each rounding an independent relative
//! error of variance u²/3; Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019): one side's error
//! in O_il is the sum of
//! * Σ_j P_ij (V_jl − O_il) ΔS_ij (the softmax's Jacobian applied to the score errors, exact
//!   to first order), variance Σ_j P_ij² (V_jl − O_il)² (u²/3)(d + 2) T_ij²;
//! * Σ_j P_ij V_jl n_ij, the numerators' own errors, variance Σ_j (P_ij V_jl)² v_ij with
//!   v_ij = (u²/3)((|S_ij − m_i| + 1)² + 2) + u_I²/3;
//! * online, the factor chain, shared by a block: at most W_il·u·√((2R_i² + 2nb + 4)/3);
//! * −O_il·σ_i, the denominator's common error, σ_i of variance (u²/3)(n_i + 3nb) + max_j v_ij
//!   + the chain's;
//! * P·V's roundings, (u²/3)(n_i + 3nb + 1)·W_il², and the final division's, (u²/3)·O_il².
//!
//! These parts are not independent of each other (the chain and σ share roundings), so their
//! standard deviations add (Minkowski), and so do the two sides' (a difference of two correlated
//! errors has a standard deviation at most the sum of theirs). The d elements of a row share the
//! score and denominator errors: a row is one cluster of the tensor threshold
//! (`ThresholdSums::add_cluster`), whose random parts are priced as one component. The
//! second-order remainder of the guaranteed composition, W_il·(e^E − 1 − E) per side, is a
//! deterministic part of unknown sign (`ElementDiff::bias_bound`).
//!
//! Roundings below the normal range err by up to half a subnormal step whatever the value:
//! (n_i + 3nb + 2)·tiny·(max|V| + 1) per side, tiny the larger smallest subnormal of A and I,
//! is added to both bounds as a deterministic part. A score or an output whose magnitude can
//! reach the accumulator's or the output's overflow threshold is refused ([`Error::Overflow`]):
//! the dot products' partial sums reach Σ|q k| before the scale, times 1 + γ_{d+2}; the
//! denominators keys·(1 + γ), an online side's unnormalized output keys·max|V|·(1 + γ). An
//! accumulator whose γ_n reaches 1 for the longest reduction has no bound at all
//! ([`Error::NoFiniteBound`]).
//!
//! Both sides must read the inputs in the same format, accumulate in the same format (FP32 or
//! coarser) and round the output to the same format; orders and forms may differ. A side with
//! an FP8 scaling recipe is refused.

use crate::bounds::checked::{checked_by_executions, each_member, Executions};
use crate::bounds::compare::{Confidence, ElementDiff, Threshold, ThresholdSums};
use crate::bounds::op::model::{Gain, OpModel, OpOptions, OpSide, Operand, OperandRole};
use crate::error::{Error, Result};
use crate::format::Format;
use crate::order::Order;
use crate::policy::{AttentionImpl, Policy, Scaling};
use crate::tensor::Tensor;
use crate::trace::ModuleKind;

/// The threshold on ‖O_cand − O_ref‖_F of one head's attention O = softmax(s·QKᵀ + mask)·V
/// (`q` [m, d], `k` [n, d], `v` [n, dv]; s = ra(1/√d) in the accumulator; `causal`: key j
/// masked for query i when j > i, torch's `is_causal`), the reference side's arithmetic and
/// form against the candidate's (module docs; `papers/bounds-attention.md`).
///
/// # Errors
///
/// [`Error::ShapeMismatch`] for operands that are not matrices of matching sizes;
/// [`Error::InvalidParameter`] for sides that read or accumulate in different formats, an
/// accumulator finer than FP32, an FP8 scaling recipe, split-K partial results in a format
/// that does not hold the accumulator's values, or an online block of 0;
/// [`Error::NonFinite`] for a non-finite input; [`Error::Overflow`] where a dot product's
/// partial sums (before the scale), a denominator or an output can reach the accumulator's or
/// the output format's overflow threshold; [`Error::NoFiniteBound`] where the accumulator is
/// too narrow for the reductions' length (γ_n ≥ 1 for n = keys + 3·blocks + 1 or d + 2: BF16
/// accumulation of 127 keys or more in the standard form).
///
/// A probabilistic threshold is checked first by the engine's executions of both sides: where
/// their difference exceeds the model's threshold at δ_s = min(δ, 10⁻³) (the norm or one
/// element), the data carry structure the model does not capture and the guaranteed threshold
/// is returned, its `confidence` saying so (papers/bounds-reductions.md §4).
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{attention_threshold, Confidence, OpSide};
/// use ttrace::{Format, Tensor};
/// let x = |seed: u64| {
///     let v = (0..16 * 8).map(|i| ((i as u64 * 37 + seed) % 17) as f64 / 8.0 - 1.0).collect();
///     Tensor::from_vec(&[16, 8], v, Format::BF16)
/// };
/// let (q, k, v) = (x(1)?, x(2)?, x(3)?);
/// let r: OpSide = "in=bf16,acc=f32,out=bf16".parse()?;
/// let c: OpSide = "in=bf16,acc=f32,out=bf16,form=online:4".parse()?;
/// let t = attention_threshold(&q, &k, &v, true, &r, &c, Confidence::default_probabilistic())?;
/// let g = attention_threshold(&q, &k, &v, true, &r, &c, Confidence::Guaranteed)?;
/// assert!(0.0 < t.abs_frobenius && t.abs_frobenius <= g.abs_frobenius);
/// # Ok::<(), ttrace::Error>(())
/// ```
pub fn attention_threshold(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    reference: &OpSide,
    candidate: &OpSide,
    confidence: Confidence,
) -> Result<Threshold> {
    let build = |conf| attention_model(q, k, v, causal, (reference, candidate), conf);
    checked_by_executions(confidence, &build, &|| {
        executions((q, k, v), causal, reference, candidate)
    })
}

/// Both sides' attention as the engine executes it (for every member of a family), `None`
/// where it cannot: an engine error, or operands other than self-attention's (Q, K and V of one shape,
/// which the engine reads packed per token).
pub(crate) fn executions(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    causal: bool,
    reference: &OpSide,
    candidate: &OpSide,
) -> Option<Executions> {
    // The engine runs self-attention: Q, K and V of one shape, packed per token.
    let (m, d) = (q.shape().first()?, q.shape().get(1)?);
    if k.shape() != q.shape() || v.shape() != q.shape() {
        return None;
    }
    let mut qkv = Vec::with_capacity(3 * m * d);
    for i in 0..*m {
        for t in [q, k, v] {
            qkv.extend_from_slice(&t.values()[i * d..(i + 1) * d]);
        }
    }
    let qkv = Tensor::from_vec(&[1, *m, 3 * d], qkv, Format::F64).ok()?;
    each_member((&reference.policy, &candidate.policy), |cand, p| {
        let form = if cand { candidate.form } else { reference.form };
        let (o, _) = crate::engine::attention(&qkv, 1, causal, form, p).ok()?;
        Some(o.into_values())
    })
}

/// [`attention_threshold`] as the model prices it (not checked by the executions).
fn attention_model(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    (reference, candidate): (&OpSide, &OpSide),
    confidence: Confidence,
) -> Result<Threshold> {
    let (m, _) = matrix(q, "q")?;
    let (_, dv) = matrix(v, "v")?;
    let mut sums = ThresholdSums::new(confidence, m * dv);
    let (norm, same) = add_head(q, k, v, causal, (reference, candidate), &mut sums)?;
    if same {
        return Ok(Threshold::identical(confidence, norm, m * dv));
    }
    Ok(sums.threshold(norm))
}

/// Add one head's rows to `sums` (each row one cluster: [`attention_threshold`]'s model) and
/// return ‖O‖_F of the head and whether the two sides execute identically (then nothing is
/// added). The checker prices an attention site's heads into one tensor threshold this way
/// (`check::attention_site`).
///
/// # Errors
///
/// [`attention_threshold`]'s.
pub(crate) fn add_head(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    (reference, candidate): (&OpSide, &OpSide),
    sums: &mut ThresholdSums,
) -> Result<(f64, bool)> {
    let (m, d) = matrix(q, "q")?;
    let (n, dk) = matrix(k, "k")?;
    let (nv, dv) = matrix(v, "v")?;
    if dk != d || nv != n {
        return Err(Error::ShapeMismatch {
            what: format!("attention: q [{m}, {d}] and v [{nv}, {dv}] need k of shape [{nv}, {d}]"),
            expected: vec![nv, d],
            found: vec![n, dk],
        });
    }
    let (rp, cp) = (&reference.policy, &candidate.policy);
    check_sides(rp, cp, reference.form, candidate.form)?;
    for (t, name) in [(q, "q"), (k, "k"), (v, "v")] {
        if let Some(i) = t.values().iter().position(|x| !x.is_finite()) {
            return Err(Error::NonFinite {
                what: format!("attention threshold: operand {name}[{i}]"),
                value: t.values()[i],
            });
        }
    }
    let input = rp.input();
    let round = |t: &Tensor| -> Vec<f64> {
        t.values()
            .iter()
            .map(|&x| input.round(x, rp.input_overflow(input)))
            .collect()
    };
    let (q, k, v) = (round(q), round(k), round(v));
    let acc = rp.accumulator();
    let scale = acc.round(1.0 / (d as f64).sqrt(), rp.accumulation.overflow);
    let same = rp.same_execution(cp) && reference.form == candidate.form;
    let mut norm2 = 0.0;
    let sides = [Side::of(rp, reference.form), Side::of(cp, candidate.form)];
    let mut members: Vec<(ElementDiff, usize)> = Vec::with_capacity(dv);
    for i in 0..m {
        let keys = if causal { (i + 1).min(n) } else { n };
        let row = Row::exact(&q[i * d..(i + 1) * d], &k, &v, keys, d, dv, scale);
        // A dot product's partial sums are at most Σ|q k| (unscaled: the scale multiplies the
        // finished dot), P·V's at most W, each times the growth of its roundings, at most
        // 1 + γ_n over n terms (Higham 2002, Lemma 3.1); beyond the accumulator's range the
        // result may be infinite. (A 1 % margin on the scaled T missed the FP16 dots of
        // 300 values near 30, 2.7·10⁵ before the scale: infinite scores priced finite.)
        // The denominator's partial sums are at most the number of keys (each numerator at
        // most 1), an online side's unnormalized output at most keys·max|V|.
        // The bounds below take γ_n of the accumulator for n = d + 2 (the scores) and
        // keys + 3·blocks + 1 (P·V, online blocks counted), each as a relative error below 1:
        // where γ_n ≥ 1 (or n·u ≥ 1, where it does not exist) no finite bound holds (BF16
        // accumulation of 300 keys: the bounds came out negative or NaN, and a per-element
        // threshold of 0 for differences of 0.2).
        let blocks = sides
            .iter()
            .map(|s| s.block.map_or(0, |b| keys.div_ceil(b.max(1))))
            .max()
            .unwrap_or(0);
        let longest = (d + 2).max(keys + 3 * blocks + 1);
        if !acc.gamma(longest).is_some_and(|g| g < 1.0) {
            return Err(Error::NoFiniteBound {
                what: format!("attention of query row {i}"),
                reason: format!(
                    "{keys} keys and head dimension {d} accumulated in {acc}: γ_n ≥ 1 for \
                     n = {longest} (Higham's γ_n = nu/(1 − nu)), so no rounding bound holds"
                ),
            });
        }
        let growth = |terms: usize| acc.gamma(terms + 2).map_or(f64::INFINITY, |g| 1.0 + g);
        let w = row.w.iter().fold(0.0f64, |a, &b| a.max(b));
        let online = sides.iter().any(|s| s.block.is_some());
        let unnormalized = if online { row.vmax } else { 0.0 };
        let out_reach = w * growth(keys);
        let acc_reach = (row.dot_reach * growth(d))
            .max(row.tmax * growth(d))
            .max(keys as f64 * growth(keys))
            .max(keys as f64 * unnormalized * growth(keys))
            .max(out_reach);
        for (f, reach) in [(acc, acc_reach), (rp.output, out_reach)] {
            if reach >= f.max_finite() {
                return Err(Error::Overflow {
                    what: format!("attention: a score or an output of query row {i}"),
                    format: f,
                    magnitude: reach,
                });
            }
        }
        members.clear();
        for l in 0..dv {
            let o = row.o[l];
            norm2 += o * o;
            if same {
                continue;
            }
            let (mut g, mut sd, mut rest) = (0.0, 0.0, 0.0);
            for s in &sides {
                let (gs, sds, second) = s.element(&row, l, d);
                g += gs;
                sd += sds;
                rest += second;
            }
            let mut e = ElementDiff {
                bias_bound: rest,
                guaranteed: g,
                proxy: sd * sd,
                ..ElementDiff::default()
            };
            if rp.output.precision() < acc.precision() {
                e.round_both(rp.output, o);
            }
            members.push((e, 1));
        }
        if !same && keys > 0 {
            sums.add_cluster(&members);
        }
    }
    Ok((norm2.sqrt(), same))
}

/// One head's attention computed in f64 from its operands' values (`q` [m, d], `k` [n, d],
/// `v` [n, dv], row-major; scale 1/√d; `causal` as in [`attention_threshold`]): O [m, dv], the
/// exact output up to f64's roundings. The checker measures with it the difference two runs'
/// inputs carry into an attention core (`check::attention_site`).
pub(crate) fn exact_attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (m, n): (usize, usize),
    (d, dv): (usize, usize),
    causal: bool,
) -> Vec<f64> {
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = Vec::with_capacity(m * dv);
    for i in 0..m {
        let keys = if causal { (i + 1).min(n) } else { n };
        if keys == 0 {
            out.extend(std::iter::repeat_n(f64::NAN, dv));
            continue;
        }
        out.extend(Row::exact(&q[i * d..(i + 1) * d], k, v, keys, d, dv, scale).o);
    }
    out
}

/// The rows and columns of a matrix operand.
fn matrix(t: &Tensor, name: &str) -> Result<(usize, usize)> {
    match *t.shape() {
        [r, c] => Ok((r, c)),
        _ => Err(Error::ShapeMismatch {
            what: format!("attention operand {name} must be a matrix (one head)"),
            expected: vec![2],
            found: vec![t.shape().len()],
        }),
    }
}

/// The formats a reduction in `order` rounds its partial results to besides the accumulator:
/// split-K's (and its inner order's), for a family its members'.
fn partial_formats(order: &Order, out: &mut Vec<Format>) {
    match order {
        Order::SplitK { inner, partial, .. } => {
            out.push(*partial);
            partial_formats(inner, out);
        }
        Order::AnyOf(members) => members.iter().for_each(|m| partial_formats(m, out)),
        _ => {}
    }
}

/// Both sides read in one format, accumulate in one format no finer than FP32 and round the
/// output to one format, without FP8 scaling, their partial results (split-K) in formats that
/// hold the accumulator's values; online blocks of at least one key.
fn check_sides(r: &Policy, c: &Policy, rf: AttentionImpl, cf: AttentionImpl) -> Result<()> {
    let bad = |reason: String| Error::InvalidParameter {
        name: "policy",
        reason: format!("attention thresholds: {reason}"),
    };
    r.validate()?;
    c.validate()?;
    if r.input() != c.input() || r.accumulator() != c.accumulator() || r.output != c.output {
        return Err(bad(
            "both sides must read, accumulate and write in the same formats (orders and forms \
             may differ)"
                .into(),
        ));
    }
    if r.accumulator().precision() > Format::F32.precision() {
        return Err(bad(format!(
            "an accumulator finer than FP32 ({}) is not modelled: the exact values are \
             computed in f64",
            r.accumulator()
        )));
    }
    if r.scaling != Scaling::None || c.scaling != Scaling::None {
        return Err(bad("FP8 scaling recipes are not modelled".into()));
    }
    // The model prices every rounding at the accumulator's unit roundoff, range and
    // subnormal step: split-K partials in another format (BF16 partials of an FP32
    // accumulator: guaranteed bounds exceeded 100 times in a probe; FP16 partials of a BF16
    // accumulator: infinite results priced finite) are refused.
    let acc = r.accumulator();
    for p in [r, c] {
        let mut partials = vec![];
        partial_formats(&p.accumulation.order, &mut partials);
        if let Some(f) = partials.into_iter().find(|&f| !acc.is_subset_of(f)) {
            return Err(bad(format!(
                "partial results in {f}, which does not hold every value of the accumulator \
                 {acc}, are not modelled (order {})",
                p.accumulation.order
            )));
        }
    }
    for f in [rf, cf] {
        if let AttentionImpl::Online { block: 0 } = f {
            return Err(bad("an online block of 0 keys".into()));
        }
    }
    Ok(())
}

/// One query row's exact quantities.
struct Row<'a> {
    /// Probabilities of the unmasked keys.
    p: Vec<f64>,
    /// Scores minus the row's maximum (≤ 0).
    shifted: Vec<f64>,
    /// s·max(Σ_t (q_t k_jt)⁺, Σ_t (q_t k_jt)⁻) per key: the largest a partial sum of the dot
    /// can be, in any order.
    tpm: Vec<f64>,
    /// Σ_t (s·q_t k_jt)² + S_j² per key: the products' and the scale's rounding variances
    /// (in units of u²/3).
    own: Vec<f64>,
    /// The unmasked keys' value rows ([keys, dv], borrowed from V).
    v: &'a [f64],
    /// O and W = Σ_j P_j |V_jl| per column.
    o: Vec<f64>,
    w: Vec<f64>,
    /// max(Σ_j (P_j V_jl)⁺, Σ_j (P_j V_jl)⁻) per column: the largest a partial sum of P·V can
    /// be, in any order.
    wpm: Vec<f64>,
    /// The score range (max − min).
    range: f64,
    /// The largest T = s·Σ_t |q_t k_jt| and the largest |V| of the row's keys.
    tmax: f64,
    /// The largest Σ_t |q_t k_jt| of the row's keys, unscaled: the dot products are computed
    /// before the scale multiplies them (`engine::attention`), so their partial sums reach
    /// this, not T.
    dot_reach: f64,
    vmax: f64,
    keys: usize,
}

impl<'a> Row<'a> {
    #[allow(clippy::too_many_arguments)]
    fn exact(
        q: &[f64],
        k: &[f64],
        v: &'a [f64],
        keys: usize,
        d: usize,
        dv: usize,
        scale: f64,
    ) -> Row<'a> {
        let mut s = Vec::with_capacity(keys);
        let mut tmax = 0.0f64;
        let mut tpm = Vec::with_capacity(keys);
        let mut own = Vec::with_capacity(keys);
        let mut dot_reach = 0.0f64;
        for j in 0..keys {
            let kj = &k[j * d..(j + 1) * d];
            let (mut dot, mut pos, mut neg, mut sq) = (0.0, 0.0, 0.0, 0.0);
            for (a, b) in q.iter().zip(kj) {
                let x = a * b;
                dot += x;
                sq += x * x;
                if x > 0.0 {
                    pos += x;
                } else {
                    neg -= x;
                }
            }
            s.push(scale * dot);
            dot_reach = dot_reach.max(pos + neg);
            tmax = tmax.max(scale * (pos + neg));
            tpm.push(scale * pos.max(neg));
            own.push(scale * scale * (sq + dot * dot));
        }
        let max = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let min = s.iter().fold(f64::INFINITY, |a, &b| a.min(b));
        let shifted: Vec<f64> = s.iter().map(|x| x - max).collect();
        let e: Vec<f64> = shifted.iter().map(|x| x.exp()).collect();
        let l: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|x| x / l).collect();
        let vrows = &v[..keys * dv];
        let (mut o, mut w) = (vec![0.0; dv], vec![0.0; dv]);
        let (mut pos, mut neg) = (vec![0.0; dv], vec![0.0; dv]);
        for (j, pj) in p.iter().enumerate() {
            for c in 0..dv {
                let x = pj * vrows[j * dv + c];
                o[c] += x;
                w[c] += x.abs();
                if x > 0.0 {
                    pos[c] += x;
                } else {
                    neg[c] -= x;
                }
            }
        }
        let wpm = pos.iter().zip(&neg).map(|(a, b)| a.max(*b)).collect();
        Row {
            p,
            shifted,
            tmax,
            dot_reach,
            tpm,
            own,
            vmax: vrows.iter().fold(0.0f64, |a, &b| a.max(b.abs())),
            v: vrows,
            o,
            w,
            wpm,
            range: if keys > 0 { max - min } else { 0.0 },
            keys,
        }
    }
}

/// One side's arithmetic: its accumulator's and input's unit roundoffs and its key blocks.
struct Side {
    u: f64,
    u_i: f64,
    /// The smallest subnormal of the accumulator and of I, the larger: what a rounding below
    /// the normal range may err by, absolutely.
    tiny: f64,
    block: Option<usize>,
}

impl Side {
    fn of(p: &Policy, form: AttentionImpl) -> Side {
        Side {
            u: p.accumulator().unit_roundoff(),
            u_i: p.input().unit_roundoff(),
            tiny: p
                .accumulator()
                .min_subnormal()
                .max(p.input().min_subnormal()),
            block: match form {
                AttentionImpl::Standard => None,
                AttentionImpl::Online { block } => Some(block),
            },
        }
    }

    /// This side's error in O_il: (guaranteed bound, standard deviation, second-order
    /// remainder of the guaranteed composition).
    fn element(&self, row: &Row, l: usize, d: usize) -> (f64, f64, f64) {
        let (u, n, r) = (self.u, row.keys as f64, row.range);
        if row.keys == 0 {
            return (0.0, 0.0, 0.0);
        }
        let nb = self.block.map_or(0.0, |b| row.keys.div_ceil(b) as f64);
        let gamma = |k: f64| k * u / (1.0 - k * u);
        let lift = |a: f64| {
            if a < 1.0 {
                a / (1.0 - a)
            } else {
                f64::INFINITY
            }
        };
        let (o, w) = (row.o[l], row.w[l]);
        // Guaranteed: every factor as a bound on |log| of it (a rounding (1 + δ), |δ| ≤ a, by
        // a/(1 − a); an absolute error e of an exponent by e itself).
        let delta = gamma(d as f64 + 2.0) * row.tmax;
        // The computed scores' range, which the subtractions S − m see.
        let r = r + 2.0 * delta;
        let lu = lift(u);
        let chain = if self.block.is_some() {
            2.0 * u * r + (2.0 * nb + 2.0) * lu
        } else {
            0.0
        };
        // What the denominator's terms carry (the subtraction, the exponential, the chain),
        // then the numerator's own (rounding to I, the division), the denominator's sums and
        // P·V's.
        let terms = u * r + lu + chain;
        let numer = terms + lift(self.u_i) + lu;
        let denom = terms + (n + 3.0 * nb) * lu;
        let pv = lift(gamma(n + 3.0 * nb + 1.0));
        let exponent = 2.0 * delta + numer + denom + pv;
        // Roundings below the normal range err absolutely (by half a subnormal step): the
        // numerators that underflow, the probabilities rounded to I, P·V's products and sums.
        let floor = (n + 3.0 * nb + 2.0) * self.tiny * (row.vmax + 1.0);
        // Whatever the scores, O is a weighted mean of V's rows on both sides (the computed
        // weights summing to 1 within the roundings after the scores): |O_c − O| is at most
        // max|V_jl| times 1 + that sum.
        let vcol = (0..row.keys).fold(0.0f64, |a, j| a.max(row.v[j * row.o.len() + l].abs()));
        let cap = vcol * (1.0 + (numer + denom + pv).exp()) + floor;
        let g = (w * exponent.exp_m1() + floor).min(cap);
        let second = (w * (exponent.exp_m1() - exponent) + floor).min(cap);
        // Probabilistic (first order; papers/bounds-attention.md). Every rounding is its own
        // independent error, so their variances add: the errors that reach a key's numerator
        // and the denominator alike (its score, S − m, the exponential) enter as
        // P_j (V_jl − O_l)·ε_j; the numerator's alone (rounding to I, the division, the
        // product with V) as P_j V_jl·ε_j; the denominator's sums as −O_l·ρ; P·V's sums at
        // most u times a partial sum, |partial| ≤ wpm. Online, each rescaling factor (α, β)
        // multiplies whole blocks, in numerator and denominator alike: its exponential's
        // error reaches at most Σ_j P_j |V_jl − O_l| = z (2nb factors, independent), its
        // subtraction's errs by u·|Δm|, and the |Δm| of the factors a key meets sum to at
        // most 2|S_j − m| — so those add, key by key, to at most 2u/√3·Σ_j P_j |V_jl − O_l|·
        // |S_j − m|.
        let third = u * u / 3.0;
        let (mut var, mut z, mut zs) = (0.0, 0.0, 0.0);
        for (j, &pj) in row.p.iter().enumerate() {
            let x = row.v[j * row.o.len() + l];
            let score = third * (row.own[j] + (d as f64 - 1.0).max(0.0) * row.tpm[j].powi(2));
            let exp = third * (row.shifted[j].powi(2) + 1.0);
            var += (pj * (x - o)).powi(2) * (score + exp);
            var += (pj * x).powi(2) * (2.0 * third + self.u_i * self.u_i / 3.0);
            z += pj * (x - o).abs();
            zs += pj * (x - o).abs() * row.shifted[j].abs();
        }
        var += third * (n + 3.0 * nb) * (o * o + row.wpm[l].powi(2)) + third * o * o;
        let sd_chain = if self.block.is_some() {
            u * (z * (2.0 * nb / 3.0).sqrt() + 2.0 * zs / 3f64.sqrt())
        } else {
            0.0
        };
        let sd = var.sqrt() + sd_chain;
        (g, sd, second)
    }
}

/// `attention` (`attention:causal`) in the op registry: one head, operands `q`, `k`, `v`;
/// threshold [`attention_threshold`]; gain in `q` (first order, on the exact probabilities):
/// s·max_j‖k_j‖·max_i √(Σ_l Σ_j P_ij (V_jl − O_il)²).
#[derive(Debug, Clone, Copy)]
pub struct AttentionModel {
    /// torch's `is_causal`: key j masked for query i when j > i.
    pub causal: bool,
}

impl OpModel for AttentionModel {
    fn operand_names(&self) -> &'static [&'static str] {
        &["q", "k", "v"]
    }

    /// Self-attention of `m` tokens with head dimension `k`.
    fn operands(&self, m: usize, k: usize, _n: usize) -> Vec<Operand> {
        ["q", "k", "v"]
            .iter()
            .map(|name| Operand::new(name, &[m, k], OperandRole::Data))
            .collect()
    }

    fn threshold(
        &self,
        inputs: &[&Tensor],
        reference: &OpSide,
        candidate: &OpSide,
        _: &OpOptions,
        confidence: Confidence,
    ) -> Result<Threshold> {
        attention_threshold(
            inputs[0],
            inputs[1],
            inputs[2],
            self.causal,
            reference,
            candidate,
            confidence,
        )
    }

    fn module_kinds(&self) -> &'static [ModuleKind] {
        &[ModuleKind::Attention]
    }

    fn gain(&self, inputs: &[&Tensor], _: &OpOptions) -> Result<Gain> {
        let (m, d) = matrix(inputs[0], "q")?;
        let (n, _) = matrix(inputs[1], "k")?;
        let (_, dv) = matrix(inputs[2], "v")?;
        let (q, k, v) = (inputs[0].values(), inputs[1].values(), inputs[2].values());
        let scale = 1.0 / (d as f64).sqrt();
        let kmax = (0..n)
            .map(|j| {
                k[j * d..(j + 1) * d]
                    .iter()
                    .map(|x| x * x)
                    .sum::<f64>()
                    .sqrt()
            })
            .fold(0.0f64, f64::max);
        let mut worst = 0.0f64;
        for i in 0..m {
            let keys = if self.causal { (i + 1).min(n) } else { n };
            let row = Row::exact(&q[i * d..(i + 1) * d], k, v, keys, d, dv, scale);
            let mut s = 0.0;
            for (j, pj) in row.p.iter().enumerate() {
                for c in 0..dv {
                    let x = row.v[j * dv + c] - row.o[c];
                    s += pj * x * x;
                }
            }
            worst = worst.max(s.sqrt());
        }
        Ok(Gain {
            gain: scale * kmax * worst,
        })
    }
}
