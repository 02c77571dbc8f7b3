//! Introduced error of one execution of a reduction (sum, dot product, one matmul element):
//! a guaranteed bound and the statistics of the probabilistic model.
//!
//! Derivation (papers/bounds-reductions.md §2):
//! * Every rounding j of the reduction rounds an intermediate value to a format F with absolute
//!   error ηⱼ = RN(xⱼ) − xⱼ at the value xⱼ the execution actually rounds; the result's error
//!   is exactly Σⱼ ηⱼ.
//! * **Guaranteed**: Higham's bound along each term's path, Σᵢ |tᵢ|·(Π_f (1 + u_f)^(dᵢ,f) − 1)
//!   (Higham 2002, Thm 2.2 and Lemma 3.1; Higham 1993 for general summation trees), plus half
//!   the smallest subnormal of every rounding's format (underflow, Higham 2002 §2.1), plus the
//!   exact error of rounded products; a rounding that may overflow is an error
//!   ([`Error::Overflow`]). Kahan's order has its own running bound (`kahan_error`, papers §2.4).
//! * **Probabilistic model**: the roundings whose error the exact data determine (see
//!   [`reduction_error`]) are computed exactly and carried as [`ReductionError::mean`]; the
//!   others are independent, zero-mean and uniform on the grid points within ±ulpⱼ/2
//!   (Higham & Mary 2019; Connolly, Higham & Mary 2021, sharpened by a distribution):
//!   E(ηⱼ²) = ulpⱼ²/12 + g²/6 (0 when the operands' grid g reaches the result's spacing). The
//!   uniform law is strictly sub-Gaussian (Buldygin & Kozachenko 2000), so the random part is
//!   sub-Gaussian with proxy [`ReductionError::variance`]; undetermined roundings of
//!   identically computed operands are grouped (a group of k counts k²·E(η²)).

use serde::Serialize;

use crate::error::{Error, Result};
use crate::exact::ExactAccumulator;
use crate::format::Format;
use crate::order::{
    for_each_rounding, value_exponent, Accumulation, Operand, Order, Products, RoundingSite,
};

mod compiled;
mod representable;
mod tensorcore;
mod walk;
pub(crate) use compiled::RandomModel;
pub(crate) use tensorcore::lift_family;
use tensorcore::{family_error, merge_family, tensor_core_error};
pub(crate) use walk::lowest_bit;
use walk::*;

/// Error statistics of one execution of one reduction, in absolute units of its result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ReductionError {
    /// |ŝ − s| ≤ `guaranteed` for these terms, whatever the rounding errors are.
    pub guaranteed: f64,
    /// The deterministic part of ŝ − s: the sum of −t over the roundings that absorb a small
    /// operand t entirely (|t| below half the spacing of the other operand's grid).
    pub mean: f64,
    /// Var(ŝ − s) under the uniform random-rounding model; also the sub-Gaussian variance
    /// proxy of the random part under that model.
    pub variance: f64,
    /// Σ ulp/2 over the ties: an exact operand exactly halfway between two points of the
    /// grid the other operand lies on. Its direction follows the parity of the accumulated
    /// value, which structured data can make systematic — the squares of BF16 values in
    /// [0.5, 1) have even integer parts, so a sequential FP32 sum of squares rounds tie after
    /// tie the same way. Treated as a deterministic error of unknown sign, |·| ≤ this.
    pub tie_bound: f64,
}

impl ReductionError {
    /// Errors of two independent executions added (the statistics of their difference).
    pub fn plus(self, other: ReductionError) -> ReductionError {
        ReductionError {
            guaranteed: self.guaranteed + other.guaranteed,
            mean: self.mean + other.mean,
            variance: self.variance + other.variance,
            tie_bound: self.tie_bound + other.tie_bound,
        }
    }
}

/// Whether the rounding of a term into the accumulator (the first load) is a real rounding.
fn load_rounds(acc: &Accumulation, is_dot: bool) -> bool {
    match (is_dot, acc.products) {
        (false, _) => !acc.input.is_subset_of(acc.accumulator),
        (true, Products::Exact) => true,
        (true, Products::Rounded(f)) => !f.is_subset_of(acc.accumulator),
    }
}

fn check_supported(order: &Order) -> Result<()> {
    match order {
        Order::Kahan => Err(Error::InvalidParameter {
            name: "order",
            reason: "compensated (Kahan) summation is priced as a whole order, not inside a \
                     split-K part"
                .into(),
        }),
        Order::TensorCore(_) | Order::AnyOf(_) => Err(Error::InvalidParameter {
            name: "order",
            reason: format!(
                "'{order}' is priced from the data as a whole order (reduction_error, \
                 matmul_threshold), not here"
            ),
        }),
        Order::SplitK { inner, .. } => check_supported(inner),
        _ => Ok(()),
    }
}

/// The error of one execution of a reduction of the exact `terms` (the values for a sum, the
/// exact products aᵢbᵢ for a dot product) under `acc`. `is_dot` says whether the terms are
/// products (then `acc.products` applies).
///
/// # Model
/// Every rounding j of the reduction errs by ηⱼ = RN(xⱼ) − xⱼ, and the result's error is
/// exactly Σ ηⱼ. The model splits the roundings in two (papers/bounds-reductions.md §2):
/// * **determined** roundings, whose error follows from the exact terms alone: a rounding of
///   exact terms; an exact term t added to a computed value ŝ that lies on the result's grid
///   U in a region of uniform spacing (then RN_U(ŝ + t) − (ŝ + t) = RN_U(t) − t, whatever ŝ
///   is — absorption, repeated terms and residue patterns included); a tie there, whose
///   direction follows from the parity of ŝ/U, tracked along the chain (a tie's result is
///   even, and a determined addition moves the parity by RN_U(t)/U). Their errors are summed
///   exactly into [`ReductionError::mean`]; ties whose parity is unknown go to
///   [`ReductionError::tie_bound`] (sign unknown, at most U/2 each).
/// * **undetermined** roundings, whose outcome depends on low-order bits of computed values
///   that the model does not track (two computed values added, a computed value rounded to a
///   narrower format, a sum crossing into a coarser binade while its parity on the finer grid
///   is unknown, a value whose grid position the rigorous error interval cannot pin down):
///   independent, zero-mean, uniform on the grid
///   points within ±U/2 (variance U²/12 + g²/6, g the operands' grid), summed into
///   [`ReductionError::variance`].
///
/// Which case applies is decided on rigorous intervals (the exact partial sums and every
/// undetermined error at its bound), so the determined errors are the true ones. Besides the
/// parity, each computed value carries a lattice: a power of two it is a multiple of (a
/// rounding's result lies on its grid; an exact sum on its operands' common grid), which tells
/// the parity on every finer grid. The guaranteed field is Higham's bound (Higham 2002, Thm 2.2, Lemma 3.1) with its underflow
/// term (half the smallest subnormal of each rounding's format) and, for rounded products,
/// their exact total error.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::reduction_error;
/// use ttrace::{exact_sum, sum, Accumulation, Format, Order};
///
/// # fn main() -> ttrace::Result<()> {
/// // 1,000 BF16 terms summed sequentially in BF16.
/// let terms: Vec<f64> = (0..1000).map(|i| 1.0 + (i % 7) as f64 / 8.0).collect();
/// let acc = Accumulation::new(Format::BF16, Format::BF16, Order::Sequential);
/// let e = reduction_error(&terms, &acc, false)?;
/// let error = sum(&terms, &acc)? - exact_sum(&terms);
/// assert!(error.abs() <= e.guaranteed);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`Error::Overflow`] when a rounding may reach its format's overflow threshold (no finite
/// bound holds then); [`Error::NonFinite`] for a NaN or infinite term; invalid orders, and
/// [`Order::Kahan`] nested inside a split (Kahan's order itself is priced by a running-bound
/// analysis of its four roundings per term, papers/bounds-reductions.md §2.4).
///
/// Cost: O(n) time and memory for every order.
pub fn reduction_error(terms: &[f64], acc: &Accumulation, is_dot: bool) -> Result<ReductionError> {
    reduction_error_aligned(terms, None, acc, is_dot)
}

/// [`reduction_error`] with the alignment exponents of the terms given (for a tensor core:
/// e_x + e_y of each exact product, which its value alone does not tell; `None`: the terms'
/// own exponents).
pub(crate) fn reduction_error_aligned(
    terms: &[f64],
    exps: Option<&[Option<i32>]>,
    acc: &Accumulation,
    is_dot: bool,
) -> Result<ReductionError> {
    reduction_error_walk(terms, exps, &[], acc, is_dot)
}

/// [`reduction_error`] of computed terms t̂ᵢ known only within `radii[i]` of the model's
/// `terms[i]` (the squares of x − μ̂ for a mean that is not determined). The walk decides on
/// intervals widened by the radii, so a rounding is determined only when it rounds the same
/// way for every term within them (absorbed and systematically rounded squares: issue 34's
/// one-outlier rows); the terms' own deviations are the caller's to price (they cancel in the
/// determined roundings, so counting them everywhere is conservative). Orders priced as a
/// whole (families, tensor cores, Kahan) and rounded products fall back to the all-random
/// model of [`random_rounding_error`].
pub(crate) fn reduction_error_within(
    terms: &[f64],
    radii: &[f64],
    acc: &Accumulation,
    is_dot: bool,
) -> Result<ReductionError> {
    let whole = acc.order.has_family()
        || acc.order.has_tensor_core()
        || (is_dot && matches!(acc.products, Products::Rounded(_)));
    let unsure = radii.len() != terms.len() || radii.iter().any(|r| !(*r >= 0.0 && r.is_finite()));
    if acc.order == Order::Kahan && !whole && !unsure {
        // Kahan's order is priced by its running bound (it had gone to the all-random model,
        // which prices only plain orders and refused it).
        acc.validate()?;
        if let Some(i) = terms.iter().position(|t| !t.is_finite()) {
            return Err(Error::NonFinite {
                what: format!("reduction term {i}"),
                value: terms[i],
            });
        }
        let input = if is_dot { Format::F64 } else { acc.input };
        let load = !input.is_subset_of(acc.accumulator);
        return kahan_error_within(terms, radii, acc.accumulator, load);
    }
    if whole || unsure {
        return random_rounding_error(terms, acc, is_dot);
    }
    reduction_error_walk(terms, None, radii, acc, is_dot)
}

/// [`reduction_error_within`] for any order: a kernel family's members each (a split whose
/// parts run a family, as the family of splits), merged as [`reduction_error`] merges them.
pub(crate) fn reduction_error_within_any(
    terms: &[f64],
    radii: &[f64],
    acc: &Accumulation,
    is_dot: bool,
) -> Result<ReductionError> {
    let Some(members) = lift_family(&acc.order) else {
        return reduction_error_within(terms, radii, acc, is_dot);
    };
    let stats = members
        .into_iter()
        .map(|order| {
            let member = Accumulation {
                order,
                ..acc.clone()
            };
            reduction_error_within(terms, radii, &member, is_dot)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(merge_family(&stats))
}

fn reduction_error_walk(
    terms: &[f64],
    exps: Option<&[Option<i32>]>,
    radii: &[f64],
    acc: &Accumulation,
    is_dot: bool,
) -> Result<ReductionError> {
    reduction_error_walk_with(terms, exps, radii, acc, is_dot, true)
}

/// [`reduction_error_walk`], with `shortcut` whether an all-exact reduction is recognized
/// without the walk (`representable`; off only to test that it gives the walk's result).
fn reduction_error_walk_with(
    terms: &[f64],
    exps: Option<&[Option<i32>]>,
    radii: &[f64],
    acc: &Accumulation,
    is_dot: bool,
    shortcut: bool,
) -> Result<ReductionError> {
    acc.validate()?;
    if let Some(members) = lift_family(&acc.order) {
        return family_error(terms, exps, acc, is_dot, &members);
    }
    if acc.order != Order::Kahan && !acc.order.has_tensor_core() {
        check_supported(&acc.order)?;
    }
    if let Some(i) = terms.iter().position(|t| !t.is_finite()) {
        return Err(Error::NonFinite {
            what: format!("reduction term {i}"),
            value: terms[i],
        });
    }
    let n = terms.len();
    // Rounded products: each product's rounding is computed exactly; the accumulation then
    // runs on the rounded products, which are values of the product format.
    let mut rounded = Vec::new();
    let mut product_error = 0.0;
    let (terms, input) = match (is_dot, acc.products) {
        (true, Products::Rounded(pf)) => {
            let mut e = ExactAccumulator::new();
            for (i, &t) in terms.iter().enumerate() {
                let r = pf.round(t, acc.overflow);
                if !r.is_finite() || r.abs() > pf.max_finite() {
                    return Err(overflow_error(pf, t.abs(), &format!("product {i}")));
                }
                e.add(r);
                e.add(-t);
                rounded.push(r);
            }
            product_error = e.to_f64();
            (&rounded[..], pf)
        }
        (true, Products::Exact) => (terms, Format::F64),
        (false, _) => (terms, acc.input),
    };
    if acc.order.has_tensor_core() {
        let own: Vec<Option<i32>>;
        let exps = match exps {
            Some(e)
                if e.len() == n && matches!((is_dot, acc.products), (true, Products::Exact)) =>
            {
                e
            }
            _ => {
                own = terms.iter().map(|&t| value_exponent(t)).collect();
                &own
            }
        };
        let a = Accumulation {
            input,
            products: Products::Exact,
            ..acc.clone()
        };
        let mut e = tensor_core_error(terms, exps, &a)?;
        e.mean += product_error;
        e.guaranteed = (e.guaranteed + product_error.abs()) * (1.0 + 1e-12);
        return Ok(e);
    }
    if acc.order == Order::Kahan {
        let load = !input.is_subset_of(acc.accumulator);
        let mut e = kahan_error(terms, acc.accumulator, load)?;
        e.mean += product_error;
        e.guaranteed = (e.guaranteed + product_error.abs()) * (1.0 + 1e-12);
        return Ok(e);
    }
    let accumulate = Accumulation {
        input,
        products: Products::Exact,
        ..acc.clone()
    };
    let mut prefix = Vec::with_capacity(n + 1);
    let (mut hi, mut lo, mut abs_sum) = (0.0f64, 0.0f64, 0.0f64);
    prefix.push((0.0, 0.0));
    for &t in terms {
        let (h, e) = two_sum(hi, t);
        hi = h;
        lo += e;
        abs_sum += t.abs();
        prefix.push((hi, lo));
    }
    let lr = !input.is_subset_of(acc.accumulator);
    if shortcut && radii.is_empty() {
        if let Some((underflow, sites)) =
            representable::exact_sites(terms, &prefix, &acc.order, acc.accumulator, lr)
        {
            // Every rounding exact: the walk's result without the walk (no determined error
            // but the products' own, no variance, no tie).
            let guaranteed = guaranteed_bound(terms, radii, &accumulate, underflow, product_error)?;
            return Ok(ReductionError {
                guaranteed,
                mean: product_error,
                variance: 0.0,
                tie_bound: ((sites + 2.0) * f64::EPSILON * product_error.abs()).min(guaranteed),
            });
        }
    }
    let mut walk = Walk {
        terms,
        prefix,
        // The low parts accumulate at most n roundings of size 2^-53 of partial errors, each
        // at most 2^-53 of a partial sum.
        margin: (n as f64 + 2.0) * abs_sum * 2f64.powi(-100) + f64::MIN_POSITIVE,
        overflow: acc.overflow,
        values: Values::default(),
        scratch: ExactAccumulator::new(),
        exact: Vec::new(),
        site_content: 0,
        exact_content: 0,
        mean: product_error,
        mean_abs: product_error.abs(),
        sites: 0.0,
        variance: 0.0,
        repeats: std::collections::BTreeMap::new(),
        tie_bound: 0.0,
        underflow: 0.0,
        overflows: None,
        radii: if radii.is_empty() {
            Vec::new()
        } else {
            std::iter::once(0.0)
                .chain(radii.iter().scan(0.0, |s, r| {
                    *s += r;
                    Some(*s)
                }))
                .collect()
        },
        site_radius: 0.0,
    };
    for_each_rounding(&acc.order, n, acc.accumulator, lr, &mut |s| walk.site(s));
    for (count, var) in walk.repeats.values() {
        walk.variance += count * count * var;
    }
    if let Some((f, magnitude)) = walk.overflows {
        return Err(overflow_error(f, magnitude, "a partial sum"));
    }
    let guaranteed = guaranteed_bound(terms, radii, &accumulate, walk.underflow, product_error)?;
    Ok(ReductionError {
        guaranteed,
        mean: walk.mean,
        variance: walk.variance,
        // The determined errors are summed in f64: their rounding, ≤ (sites + 1)·2^-53 of
        // Σ|η|, joins the part of unknown sign.
        tie_bound: (walk.tie_bound + (walk.sites + 2.0) * f64::EPSILON * walk.mean_abs)
            .min(guaranteed),
    })
}

/// The walk's guaranteed bound: Higham's per-term bound from the accumulation depths, the
/// underflow terms (carried through later roundings by at most the growth factor), and the
/// products' exact rounding error.
fn guaranteed_bound(
    terms: &[f64],
    radii: &[f64],
    accumulate: &Accumulation,
    underflow: f64,
    product_error: f64,
) -> Result<f64> {
    let depths = accumulate.sum_depths(terms.len())?;
    let mut growth: f64 = 0.0;
    let mut higham = 0.0;
    for (i, (t, d)) in terms.iter().zip(&depths).enumerate() {
        let g = d.relative_error_bound();
        higham += (t.abs() + radii.get(i).copied().unwrap_or(0.0)) * g;
        growth = growth.max(g);
    }
    Ok(((higham + underflow) * (1.0 + growth) + product_error.abs()) * (1.0 + 1e-12))
}

/// Per-term weights w and a constant c such that the guaranteed bound [`reduction_error`]
/// gives for exact products accumulated under `acc` is at most Σₚ |tₚ|·wₚ + c, whatever the
/// products tₚ: Higham's depths with the growth factor, and the underflow term counted at
/// every rounding the order performs (the walk counts it at the non-empty ones). Orders
/// priced as a whole (families, tensor cores, Kahan) are not described by depths alone: the
/// caller keeps them on the walk.
pub(crate) fn dot_guaranteed_weights(acc: &Accumulation, n: usize) -> Result<(Vec<f64>, f64)> {
    let accumulate = Accumulation {
        input: Format::F64,
        products: Products::Exact,
        ..acc.clone()
    };
    let g: Vec<f64> = accumulate
        .sum_depths(n)?
        .iter()
        .map(|d| d.relative_error_bound())
        .collect();
    let growth = g.iter().copied().fold(0.0, f64::max);
    let mut underflow = 0.0;
    for_each_rounding(&acc.order, n, acc.accumulator, true, &mut |s| {
        underflow += s.format.min_subnormal() / 2.0;
    });
    let f = (1.0 + growth) * (1.0 + 1e-12);
    Ok((g.iter().map(|x| x * f).collect(), underflow * f))
}

/// The error of Kahan's compensated summation of the exact `terms` in format `f` (the first
/// term loaded with a rounding when `load`), as `order::sum` executes it: s = fl(x₀), c = 0;
/// y = fl(xᵢ − c), t = fl(s + y), c = fl(fl(t − s) − y), s = t.
///
/// # Derivation (papers/bounds-reductions.md §2.4)
/// With V = s − c, one step gives exactly V' = V + xᵢ + η₁ − η₃ − η₄ (η₁, η₃, η₄ the errors of
/// y, of t − s and of the new c), so the result s_n = V_n + c_n errs by
/// Σᵢ (η₁ − η₃ − η₄) + c_n, and c' = η₂ + η₃ + η₄ (η₂ the error of t). Each |η| ≤ u·|v| +
/// λ/2 for the value v it rounds (λ the smallest subnormal: Higham 2002, §2.1), and the
/// magnitudes are bounded step by step from the exact partial sums; when |s| ≥ |y| is certain,
/// η₃ = η₄ = 0 (Dekker's Fast2Sum), so
/// * guaranteed: the propagated Σ(|η₁| + |η₃| + |η₄|) + |c_n| — between u·Σ|xᵢ| and 3u·Σ|xᵢ|
///   to first order (η₃ only at steps where |s| ≥ |y| is not certain; Knuth's and Goldberg's
///   2u + O(nu²) for terms already in the format, with the second-order terms carried; terms
///   of a wider format are rounded once more in y: F32 terms 0.627, −4.666, −0.041 summed in
///   F16 err by 2.29·u·Σ|xᵢ|, within this bound's 2.65·u·Σ|xᵢ|);
/// * probabilistic: the η independent and zero-mean, each uniform within its bound
///   (variance bound²/3), and c_n a deterministic part of unknown sign (`tie_bound`).
pub(crate) fn kahan_error(terms: &[f64], f: Format, load: bool) -> Result<ReductionError> {
    kahan_error_within(terms, &[], f, load)
}

/// [`kahan_error`] of terms each known within its radius (`radii`, one per term, or empty for
/// exact terms): every magnitude the bounds take is raised by the term's radius, and every
/// partial sum's by the radii summed so far.
pub(crate) fn kahan_error_within(
    terms: &[f64],
    radii: &[f64],
    f: Format,
    load: bool,
) -> Result<ReductionError> {
    let u = f.unit_roundoff();
    let half_sub = f.min_subnormal() / 2.0;
    let eta = |v: f64| u * v + half_sub;
    let (mut exact, mut bound_v, mut bound_c) = (0.0f64, 0.0f64, 0.0f64);
    let mut variance = 0.0;
    let mut first = true;
    // The radii summed so far (in f64, raised a little for its own roundings).
    let mut spread = 0.0f64;
    for (i, &x) in terms.iter().enumerate() {
        let r = radii.get(i).copied().unwrap_or(0.0);
        spread = (spread + r) * (1.0 + 1e-15);
        if first {
            first = false;
            exact = x;
            if load {
                let e0 = eta(x.abs() + r);
                bound_v = e0;
                variance += e0 * e0 / 3.0;
            }
            continue;
        }
        let xc = x.abs() + r + bound_c;
        let e1 = eta(xc);
        let y = xc * (1.0 + u) + half_sub;
        let s = exact.abs() + spread + bound_v + bound_c;
        let s_min = exact.abs() - spread - bound_v - bound_c;
        let e2 = eta(s + y);
        // Fast2Sum (Dekker 1971): when |s| ≥ |y|, t − s and then (t − s) − y are exact.
        let (e3, e4) = if y <= s_min {
            (0.0, 0.0)
        } else {
            let e3 = eta(y + e2);
            (e3, eta(e2 + e3))
        };
        let limit = overflow_threshold(f);
        if s + y >= limit {
            return Err(overflow_error(f, s + y, "a partial sum"));
        }
        bound_v += e1 + e3 + e4;
        bound_c = e2 + e3 + e4;
        variance += (e1 * e1 + e3 * e3 + e4 * e4) / 3.0;
        exact += x;
    }
    Ok(ReductionError {
        guaranteed: (bound_v + bound_c) * (1.0 + 1e-12),
        mean: 0.0,
        variance,
        tie_bound: bound_c,
    })
}

/// The magnitude from which rounding to `f` (to nearest) overflows: its largest finite value
/// plus half a spacing there.
pub(crate) fn overflow_threshold(f: Format) -> f64 {
    f.max_finite() + f.ulp(f.max_finite()).unwrap_or(0.0) / 2.0
}

pub(crate) fn overflow_error(f: Format, magnitude: f64, what: &str) -> Error {
    Error::Overflow {
        what: what.to_string(),
        format: f,
        magnitude,
    }
}

/// The all-random model of one execution, for composing sweep thresholds where the
/// candidate's order is only approximated (`validate::fresh`): every inexact rounding is an
/// independent zero-mean error (absorption and ties aside), none is computed from the data.
/// [`reduction_error`] determines what the data determine instead.
pub fn random_rounding_error(
    terms: &[f64],
    acc: &Accumulation,
    is_dot: bool,
) -> Result<ReductionError> {
    acc.validate()?;
    if acc.order == Order::Kahan && !(is_dot && matches!(acc.products, Products::Rounded(_))) {
        // Kahan's own model is a running bound, random in every rounding already.
        let input = if is_dot { Format::F64 } else { acc.input };
        return kahan_error(terms, acc.accumulator, !input.is_subset_of(acc.accumulator));
    }
    check_supported(&acc.order)?;
    let n = terms.len();
    // Prefix sums of the exact terms: the value a rounding rounds is a range sum.
    let mut prefix = Vec::with_capacity(n + 1);
    prefix.push(0.0f64);
    let mut run = 0.0;
    for &t in terms {
        run += t;
        prefix.push(run);
    }
    let range_sum = |r: &std::ops::Range<usize>| {
        if r.is_empty() {
            0.0
        } else {
            prefix[r.end] - prefix[r.start]
        }
    };
    // The grid an operand lies on: a term's own last bit, or the spacing of the format an
    // earlier rounding put its value in.
    let quantum = |op: &Operand| -> f64 {
        match op {
            Operand::None => f64::INFINITY,
            Operand::Term(i) => lowest_bit(terms[*i]),
            Operand::Value {
                first,
                second,
                format,
            } => {
                let v = range_sum(first) + range_sum(second);
                if v == 0.0 {
                    format.min_subnormal()
                } else {
                    format.ulp(v).unwrap_or(0.0)
                }
            }
        }
    };
    let mut variance = 0.0;
    let mut mean = 0.0;
    let mut tie_bound = 0.0;
    // A rounding to spacing `ulp` of an exact value on the grid of spacing g: exact when
    // g ≥ ulp; otherwise the error takes the values k·g, |k·g| ≤ ulp/2, uniformly, with
    // E(η²) = ulp²/12 + g²/6 and |η| ≤ ulp/2.
    let site_variance = |f: Format, value: f64, g: f64| -> f64 {
        let ulp = f.ulp(value).unwrap_or(0.0);
        if g >= ulp {
            0.0
        } else {
            ulp * ulp / 12.0 + g * g / 6.0
        }
    };
    // Identical additions onto the same grid make identical errors: an exact small operand t
    // added to a value on the grid of spacing U errs by RN_U(t) − t whatever that value is, so
    // k additions of the same t onto the same U add k·η, not √k·η. Low-precision data repeat
    // (the squares of a BF16 row take as many values as the row), so these sites are grouped
    // by (U, t) and a group of k contributes k²·Var(η).
    // Ordered by key, so that the variance is summed in the same order on every call (a
    // HashMap's iteration order differs between instances: the last bits would too).
    let mut repeats: std::collections::BTreeMap<(u64, u64), (f64, f64)> =
        std::collections::BTreeMap::new();
    // Products rounded to a product format: one rounding per exact product.
    if is_dot {
        if let Products::Rounded(pf) = acc.products {
            for &t in terms {
                variance += site_variance(pf, t, 0.0);
            }
        }
    }
    let value_of = |op: &Operand| -> f64 {
        match op {
            Operand::None => 0.0,
            Operand::Term(i) => terms[*i],
            Operand::Value { first, second, .. } => range_sum(first) + range_sum(second),
        }
    };
    let lr = load_rounds(acc, is_dot);
    for_each_rounding(
        &acc.order,
        n,
        acc.accumulator,
        lr,
        &mut |s: RoundingSite| {
            let v = range_sum(&s.first) + range_sum(&s.second);
            let ulp = s.format.ulp(v).unwrap_or(0.0);
            // Absorption: when the larger operand lies on the result's grid and the rest is
            // smaller than half a spacing, the rounding returns the larger operand and the error
            // is exactly minus the rest — deterministic, and one-signed for positive data.
            let (a, b) = (
                value_of(&s.ops[0]),
                value_of(&s.ops[1]) + s.fused.clone().map(|i| terms[i]).sum::<f64>(),
            );
            let (big_op, small_op, small) = if a.abs() >= b.abs() {
                (&s.ops[0], &s.ops[1], b)
            } else {
                (&s.ops[1], &s.ops[0], a)
            };
            let big_on_grid = (s.fused.is_empty() || a.abs() >= b.abs()) && quantum(big_op) >= ulp;
            if big_on_grid && small != 0.0 && small.abs() < ulp / 2.0 {
                mean -= small;
                return;
            }
            // A tie: an exact small operand exactly halfway between grid points.
            let small_exact = !s.fused.is_empty() || matches!(small_op, Operand::Term(_));
            if big_on_grid && small_exact && ulp > 0.0 {
                let r = small / ulp;
                if r - r.floor() == 0.5 {
                    tie_bound += ulp / 2.0;
                    return;
                }
            }
            let mut g = quantum(&s.ops[0]).min(quantum(&s.ops[1]));
            for i in s.fused.clone() {
                g = g.min(lowest_bit(terms[i]));
            }
            let var = site_variance(s.format, v, g);
            if big_on_grid && small_exact && var > 0.0 {
                let e = repeats
                    .entry((ulp.to_bits(), small.to_bits()))
                    .or_insert((0.0, var));
                e.0 += 1.0;
            } else {
                variance += var;
            }
        },
    );
    for (count, var) in repeats.values() {
        variance += count * count * var;
    }
    // Guaranteed: Higham's per-term bound from the depths.
    let depths = if is_dot {
        acc.dot_depths(n)?
    } else {
        acc.sum_depths(n)?
    };
    let mut guaranteed = 0.0;
    let mut roundings = 0u64;
    for (t, d) in terms.iter().zip(&depths) {
        guaranteed += t.abs() * d.relative_error_bound();
        roundings += d.total() as u64;
    }
    if is_dot && acc.products == Products::Exact {
        // A rounding of a sum that includes an exact product may underflow: at most half the
        // smallest subnormal of the accumulator per rounding (counted generously).
        guaranteed += roundings as f64 * acc.accumulator.min_subnormal() / 2.0;
    }
    let mut e = with_growth(guaranteed * (1.0 + 1e-12), variance, &depths);
    e.mean = mean;
    e.tie_bound = tie_bound.min(e.guaranteed);
    Ok(e)
}

/// Summary statistics of i.i.d. terms, for planning without data.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TermStats {
    /// E(t).
    pub mean: f64,
    /// E(t²).
    pub mean_square: f64,
    /// E|t|.
    pub mean_abs: f64,
}

impl TermStats {
    /// Statistics of a product a·b of independent a and b with the given statistics.
    pub fn product(a: TermStats, b: TermStats) -> TermStats {
        TermStats {
            mean: a.mean * b.mean,
            mean_square: a.mean_square * b.mean_square,
            mean_abs: a.mean_abs * b.mean_abs,
        }
    }

    /// A normal distribution N(mean, std²).
    pub fn normal(mean: f64, std: f64) -> TermStats {
        // E|X| of a normal: std·√(2/π)·exp(−μ²/2σ²) + μ·(1 − 2Φ(−μ/σ)); with μ = 0: std·√(2/π).
        let mean_abs = if mean == 0.0 {
            std * (2.0 / std::f64::consts::PI).sqrt()
        } else {
            // Upper bound sqrt(E[X²]) (Jensen) when μ ≠ 0.
            (mean * mean + std * std).sqrt()
        };
        TermStats {
            mean,
            mean_square: mean * mean + std * std,
            mean_abs,
        }
    }
}

/// E(ulp_F(x)²) / E(x²) for x whose significand is log-uniform in its binade:
/// ∫₁² (2u/m)² dm / (m ln 2) = 4u²·(3/8)/ln 2 ≈ 2.164u².
pub(crate) fn mean_ulp_sq_ratio(f: Format) -> f64 {
    let u = f.unit_roundoff();
    4.0 * u * u * 0.375 / std::f64::consts::LN_2
}

/// The *expected* error statistics of one execution of a reduction of `n` i.i.d. terms with the
/// given statistics (planning without data). Partial sums of m terms have
/// E(s²) = m·E(t²) + m(m−1)·E(t)², and E(ulp(s)²) ≈ 2.164·u²·E(s²). The guaranteed field is
/// the bound's expectation, Σ E|tᵢ|·(growth of term i): a planning figure, not a guarantee.
///
/// # Examples
///
/// ```
/// use ttrace::bounds::{planned_reduction_error, TermStats};
/// use ttrace::{Accumulation, Format, Order};
///
/// # fn main() -> ttrace::Result<()> {
/// // A 4096-term dot product of standard normal BF16 vectors, accumulated in FP32.
/// let stats = TermStats::product(TermStats::normal(0.0, 1.0), TermStats::normal(0.0, 1.0));
/// let sequential = Accumulation::new(Format::BF16, Format::F32, Order::Sequential);
/// let pairwise = Accumulation::new(Format::BF16, Format::F32, Order::pairwise(1));
/// let s = planned_reduction_error(4096, stats, &sequential, true)?;
/// let p = planned_reduction_error(4096, stats, &pairwise, true)?;
/// // Pairwise summation has depth log2(n) instead of n: smaller expected error and bound.
/// assert!(p.variance < s.variance && p.guaranteed < s.guaranteed);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`] for an invalid accumulation, no terms or more than
/// [`MAX_PLANNED_TERMS`], or Kahan summation inside a split-K part.
pub fn planned_reduction_error(
    n: usize,
    stats: TermStats,
    acc: &Accumulation,
    is_dot: bool,
) -> Result<ReductionError> {
    acc.validate()?;
    check_planned_length(n)?;
    check_supported(&acc.order)?;
    let second_moment = |m: usize| {
        let m = m as f64;
        m * stats.mean_square + m * (m - 1.0) * stats.mean * stats.mean
    };
    let mut variance = 0.0;
    let mut add = |f: Format, m: usize| {
        // Without data the grid of the terms is unknown: every rounding is taken to be inexact.
        let e_ulp_sq = mean_ulp_sq_ratio(f) * second_moment(m);
        variance += e_ulp_sq / 12.0;
    };
    if is_dot {
        if let Products::Rounded(pf) = acc.products {
            for _ in 0..n {
                add(pf, 1);
            }
        }
    }
    let lr = load_rounds(acc, is_dot);
    for_each_rounding(
        &acc.order,
        n,
        acc.accumulator,
        lr,
        &mut |s: RoundingSite| {
            add(s.format, s.first.len() + s.second.len());
        },
    );
    let depths = if is_dot {
        acc.dot_depths(n)?
    } else {
        acc.sum_depths(n)?
    };
    let guaranteed: f64 = depths
        .iter()
        .map(|d| stats.mean_abs * d.relative_error_bound())
        .sum();
    Ok(with_growth(guaranteed, variance, &depths))
}

/// The longest reduction planning evaluates: the model walks every term's rounding sites
/// (about 28 bytes and 80 ns per term), so 2^24 terms take about 1.5 s and 0.5 GB.
pub const MAX_PLANNED_TERMS: usize = 1 << 24;

/// Planning needs 1 ≤ n ≤ [`MAX_PLANNED_TERMS`]: an empty reduction has nothing to price (its
/// result, 0, is exact in any order), and a longer one would exhaust time and memory.
pub(crate) fn check_planned_length(n: usize) -> Result<()> {
    if n == 0 {
        return Err(crate::error::Error::InvalidParameter {
            name: "k",
            reason: "the reduction length must be at least 1 (an empty sum is exactly 0 in any \
                     order: there is nothing to price)"
                .into(),
        });
    }
    if n > MAX_PLANNED_TERMS {
        return Err(crate::error::Error::InvalidParameter {
            name: "k",
            reason: format!(
                "a reduction of {n} terms exceeds the {MAX_PLANNED_TERMS} that planning \
                 evaluates term by term; price a shorter reduction (errors grow like √k) or \
                 split it (blocked order)"
            ),
        });
    }
    Ok(())
}

/// Largest growth factor (Π(1 + u)^d − 1) over the terms above which the first-order random
/// model is not used: when accumulated errors reach 10% of the values (long sums in BF16 or
/// FP8 accumulators), rounding errors stop being independent (stagnation) and only the
/// guaranteed bound is trustworthy.
pub const FIRST_ORDER_LIMIT: f64 = 0.1;

/// Apply the second-order factor: errors made early are multiplied by later (1 + δ) factors,
/// at most (1 + growth); beyond [`FIRST_ORDER_LIMIT`] the statistics fall back to the
/// guaranteed bound (variance = G²).
fn with_growth(
    guaranteed: f64,
    variance: f64,
    depths: &[crate::order::TermDepth],
) -> ReductionError {
    let growth = depths
        .iter()
        .map(|d| d.relative_error_bound())
        .fold(0.0, f64::max);
    growth_applied(guaranteed, variance, growth)
}

/// [`with_growth`] for the largest relative error bound `growth` of the terms' paths.
fn growth_applied(guaranteed: f64, variance: f64, growth: f64) -> ReductionError {
    if growth > FIRST_ORDER_LIMIT {
        return ReductionError {
            guaranteed,
            mean: 0.0,
            variance: guaranteed * guaranteed,
            tie_bound: 0.0,
        };
    }
    ReductionError {
        guaranteed,
        mean: 0.0,
        variance: variance * (1.0 + growth) * (1.0 + growth),
        tie_bound: 0.0,
    }
}
