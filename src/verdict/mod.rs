//! The verdict on one tensor: a reference and a candidate compared in one pass — the
//! relative Frobenius error ‖c − r‖/‖r‖ against its threshold, the largest absolute and ulp
//! differences, non-finite mismatches, and the tests beyond the norm ([`Detector`]: scale,
//! bias, channel bias, sparse corruption). It sits below the bounds, so a threshold can judge
//! a pair itself ([`Threshold::check`](crate::bounds::Threshold::check)), and below the
//! checker, which judges every tensor of a trace with it. Published through
//! [`check`](crate::check).
//!
//! Non-finite policy: a NaN or ±∞ in the candidate where the reference is finite, or a finite
//! candidate where the reference is not, is a failure reported with its first flat index;
//! identical non-finite values (NaN and NaN, or the same infinity) agree and are left out of
//! the norms.

pub(crate) mod detect;
pub(crate) mod pass;

use serde::{Deserialize, Serialize};

use crate::format::Format;
use crate::tensor::Tensor;
use crate::trace::id::TensorId;
use crate::trace::stored::Stored;
use pass::ComparePass;

pub use detect::{Detection, Detector, Finding, NORM_SHARE};

/// The verdict on one tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorVerdict {
    /// Canonical id.
    pub id: String,
    /// Elements.
    pub elements: usize,
    /// ‖cand − ref‖_F / ‖ref‖_F over the finite pairs (0 when identical).
    pub rel_error: f64,
    /// `rel_error` in units of ε.
    pub rel_error_eps: f64,
    /// The relative threshold.
    pub threshold: f64,
    /// `rel_error` / `threshold` (∞ for a nonzero error against a zero threshold).
    pub ratio: f64,
    /// Largest |cand − ref|.
    pub max_abs: f64,
    /// Largest distance in units in the last place of the tensor's format.
    pub max_ulp: u64,
    /// Non-finite mismatches (NaN or ±∞ on one side only, or different non-finite values).
    pub nonfinite_mismatches: usize,
    /// Flat index of the first non-finite mismatch.
    pub first_nonfinite: Option<usize>,
    /// Why the tensor could not be compared (a merge error), if so.
    pub problem: Option<String>,
    /// The tests beyond the norm that apply to this tensor (scale, bias, channel bias,
    /// sparse: [`detect`](crate::check::Detector)), fired or not.
    pub findings: Vec<Finding>,
    /// Within the threshold, no other test fired, no non-finite mismatch and no problem.
    pub passed: bool,
}

impl TensorVerdict {
    /// The tests that fired: the norm (beyond the threshold) first, then the others.
    pub fn fired(&self) -> Vec<Detector> {
        let norm = self.problem.is_none() && self.nonfinite_mismatches == 0 && self.ratio > 1.0;
        norm.then_some(Detector::Norm)
            .into_iter()
            .chain(self.findings.iter().filter(|f| f.fired).map(|f| f.detector))
            .collect()
    }

    /// Why a compared tensor failed, in ε: the norm's error against its threshold (with
    /// `rule`, how the threshold was priced, when given) and what each other test that fired
    /// measured.
    pub fn failure_detail(&self, eps: f64, rule: Option<&str>) -> String {
        let mut parts = Vec::new();
        if self.ratio > 1.0 {
            let rule = rule.map(|r| format!(" ({r})")).unwrap_or_default();
            parts.push(format!(
                "error {:.3} ε exceeds its threshold {:.3} ε{rule}",
                self.rel_error_eps,
                self.threshold / eps
            ));
        }
        let others = findings_note(self);
        if !others.is_empty() {
            parts.push(others);
        }
        parts.join("; ")
    }

    /// The largest ratio statistic/threshold over every test (the norm's and the others').
    pub fn worst_ratio(&self) -> f64 {
        self.findings
            .iter()
            .map(|f| f.ratio)
            .fold(self.ratio, f64::max)
    }
}

/// Compare one tensor against a threshold on ‖cand − ref‖_F (absolute), with the tests beyond
/// the norm at their defaults ([`Detection::default`]); `eps` is the unit of the ε column.
pub fn compare_tensor(
    id: &str,
    reference: &Tensor,
    candidate: &Tensor,
    threshold_abs: f64,
    eps: f64,
) -> TensorVerdict {
    compare_tensor_with(
        id,
        reference,
        candidate,
        threshold_abs,
        eps,
        Detection::default(),
    )
}

/// [`compare_tensor`] with the tests beyond the norm chosen by `detection` (off:
/// `Detection { enabled: false, ..Default::default() }` judges the norm alone). Parameter
/// gradients (ids ending `|param_grad`) never have the pooled sparse and systematic tests (the
/// trace checker gives a linear's weight and bias gradients element tests from their recorded
/// operands instead: `check::weight_grad`, `check::bias_grad`).
///
/// # Examples
///
/// ```
/// use ttrace::check::{compare_tensor_with, Detection, Detector};
/// use ttrace::{Format, Tensor};
/// let r: Vec<f64> = (0..4096).map(|i| ((i * 37 % 101) as f64 - 50.0) / 64.0).collect();
/// let mut c = r.clone();
/// c[1234] += 0.5; // one corrupted element, far below the norm's threshold of 1.0
/// let (rt, ct) = (
///     Tensor::from_vec(&[64, 64], r, Format::F32)?,
///     Tensor::from_vec(&[64, 64], c, Format::F32)?,
/// );
/// let v = compare_tensor_with("x", &rt, &ct, 1.0, f64::from(f32::EPSILON), Detection::default());
/// assert!(!v.passed && v.fired() == vec![Detector::Sparse]);
/// let off = Detection { enabled: false, ..Detection::default() };
/// assert!(compare_tensor_with("x", &rt, &ct, 1.0, f64::from(f32::EPSILON), off).passed);
/// # Ok::<(), ttrace::Error>(())
/// ```
pub fn compare_tensor_with(
    id: &str,
    reference: &Tensor,
    candidate: &Tensor,
    threshold_abs: f64,
    eps: f64,
    detection: Detection,
) -> TensorVerdict {
    compare_with_sums(id, reference, candidate, threshold_abs, eps, detection).0
}

/// The tests to run on the tensor `id`: parameter gradients have neither the sparse nor the
/// systematic tests ([`detect`](crate::check::Detector)).
pub fn detection_for(id: &str, detection: Detection) -> Detection {
    let param_grad = TensorId::parse(id)
        .is_some_and(|t| matches!(t.role, crate::trace::id::TensorRole::ParamGrad { .. }));
    Detection {
        sparse: detection.sparse && !param_grad,
        systematic: detection.systematic && !param_grad,
        ..detection
    }
}

/// The coarser of two formats: two roundings of nearly equal values, one to each side's format,
/// differ by at most the difference plus one ulp of the coarser.
pub(crate) fn coarser(a: Format, b: Format) -> Format {
    if a.precision() <= b.precision() {
        a
    } else {
        b
    }
}

/// Sums gathered by one comparison pass over the finite pairs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sums {
    /// ‖c − r‖_F over the finite pairs (+∞ only when it exceeds the largest `f64`).
    pub dn: f64,
    /// ‖r‖_F over the finite pairs (likewise).
    pub rn: f64,
    /// max |r|.
    pub rmax: f64,
}

/// A reference and a candidate tensor, visited as pieces of decoded values.
struct Pair<'a> {
    shapes: (&'a [usize], &'a [usize]),
    formats: (Format, Format),
    elements: usize,
    /// Hands its argument the pairs in order, in pieces of a multiple of 8 pairs (but the last).
    pieces: &'a Pieces<'a>,
    /// Hands its argument the pairs `start..end` again.
    range: &'a Range<'a>,
}

/// A reader of a pair's values `start..end` (see [`Pair`]).
type Range<'a> = dyn Fn(usize, usize, &mut dyn FnMut(&[f64], &[f64])) + 'a;

/// A visitor of a pair's values, piece by piece (see [`Pair`]).
type Pieces<'a> = dyn Fn(&mut dyn FnMut(&[f64], &[f64])) + 'a;

/// Elements decoded at a time when stored tensors are compared (a multiple of 8: 128 KiB of
/// values per side, which stay in the cache between decoding and comparing).
pub(crate) const PIECE: usize = 1 << 14;

/// [`compare_tensor`], also returning its sums (one pass over the data).
pub fn compare_with_sums(
    id: &str,
    reference: &Tensor,
    candidate: &Tensor,
    threshold_abs: f64,
    eps: f64,
    detection: Detection,
) -> (TensorVerdict, Sums) {
    let (r, c) = (reference.values(), candidate.values());
    let pair = Pair {
        shapes: (reference.shape(), candidate.shape()),
        formats: (reference.format(), candidate.format()),
        elements: reference.len(),
        pieces: &|f| f(r, c),
        range: &|s, e, f| f(&r[s..e], &c[s..e]),
    };
    compare_pair(id, &pair, threshold_abs, eps, detection)
}

/// [`compare_with_sums`] on tensors as stored, decoded a piece at a time: the same numbers
/// bit for bit, in memory for the patterns and two pieces of values.
pub(crate) fn compare_stored(
    id: &str,
    reference: &Stored,
    candidate: &Stored,
    threshold_abs: f64,
    eps: f64,
    detection: Detection,
) -> (TensorVerdict, Sums) {
    let range = |s: usize, e: usize, f: &mut dyn FnMut(&[f64], &[f64])| {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for start in (s..e).step_by(PIECE) {
            let end = (start + PIECE).min(e);
            reference.decode_range(start, end, &mut a);
            candidate.decode_range(start, end, &mut b);
            f(&a, &b);
        }
    };
    let pieces = |f: &mut dyn FnMut(&[f64], &[f64])| {
        let n = reference.len().min(candidate.len());
        let cap = PIECE.min(n);
        let (mut a, mut b) = (Vec::with_capacity(cap), Vec::with_capacity(cap));
        for start in (0..n).step_by(PIECE) {
            let end = (start + PIECE).min(n);
            reference.decode_range(start, end, &mut a);
            candidate.decode_range(start, end, &mut b);
            f(&a, &b);
        }
    };
    let pair = Pair {
        shapes: (reference.shape(), candidate.shape()),
        formats: (reference.format(), candidate.format()),
        elements: reference.len(),
        pieces: &pieces,
        range: &range,
    };
    compare_pair(id, &pair, threshold_abs, eps, detection)
}

fn compare_pair(
    id: &str,
    pair: &Pair,
    threshold_abs: f64,
    eps: f64,
    detection: Detection,
) -> (TensorVerdict, Sums) {
    let mut verdict = TensorVerdict {
        id: id.to_string(),
        elements: pair.elements,
        rel_error: 0.0,
        rel_error_eps: 0.0,
        threshold: 0.0,
        ratio: 0.0,
        max_abs: 0.0,
        max_ulp: 0,
        nonfinite_mismatches: 0,
        first_nonfinite: None,
        problem: None,
        findings: Vec::new(),
        passed: false,
    };
    let (rs, cs) = pair.shapes;
    if rs != cs {
        verdict.problem = Some(format!("shape {cs:?} differs from the reference's {rs:?}"));
        return (verdict, Sums::default());
    }
    let (rf, cf) = pair.formats;
    let mut pass = ComparePass::new(rf, cf);
    let stored = coarser(rf, cf);
    let mut detection = detection_for(id, detection);
    // One side stored in a coarser format was rounded once more, onto a grid whose rounding
    // is biased by the data's distribution (measured: GELU outputs in BF16 against the same in
    // FP32, 2.6·10⁵ elements, the bias test at 2×): no systematic test between formats.
    detection.systematic &= rf == cf;
    let mut det = detect::Detect::new(rs, stored, detection);
    (pair.pieces)(&mut |r, c| {
        pass.feed(r, c);
        det.feed(r, c);
    });
    let st = pass.finish();
    verdict.findings = det.finish(eps, &mut |s, e, f| (pair.range)(s, e, f));
    verdict.max_abs = st.max_abs;
    verdict.max_ulp = st.max_ulp;
    verdict.nonfinite_mismatches = st.nonfinite_mismatches;
    verdict.first_nonfinite = st.first_nonfinite;
    // A sum of squares below the normal range lost precision to underflow (differences below
    // about 1e-154; all of it when every square underflows, which would make differing
    // tensors "identical"), one beyond it overflowed: the norms again, scaled.
    let underflow = |sum: f64, max: f64| max > 0.0 && sum < f64::MIN_POSITIVE;
    let (dn, rn) = if st.d2.is_finite()
        && st.r2.is_finite()
        && !underflow(st.d2, st.max_abs)
        && !underflow(st.r2, st.rmax)
    {
        (st.d2.sqrt(), st.r2.sqrt())
    } else {
        scaled_norms(pair)
    };
    apply_threshold(&mut verdict, dn, rn, threshold_abs);
    verdict.rel_error_eps = verdict.rel_error / eps;
    (
        verdict,
        Sums {
            dn,
            rn,
            rmax: st.rmax,
        },
    )
}

/// ‖c − r‖_F and ‖r‖_F over the finite pairs, each sum of squares scaled by its largest term
/// so that no square overflows or underflows (differences of subnormal size are not lost);
/// +∞ only for a norm beyond the largest `f64` — which a difference of two finite values that
/// itself overflows (1e308 against −1e308) implies. Two visits: the maxima, then the scaled
/// sums.
fn scaled_norms(pair: &Pair) -> (f64, f64) {
    let finite = |a: f64, b: f64| a.is_finite() && b.is_finite();
    let (mut dmax, mut rmax) = (0.0f64, 0.0f64);
    (pair.pieces)(&mut |r, c| {
        for (&a, &b) in r.iter().zip(c).filter(|(&a, &b)| finite(a, b)) {
            dmax = dmax.max((b - a).abs());
            rmax = rmax.max(a.abs());
        }
    });
    // Sums of squares over the largest term, 0 where that is 0 or infinite (a norm of 0 or
    // +∞ already).
    let unit = |m: f64| if m > 0.0 && m.is_finite() { m } else { 0.0 };
    let (du, ru) = (unit(dmax), unit(rmax));
    let (mut ds, mut rs) = (0.0f64, 0.0f64);
    (pair.pieces)(&mut |r, c| {
        for (&a, &b) in r.iter().zip(c).filter(|(&a, &b)| finite(a, b)) {
            if du > 0.0 {
                let d = (b - a) / du;
                ds += d * d;
            }
            if ru > 0.0 {
                let x = a / ru;
                rs += x * x;
            }
        }
    });
    let norm = |m: f64, u: f64, s: f64| if u > 0.0 { u * s.sqrt() } else { m };
    (norm(dmax, du, ds), norm(rmax, ru, rs))
}

/// Fill a verdict's error, threshold, ratio and pass columns from ‖cand − ref‖_F = `dn`,
/// ‖ref‖_F = `rn` and the absolute threshold (the ε column is the caller's: it is left as is).
pub fn apply_threshold(verdict: &mut TensorVerdict, dn: f64, rn: f64, threshold_abs: f64) {
    let rel = |x: f64| {
        if x == 0.0 {
            0.0
        } else if rn > 0.0 {
            x / rn
        } else {
            f64::INFINITY
        }
    };
    verdict.rel_error = rel(dn);
    verdict.threshold = rel(threshold_abs);
    // A threshold as large as the reference itself says the values may be lost whole (to
    // underflow in a narrower format, to cancellation): a scale or a bias of them is then no
    // evidence (a candidate whose FP16 partial sums underflowed to zero is a scale of −1).
    if threshold_abs >= rn {
        verdict
            .findings
            .retain(|f| !matches!(f.detector, Detector::Scale | Detector::Bias));
    }
    verdict.ratio = if dn == 0.0 {
        0.0
    } else if threshold_abs > 0.0 && threshold_abs.is_finite() {
        dn / threshold_abs
    } else {
        f64::INFINITY
    };
    // A differing tensor never passes on an infinite (or NaN) threshold, and a difference
    // whose norm overflows never passes: both would be vacuous.
    verdict.passed = verdict.nonfinite_mismatches == 0
        && (dn == 0.0 || (dn.is_finite() && threshold_abs.is_finite() && dn <= threshold_abs))
        && !verdict.findings.iter().any(|f| f.fired);
    if !verdict.passed && verdict.problem.is_none() && verdict.nonfinite_mismatches == 0 {
        if !dn.is_finite() {
            verdict.problem = Some("the difference's norm overflows f64".into());
        } else if !threshold_abs.is_finite() {
            verdict.problem = Some("no finite threshold for this tensor".into());
        }
    }
}

/// The verdict on a tensor that could not be compared (`problem` says why).
pub(crate) fn failed(id: &str, elements: usize, problem: String) -> TensorVerdict {
    TensorVerdict {
        id: id.to_string(),
        elements,
        rel_error: f64::NAN,
        rel_error_eps: f64::NAN,
        threshold: f64::NAN,
        ratio: f64::INFINITY,
        max_abs: f64::NAN,
        max_ulp: 0,
        nonfinite_mismatches: 0,
        first_nonfinite: None,
        problem: Some(problem),
        findings: Vec::new(),
        passed: false,
    }
}

/// What the tests beyond the norm that fired measured, in ε: "scale 0.31 > 0.05; sparse: 4
/// elements, worst at 1234: 7.1 > 2.3".
pub(crate) fn findings_note(v: &TensorVerdict) -> String {
    v.findings
        .iter()
        .filter(|f| f.fired)
        .map(|f| match f.detector {
            Detector::Sparse => format!(
                "sparse: {} element{}, worst at {}: {:.3} > {:.3}",
                f.count,
                if f.count == 1 { "" } else { "s" },
                f.at.map_or("-".to_string(), |i| i.to_string()),
                f.estimate,
                f.threshold
            ),
            d => format!("{} {:.3} > {:.3}", d.name(), f.estimate, f.threshold),
        })
        .collect::<Vec<_>>()
        .join("; ")
}
