//! The walk over a reduction's rounding sites that [`reduction_error`] prices: exact
//! tracking of determined roundings (TwoSum-carried sums, parity chains, lattices of exact
//! values) and the random-rounding model for the rest.

use super::*;

mod addition;

/// Knuth's TwoSum: s + e = a + b exactly, s = fl(a + b).
pub(super) fn two_sum(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    let bb = s - a;
    (s, (a - (s - bb)) + (b - bb))
}

/// 2^-50: relative slack for values the model computes in `f64` (range sums, error sums).
pub(super) const SLACK: f64 = 8.881_784_197_001_252e-16;

/// Smallest and largest |y| over the interval [c − r, c + r].
pub(super) fn abs_range(c: f64, r: f64) -> (f64, f64) {
    let (lo, hi) = (c - r, c + r);
    let max = lo.abs().max(hi.abs());
    let min = if lo <= 0.0 && hi >= 0.0 {
        0.0
    } else {
        lo.abs().min(hi.abs())
    };
    (min, max)
}

/// Whether the integer-valued `x` is odd (exact for every finite `f64`).
pub(super) fn is_odd(x: f64) -> bool {
    (x * 0.5).fract() != 0.0
}

/// A sum of determined rounding errors as the model computes it in `f64`: the value and a
/// rigorous bound on its own rounding error (each addition's exact error, from TwoSum).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Det {
    pub(super) v: f64,
    pub(super) err: f64,
}

impl std::ops::Add for Det {
    type Output = Det;
    fn add(self, o: Det) -> Det {
        let (v, e) = two_sum(self.v, o.v);
        Det {
            v,
            err: self.err + o.err + e.abs(),
        }
    }
}

impl Det {
    /// An error computed exactly, or within `err`.
    pub(super) fn of(v: f64, err: f64) -> Det {
        Det { v, err }
    }
}

/// What the model knows of a value ŝ that earlier roundings computed, whose exact
/// counterpart is s: its error E = ŝ − s is `det` plus at most `bound`, and, while the parity
/// chain is intact, whether ŝ/U is odd on the grid U — the one bit of ŝ that decides a tie.
/// Beyond the parity, `lattice`: a power of two ŝ is known to be a multiple of (a rounding's
/// result lies on its grid; an exact sum on its operands' coarsest common grid) — what makes a
/// sum that crosses into a coarser binade exact when its terms are coarse.
#[derive(Debug, Clone, Copy)]
pub(super) struct Known {
    pub(super) det: Det,
    pub(super) bound: f64,
    pub(super) parity: Option<(f64, bool)>,
    /// Every rounding behind the value was exact: ŝ = s.
    pub(super) exact: bool,
    /// ŝ is a multiple of this power of two (0: nothing known; ∞: ŝ = 0).
    pub(super) lattice: f64,
    /// A hash of how the value was computed (its terms, formats and operations): values with
    /// equal content are computed identically and carry identical errors.
    pub(super) content: u64,
    /// A rigorous interval [lo, hi] that ŝ lies in, carried by the monotonicity of rounding
    /// (RN(x) ≤ RN(y) for x ≤ y): a site's result lies in [RN(lo), RN(hi)] for its operands'
    /// intervals summed. Unlike det ± bound, whose bound grows by U/2 at every undetermined
    /// rounding, it snaps to the format's values, so a value that crossed into a coarser binade
    /// or that a run of small terms cannot move (a stall) stays pinned.
    pub(super) range: (f64, f64),
}

/// Nothing known of where ŝ lies.
pub(super) const ANYWHERE: (f64, f64) = (f64::NEG_INFINITY, f64::INFINITY);

/// The smallest value of `f` at or above `x` (−∞ below the format's range, +∞ above it).
pub(super) fn up_to_format(f: Format, x: f64) -> f64 {
    if x.is_nan() {
        return f64::NEG_INFINITY;
    }
    if x.is_infinite() {
        return x;
    }
    let v = f.round(x, crate::format::Overflow::NonSaturating);
    if !v.is_finite() {
        return if x > 0.0 {
            f64::INFINITY
        } else {
            -f.max_finite()
        };
    }
    if v >= x {
        return v;
    }
    // v < x: the next value of f above v.
    let a = v.abs();
    let step = if v >= 0.0 {
        f.ulp(a)
    } else {
        f.ulp(a * (1.0 - 2.0 * f.unit_roundoff()))
    };
    step.map_or(f64::INFINITY, |s| v + s)
}

/// The largest value of `f` at or below `x`.
pub(super) fn down_to_format(f: Format, x: f64) -> f64 {
    -up_to_format(f, -x)
}

/// The monotone image of [lo, hi] under RN to `f`, as an interval.
pub(super) fn rounded_range(f: Format, lo: f64, hi: f64) -> (f64, f64) {
    let r = |x: f64, inf: f64| {
        let v = f.round(x, crate::format::Overflow::NonSaturating);
        if v.is_finite() {
            v
        } else {
            inf
        }
    };
    if lo.is_nan() || hi.is_nan() || lo > hi {
        return ANYWHERE;
    }
    (r(lo, f64::NEG_INFINITY), r(hi, f64::INFINITY))
}

/// The parity of ŝ/`grid` when `k` tells it: known on the same grid, even on any grid finer
/// than the parity's or the lattice's (ŝ is a multiple of the coarser spacing), unknown on a
/// coarser one.
pub(super) fn parity_on(k: &Known, grid: f64) -> Option<bool> {
    if k.lattice > grid {
        // ŝ is a multiple of a coarser power of two: an even multiple of `grid`.
        return Some(false);
    }
    match k.parity {
        Some((g, odd)) if g == grid => Some(odd),
        Some((g, _)) if g > grid => Some(false),
        _ => None,
    }
}

pub(super) type Key = (usize, usize, usize, usize);

/// A computed operand as a site sees it: what is known of it, its exact partial sum and that
/// sum's error bound, its format, its value when known (see [`Walk::operand`]), and where
/// [`Walk::locate`] puts it (located once per operand).
pub(super) type Computed = (Known, f64, f64, Format, Option<f64>, (f64, f64, f64));

/// The computed values not yet consumed, by range. A reduction order consumes each value once,
/// nearly always the one computed last (a sequential run's running value, a pairwise tree's
/// subtotals, split-K's partials): a short stack searched from its top, where a hash map (its
/// inserts and removals a fifth of a LayerNorm's threshold) did the same work with hashing.
/// Its keys are index ranges the walk makes, never data.
#[derive(Default)]
pub(super) struct Values {
    live: Vec<(Key, Known)>,
}

impl Values {
    /// Keep `value` for `key` (replacing one kept under the same key).
    pub(super) fn insert(&mut self, key: Key, value: Known) {
        match self.live.iter().rposition(|(k, _)| *k == key) {
            Some(i) => self.live[i].1 = value,
            None => self.live.push((key, value)),
        }
    }

    /// Take the value kept for `key`.
    pub(super) fn remove(&mut self, key: &Key) -> Option<Known> {
        let i = self.live.iter().rposition(|(k, _)| k == key)?;
        Some(self.live.remove(i).1)
    }
}

/// An order-sensitive 64-bit mix (SplitMix64's finalizer) for content hashes.
pub(super) fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.rotate_left(17) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub(super) fn key(first: &std::ops::Range<usize>, second: &std::ops::Range<usize>) -> Key {
    (first.start, first.end, second.start, second.end)
}

/// The walk over one reduction's roundings (see [`reduction_error`]).
pub(super) struct Walk<'a> {
    pub(super) terms: &'a [f64],
    /// Double-double prefix sums of the exact terms.
    pub(super) prefix: Vec<(f64, f64)>,
    /// Bound on the error of a range sum taken from `prefix`.
    pub(super) margin: f64,
    pub(super) overflow: crate::format::Overflow,
    pub(super) values: Values,
    pub(super) scratch: ExactAccumulator,
    /// The exact operands of the current site (a reused buffer).
    pub(super) exact: Vec<f64>,
    /// Content hashes of the current site and of its exact operands.
    pub(super) site_content: u64,
    pub(super) exact_content: u64,
    /// Σ of the determined errors.
    pub(super) mean: f64,
    /// Σ of their magnitudes (bounds the rounding error of summing them in `f64`).
    pub(super) mean_abs: f64,
    /// Number of roundings.
    pub(super) sites: f64,
    /// Σ of the variances of the undetermined roundings.
    pub(super) variance: f64,
    /// Undetermined roundings that add the same determined operand onto the same grid err
    /// alike (a constant row's identical block sums): grouped by (grid, operand), a group of
    /// k contributes k²·Var(η), not k·Var(η).
    pub(super) repeats: std::collections::BTreeMap<(u64, u64), (f64, f64)>,
    /// Σ U/2 over the ties whose direction is unknown.
    pub(super) tie_bound: f64,
    /// Σ over roundings of half the smallest subnormal of their format (Higham's underflow
    /// term, counted for every rounding).
    pub(super) underflow: f64,
    /// A rounding whose value may reach the format's overflow threshold: (format, |value|).
    pub(super) overflows: Option<(Format, f64)>,
    /// Prefix sums of the terms' radii (empty: the terms are exact). A side that reduces
    /// computed terms t̂ᵢ known only within rᵢ of tᵢ (the squares of x − μ̂ for an undetermined
    /// μ̂): every interval widens by the radii of its terms, and a rounding of terms is
    /// determined only when it rounds the same way over the whole interval — then the
    /// deviations cancel (RN(ŝ + t̂) − ŝ = RN(ŝ + t) − ŝ) and its model error is the true one.
    pub(super) radii: Vec<f64>,
    /// The radius of the current site's exact operands.
    pub(super) site_radius: f64,
}

impl Walk<'_> {
    /// The exact sum of the terms in two ranges, as a value and a bound on its error.
    pub(super) fn range_sum(
        &self,
        a: &std::ops::Range<usize>,
        b: &std::ops::Range<usize>,
    ) -> (f64, f64) {
        let part = |r: &std::ops::Range<usize>| -> (f64, f64) {
            if r.is_empty() {
                return (0.0, 0.0);
            }
            let (h1, l1) = self.prefix[r.end];
            let (h0, l0) = self.prefix[r.start];
            let (h, e) = two_sum(h1, -h0);
            (h, e + (l1 - l0))
        };
        let (ha, la) = part(a);
        let (hb, lb) = part(b);
        let (h, e) = two_sum(ha, hb);
        let v = h + (e + la + lb);
        (
            v,
            self.margin + v.abs() * SLACK + self.radius(a) + self.radius(b),
        )
    }

    /// The radius of the terms in `r` (0 for exact terms), rounded up.
    pub(super) fn radius(&self, r: &std::ops::Range<usize>) -> f64 {
        if self.radii.is_empty() || r.is_empty() {
            return 0.0;
        }
        (self.radii[r.end] - self.radii[r.start]) * (1.0 + SLACK)
    }

    pub(super) fn note_overflow(&mut self, f: Format, magnitude: f64) {
        if magnitude == f64::INFINITY {
            // Only a value of unknown error gives an infinite magnitude here (never expected);
            // its rounding is priced as undetermined.
            return;
        }
        let limit = crate::bounds::reduction::overflow_threshold(f);
        if (magnitude >= limit || magnitude.is_nan()) && self.overflows.is_none() {
            self.overflows = Some((f, magnitude));
        }
    }

    /// A computed operand: its state, its exact partial sum (value, error bound), its format,
    /// and its computed value when every rounding behind it was exact (then ŝ = s, up to the
    /// slack of the range sum, which rounding to its format removes). A value that an inexact
    /// rounding has touched keeps its low-order bits to itself: the model treats them as
    /// random.
    pub(super) fn operand(&mut self, op: &Operand) -> Option<Computed> {
        match op {
            Operand::Value {
                first,
                second,
                format,
            } => {
                // Every computed value is consumed once; an empty one is an exact zero.
                let k = self.values.remove(&key(first, second)).unwrap_or(Known {
                    det: Det::default(),
                    bound: if first.is_empty() && second.is_empty() {
                        0.0
                    } else {
                        f64::INFINITY
                    },
                    parity: None,
                    exact: first.is_empty() && second.is_empty(),
                    lattice: if first.is_empty() && second.is_empty() {
                        f64::INFINITY
                    } else {
                        0.0
                    },
                    content: 0,
                    range: ANYWHERE,
                });
                let (s, err) = self.range_sum(first, second);
                let known = if k.exact {
                    let c = s + k.det.v;
                    let v = format.round(c, crate::format::Overflow::NonSaturating);
                    let slack = err + k.det.err + c.abs() * SLACK;
                    let half = format.ulp(v).unwrap_or(0.0) / 2.0;
                    // ŝ is the only value of the format within the slack of c.
                    (v.is_finite() && (c - v).abs() + slack < half).then_some(v)
                } else {
                    None
                };
                let at = Self::locate(&k, s, err, *format);
                Some((k, s, err, *format, known, at))
            }
            _ => None,
        }
    }

    /// Where a computed value lies: the centre and radius of a rigorous interval for ŝ, and
    /// the smallest spacing of its format there. When the interval holds a single value of
    /// the format, that value is ŝ and the interval shrinks to it: the model uses a computed
    /// value's magnitude, never its low-order bits (beyond the parity chain and the lattice).
    pub(super) fn locate(k: &Known, s: f64, err: f64, fa: Format) -> (f64, f64, f64) {
        let c = s + k.det.v;
        let r = k.bound + k.det.err + err + c.abs() * SLACK;
        // Narrowed by the interval that monotone rounding carried, whose ends are values of
        // the format.
        let (c, r) = {
            let lo = up_to_format(fa, (c - r).max(k.range.0));
            let hi = down_to_format(fa, (c + r).min(k.range.1));
            if lo <= hi && lo.is_finite() && hi.is_finite() && hi - lo < 2.0 * r {
                let mid = lo + (hi - lo) / 2.0;
                (mid, (hi - lo) / 2.0 + mid.abs() * SLACK)
            } else {
                (c, r)
            }
        };
        if r.is_finite() {
            let v = fa.round(c, crate::format::Overflow::NonSaturating);
            if v.is_finite() {
                let below = fa
                    .ulp(v.abs() * (1.0 - 2.0 * fa.unit_roundoff()))
                    .unwrap_or(0.0);
                if (c - v).abs() + r < below / 2.0 {
                    return (v, v.abs() * SLACK, fa.ulp(v).unwrap_or(0.0));
                }
            }
        }
        let (min, _) = abs_range(c, r);
        (c, r, fa.ulp(min).unwrap_or(0.0))
    }

    /// An undetermined rounding to `f` of a value in [c − r, c + r] whose operands lie on the
    /// grid `g`: zero-mean, variance U²/12 + g²/6 and |η| ≤ U/2 (U the largest spacing there),
    /// exact when g ≥ U.
    pub(super) fn random(&mut self, f: Format, c: f64, r: f64, g: f64, key: u64) -> f64 {
        let (_, max) = abs_range(c, r);
        let u = f.ulp(max).unwrap_or(f64::INFINITY);
        if g >= u {
            return 0.0;
        }
        let var = u * u / 12.0 + g * g / 6.0;
        let e = self.repeats.entry((u.to_bits(), key)).or_insert((0.0, var));
        e.0 += 1.0;
        e.1 = e.1.max(var);
        u / 2.0
    }

    pub(super) fn site(&mut self, s: RoundingSite) {
        let f = s.format;
        if s.first.is_empty() && s.second.is_empty() {
            // Rounding a sum of no terms: an exact zero.
            for op in &s.ops {
                self.operand(op);
            }
            let zero = Known {
                det: Det::default(),
                bound: 0.0,
                parity: Some((f64::INFINITY, false)),
                exact: true,
                lattice: f64::INFINITY,
                content: 0,
                range: (0.0, 0.0),
            };
            self.values.insert(key(&s.first, &s.second), zero);
            return;
        }
        self.underflow += f.min_subnormal() / 2.0;
        self.sites += 1.0;
        // Exact operands (terms, a fused block, known computed values) and unknown ones.
        // The site's operand buffer is reused from site to site (this runs once per rounding).
        let mut exact = std::mem::take(&mut self.exact);
        exact.clear();
        exact.extend(s.fused.clone().map(|i| self.terms[i]));
        let mut radius = self.radius(&s.fused);
        let mut det_in = Det::default();
        let mut site_content = mix(f.index() as u64, s.fused.len() as u64);
        let mut exact_content = 0;
        for i in s.fused.clone() {
            exact_content = mix(exact_content, self.terms[i].to_bits());
        }
        // At most two operands: the unknown ones, in order.
        let mut unknown = [None, None];
        let mut count = 0;
        for op in &s.ops {
            match op {
                Operand::None => site_content = mix(site_content, 0),
                Operand::Term(i) => {
                    exact.push(self.terms[*i]);
                    radius += self.radius(&(*i..*i + 1));
                    let h = mix(1, self.terms[*i].to_bits());
                    exact_content = mix(exact_content, h);
                    site_content = mix(site_content, h);
                }
                Operand::Value { .. } => {
                    if let Some(v) = self.operand(op) {
                        site_content = mix(site_content, v.0.content);
                        match v.4 {
                            Some(value) => {
                                exact.push(value);
                                det_in = det_in + v.0.det;
                                exact_content = mix(exact_content, v.0.content);
                            }
                            None => {
                                unknown[count] = Some(v);
                                count += 1;
                            }
                        }
                    }
                }
            }
        }
        site_content = mix(site_content, exact_content);
        // Equal uncertain terms are equal computed values (the squares of equal x − μ̂):
        // their roundings err alike as equal exact terms do.
        self.site_radius = radius;
        self.site_content = site_content;
        self.exact_content = exact_content;
        let range = Self::site_range(f, &exact, radius, &unknown);
        let mut result = match unknown {
            [Some(v), Some(w)] => self.value_plus_value(f, v, w),
            [Some(v), None] => self.value_plus_terms(f, v, &exact, det_in),
            _ => self.exact_site(f, &exact, det_in),
        };
        result.content = site_content;
        let (lo, hi) = (result.range.0.max(range.0), result.range.1.min(range.1));
        result.range = if lo <= hi { (lo, hi) } else { range };
        self.values.insert(key(&s.first, &s.second), result);
        self.exact = exact;
    }

    /// The interval a site's result lies in: RN to `f` of an interval holding the exact sum of
    /// its operands (the exact ones within `radius`, the computed ones where
    /// [`locate`](Self::locate) puts them), rounding being monotone.
    pub(super) fn site_range(
        f: Format,
        exact: &[f64],
        radius: f64,
        unknown: &[Option<Computed>; 2],
    ) -> (f64, f64) {
        let (mut sum, mut abs, mut r, mut n) = (0.0, 0.0, radius, exact.len());
        for &t in exact {
            sum += t;
            abs += t.abs();
        }
        for v in unknown.iter().flatten() {
            let (c, rv, _) = v.5;
            sum += c;
            abs += c.abs();
            r += rv;
            n += 1;
        }
        if !r.is_finite() || !sum.is_finite() {
            return ANYWHERE;
        }
        // n f64 additions err by at most (n − 1)·2⁻⁵³·Σ|·|; the two ends by one rounding each.
        let slack = r + abs * (n as f64 + 2.0) * f64::EPSILON / 2.0 + f64::MIN_POSITIVE;
        rounded_range(f, sum - slack, sum + slack)
    }

    /// RN_f of the exact sum of `exact`: the result, its error η rounded to f64, and a bound on
    /// that last rounding.
    pub(super) fn round_exact(&mut self, f: Format, exact: &[f64]) -> (f64, f64, f64) {
        self.scratch.clear();
        for &t in exact {
            self.scratch.add(t);
        }
        let r = self.scratch.round(f, self.overflow);
        if r.is_finite() {
            self.scratch.add(-r);
        }
        let eta = -self.scratch.to_f64();
        (r, eta, eta.abs() * f64::EPSILON + f64::MIN_POSITIVE)
    }

    /// A rounding of exact operands only (terms, known computed values): its error is
    /// computed exactly. `det_in` is the known operands' own error.
    pub(super) fn exact_site(&mut self, f: Format, exact: &[f64], det_in: Det) -> Known {
        let w = self.site_radius;
        if w > 0.0 {
            return self.uncertain_site(f, exact, det_in, w);
        }
        // η = RN(x) − x: exact in f64 for one operand (|η| ≤ half a spacing of the narrower
        // grid, a multiple of the operand's f64 spacing); the exact residual rounded once
        // otherwise.
        let (rounded, eta, eta_err) = if let [t] = exact {
            let r = f.round(*t, self.overflow);
            (r, r - t, 0.0)
        } else if let [a, b] = exact {
            let (x, e) = two_sum(*a, *b);
            if e == 0.0 {
                let r = f.round(x, self.overflow);
                (r, r - x, 0.0)
            } else {
                self.round_exact(f, exact)
            }
        } else {
            self.round_exact(f, exact)
        };
        if !rounded.is_finite() || rounded.abs() > f.max_finite() {
            let magnitude = exact.iter().map(|t| t.abs()).sum::<f64>();
            self.note_overflow(f, magnitude.max(f.max_finite() * 2.0));
            return Known {
                det: det_in,
                bound: f64::INFINITY,
                parity: None,
                exact: false,
                lattice: 0.0,
                content: 0,
                range: ANYWHERE,
            };
        }
        self.determined(f, rounded, Det::of(eta, eta_err), det_in, eta == 0.0)
    }

    /// The result of a determined rounding to `f`: `rounded`, with error `eta` on top of the
    /// operands' own `det_in`; its parity on its grid and its lattice follow from its value.
    pub(super) fn determined(
        &mut self,
        f: Format,
        rounded: f64,
        eta: Det,
        det_in: Det,
        exact: bool,
    ) -> Known {
        self.mean += eta.v;
        self.mean_abs += eta.v.abs();
        // Zero is even on every grid.
        let grid = if rounded == 0.0 {
            f64::INFINITY
        } else {
            f.ulp(rounded).unwrap_or(f64::INFINITY)
        };
        Known {
            det: det_in + eta,
            bound: 0.0,
            parity: Some((grid, rounded != 0.0 && is_odd(rounded / grid))),
            exact,
            lattice: lowest_bit(rounded),
            content: 0,
            range: (rounded, rounded),
        }
    }

    /// A rounding of exact operands whose terms are known only within `w`: determined when
    /// every value within `w` of their sum rounds to the same point (its model error then is
    /// the true one, the deviation cancelling), otherwise random with the deviation in its
    /// bound.
    pub(super) fn uncertain_site(
        &mut self,
        f: Format,
        exact: &[f64],
        det_in: Det,
        w: f64,
    ) -> Known {
        let x: f64 = exact.iter().sum();
        let slack = exact.iter().map(|t| t.abs()).sum::<f64>() * SLACK + w;
        let r = f.round(x, self.overflow);
        self.note_overflow(f, x.abs() + slack);
        if r.is_finite() {
            let below = f
                .ulp(r.abs() * (1.0 - 2.0 * f.unit_roundoff()))
                .unwrap_or(0.0);
            if (x - r).abs() + slack < below / 2.0 {
                let (rounded, eta, eta_err) = self.round_exact(f, exact);
                if rounded == r {
                    return self.determined(f, r, Det::of(eta, eta_err), det_in, false);
                }
            }
        }
        let key = self.site_content;
        let site = self.random(f, x, slack, 0.0, key);
        Known {
            det: det_in,
            bound: site + w,
            parity: None,
            exact: false,
            lattice: 0.0,
            content: 0,
            range: ANYWHERE,
        }
    }
}

/// The weight of the lowest set bit of `x` (+inf for zero): the grid an exact term lies on.
/// The lattice of a rounding's result: the exact value's own `lx` when it is a multiple of
/// the result's largest possible spacing `u_max` (then the rounding is exact), otherwise the
/// format's spacing at the result's smallest possible magnitude.
pub(super) fn lattice_after(lx: f64, u_min: f64, u_max: f64) -> f64 {
    if lx >= u_max {
        lx
    } else {
        u_min
    }
}

pub(crate) fn lowest_bit(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return f64::INFINITY;
    }
    let bits = x.abs().to_bits();
    let field = (bits >> 52) as i32;
    let frac = bits & ((1u64 << 52) - 1);
    let (m, e) = if field == 0 {
        (frac, -1074)
    } else {
        (frac | (1u64 << 52), field - 1075)
    };
    let k = e + m.trailing_zeros() as i32;
    if k >= -1022 {
        f64::from_bits(((k + 1023) as u64) << 52)
    } else {
        f64::from_bits(1u64 << (k + 1074))
    }
}
