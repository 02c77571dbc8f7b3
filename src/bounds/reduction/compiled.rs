//! The all-random model of one execution ([`random_rounding_error`]) compiled once for an
//! order and a length and then applied to many rows of that length: the rounding sites the
//! order performs and each term's Higham weight are found once, so that a row costs one
//! pass over its sites — no tree walk, no callbacks, no ordered map — instead of the
//! per-call enumeration that `random_rounding_error` makes (a norm of rows of 1,024 values
//! priced every row's sums that way, or by the determined-rounding walk at about 2,000
//! instructions per term).
//!
//! The statistics are `random_rounding_error`'s, term for term and in the same order of
//! summation, so the two give the same bits (tested against it).

use super::*;

/// A format as a spacing needs it: ulp(x) = 2^(max(e(x), e_min) − (p − 1)).
#[derive(Debug, Clone, Copy)]
struct Grid {
    emin: i32,
    p1: i32,
}

impl Grid {
    fn of(f: Format) -> Grid {
        Grid {
            emin: f.emin(),
            p1: f.precision() as i32 - 1,
        }
    }

    /// [`Format::ulp`] of a finite `x` (at zero: the smallest subnormal).
    #[inline(always)]
    fn ulp(self, x: f64) -> f64 {
        let bits = x.to_bits() & !(1u64 << 63);
        let field = (bits >> 52) as i32;
        let e = if field != 0 {
            field - 1023
        } else if bits == 0 {
            self.emin
        } else {
            crate::format::exponent_of(x)
        };
        crate::format::pow2(e.max(self.emin) - self.p1)
    }
}

/// A computed operand or a term, as a compiled site reads it.
#[derive(Debug, Clone, Copy)]
enum Op {
    None,
    Term(usize),
    /// The exact sum of the terms in two index ranges, rounded to a format.
    Value {
        first: (usize, usize),
        second: (usize, usize),
        grid: Grid,
    },
}

/// One rounding: its format, the terms whose exact sum it rounds, its two operands and the
/// terms of a fused block added exactly.
#[derive(Debug, Clone, Copy)]
struct Site {
    grid: Grid,
    first: (usize, usize),
    second: (usize, usize),
    ops: [Op; 2],
    fused: (usize, usize),
    /// A sequential step: the running value of terms [s, i) plus term i, with the running
    /// value's grid (the common site, read without the general operand dispatch).
    step: Option<Grid>,
}

/// The grid of a sequential step's running value, when `s` is one: operands the running
/// value of a non-empty range [a, i) and the term i, rounding the range [a, i + 1), nothing
/// fused.
fn step_of(s: &RoundingSite) -> Option<Grid> {
    match (&s.ops[0], &s.ops[1]) {
        (
            Operand::Value {
                first,
                second,
                format,
            },
            Operand::Term(i),
        ) if second.is_empty()
            && !first.is_empty()
            && first.end == *i
            && s.first.start == first.start
            && s.first.end == i + 1
            && s.second.is_empty()
            && s.fused.is_empty() =>
        {
            Some(Grid::of(*format))
        }
        _ => None,
    }
}

fn pair(r: &std::ops::Range<usize>) -> (usize, usize) {
    (r.start, r.end)
}

fn op(o: &Operand) -> Op {
    match o {
        Operand::None => Op::None,
        Operand::Term(i) => Op::Term(*i),
        Operand::Value {
            first,
            second,
            format,
        } => Op::Value {
            first: pair(first),
            second: pair(second),
            grid: Grid::of(*format),
        },
    }
}

/// Open-addressing counts of undetermined roundings that add the same exact operand onto the
/// same grid (keyed by the two bit patterns), for the k²·E(η²) of each group: one table per
/// thread, reused from row to row, its used slots cleared after each.
#[derive(Default)]
struct Repeats {
    slots: Vec<(u64, u64, u32, f64)>,
    used: Vec<usize>,
}

thread_local! {
    static REPEATS: std::cell::RefCell<Repeats> = std::cell::RefCell::default();
}

impl Repeats {
    /// Ready for up to `sites` keys (at most half full), empty.
    fn reserve(&mut self, sites: usize) {
        let cap = (2 * sites.max(4)).next_power_of_two();
        if self.slots.len() < cap {
            self.slots = vec![(0, 0, 0, 0.0); cap];
        }
    }

    /// One more member of the group of `key` (its first member's variance `var` kept): what
    /// the group's k²·var grows by.
    #[inline]
    fn add(&mut self, key: (u64, u64), var: f64) -> f64 {
        let mask = self.slots.len() - 1;
        let h = (key.0 ^ key.1.rotate_left(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut i = (h >> 40) as usize & mask;
        loop {
            let slot = &mut self.slots[i];
            if slot.2 == 0 {
                *slot = (key.0, key.1, 1, var);
                self.used.push(i);
                return var;
            }
            if (slot.0, slot.1) == key {
                let k = slot.2 as f64;
                slot.2 += 1;
                // (k + 1)² − k² times the group's variance.
                return (2.0 * k + 1.0) * slot.3;
            }
            i = (i + 1) & mask;
        }
    }

    /// Empty again.
    fn clear(&mut self) {
        for &i in &self.used {
            self.slots[i].2 = 0;
        }
        self.used.clear();
    }
}

/// [`random_rounding_error`] of every row of `n` terms under one accumulation, compiled.
#[derive(Debug, Clone)]
pub(crate) struct RandomModel {
    n: usize,
    is_dot: bool,
    sites: Vec<Site>,
    /// Each term's Higham weight Π(1 + u)^d − 1 along its path.
    weights: Vec<f64>,
    /// The largest weight (the growth factor of the second-order term).
    growth: f64,
    /// Roundings summed over the terms' paths (the underflow allowance of exact products).
    roundings: u64,
    /// The accumulator, for the underflow allowance of exact products.
    accumulator: Format,
    /// The narrowest format a rounding reaches (partials, products included), with the
    /// magnitude from which rounding to it overflows.
    limit: (Format, f64),
    /// Every format a rounding goes to (for [`RandomModel::all_exact`]).
    formats: Vec<Format>,
    /// Σ over the non-empty roundings of half the smallest subnormal of their format (the
    /// walk's underflow term).
    underflow: f64,
    /// Some rounding sums two ranges of terms (a ring combine that wraps).
    wraps: bool,
}

impl RandomModel {
    /// The model of `acc` over `n` terms (`is_dot`: the terms are exact products), or `None`
    /// for an order `random_rounding_error` prices as a whole (Kahan's) and for rounded
    /// products (whose exact rounding errors the walk adds to its guaranteed bound).
    ///
    /// # Errors
    /// As [`random_rounding_error`]: an invalid accumulation, an order it does not price
    /// (families, tensor cores), a length beyond the depth tables.
    pub(crate) fn new(acc: &Accumulation, n: usize, is_dot: bool) -> Result<Option<RandomModel>> {
        acc.validate()?;
        if acc.order == Order::Kahan || (is_dot && matches!(acc.products, Products::Rounded(_))) {
            return Ok(None);
        }
        check_supported(&acc.order)?;
        let mut sites = Vec::with_capacity(n + 1);
        let mut formats = vec![acc.accumulator];
        let mut wraps = false;
        let mut underflow = 0.0;
        for_each_rounding(
            &acc.order,
            n,
            acc.accumulator,
            load_rounds(acc, is_dot),
            &mut |s: RoundingSite| {
                if !formats.contains(&s.format) {
                    formats.push(s.format);
                }
                wraps |= !s.first.is_empty() && !s.second.is_empty();
                if !(s.first.is_empty() && s.second.is_empty()) {
                    underflow += s.format.min_subnormal() / 2.0;
                }
                sites.push(Site {
                    grid: Grid::of(s.format),
                    first: pair(&s.first),
                    second: pair(&s.second),
                    ops: [op(&s.ops[0]), op(&s.ops[1])],
                    fused: pair(&s.fused),
                    step: step_of(&s),
                });
            },
        );
        let depths = if is_dot {
            acc.dot_depths(n)?
        } else {
            acc.sum_depths(n)?
        };
        let weights: Vec<f64> = depths.iter().map(|d| d.relative_error_bound()).collect();
        let limit = formats
            .iter()
            .copied()
            .map(|f| (f, overflow_threshold(f)))
            .fold((acc.accumulator, f64::INFINITY), |a, b| {
                if b.1 < a.1 {
                    b
                } else {
                    a
                }
            });
        Ok(Some(RandomModel {
            n,
            is_dot,
            sites,
            growth: weights.iter().copied().fold(0.0, f64::max),
            weights,
            roundings: depths.iter().map(|d| d.total() as u64).sum(),
            accumulator: acc.accumulator,
            limit,
            formats,
            underflow,
            wraps,
        }))
    }

    /// The model's statistics of `terms` (`n` of them), as [`random_rounding_error`] gives
    /// them.
    ///
    /// # Errors
    /// As [`error_within`](Self::error_within).
    #[cfg(test)]
    pub(crate) fn error(&self, terms: &[f64]) -> Result<ReductionError> {
        self.error_within(terms, &[])
    }

    /// Whether every rounding is provably exact (`representable.rs`'s criterion): every term
    /// a multiple of g, their lowest set bits' least, at least each format's smallest
    /// subnormal, and every sum a site forms — within the spread R of the prefix sums (2R
    /// where a ring wraps) — below g·2^p and the largest finite value of its format. Then
    /// each computed partial sum is the exact one, a value of its format.
    fn all_exact(&self, terms: &[f64], prefix: &[f64], abs_sum: f64) -> bool {
        let (lo, hi) = prefix
            .iter()
            .fold((0.0f64, 0.0f64), |(lo, hi), &p| (lo.min(p), hi.max(p)));
        // Each f64 prefix sum errs by at most n·2⁻⁵³·Σ|t|; the spread's own rounding by 2⁻⁵².
        let slack = 2.0 * self.n as f64 * f64::EPSILON / 2.0 * abs_sum;
        let mut range = ((hi - lo) + slack) * (1.0 + f64::EPSILON);
        if self.wraps {
            range *= 2.0;
        }
        if !(range.is_finite() && self.formats.iter().all(|&f| range <= f.max_finite())) {
            return false;
        }
        // Every nonzero term's lowest set bit (g is their least) at least each format's
        // smallest subnormal and above range·2^-p: checked term by term, so that rows of
        // fine-grained values (squares of FP32 values) are declined at their first term.
        let (mut need_sub, mut need) = (0.0f64, 0.0f64);
        for &f in &self.formats {
            need_sub = need_sub.max(f.min_subnormal());
            need = need.max(range * crate::format::pow2(-(f.precision() as i32)));
        }
        let mut any = false;
        for &t in terms {
            if t != 0.0 {
                let g = lowest_bit(t);
                if g < need_sub || g <= need {
                    return false;
                }
                any = true;
            }
        }
        any
    }

    /// The statistics of [`random_rounding_error`] for computed terms known within `radii`
    /// of `terms` (none: exact): the rounding statistics are the model terms' (as
    /// `reduction_error_within` prices the orders the walk does not follow), the guaranteed
    /// bound grows by Σ rᵢ·wᵢ. The same values as `random_rounding_error` but for the order
    /// in which the variances of repeated roundings are added (a relative 10⁻¹⁵ or so).
    ///
    /// Unlike `random_rounding_error`, which prices terms the walk has already checked, the
    /// model refuses terms whose partial sums may overflow: every computed partial sum lies
    /// within Σ(|tᵢ| + rᵢ)·(1 + max wᵢ) of zero (Higham's bound on each term's path), and
    /// where that reaches the narrowest format's overflow threshold the walk decides.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] for a row of another length; [`Error::NonFinite`] for a
    /// term that is not finite; [`Error::Overflow`] where a partial sum may overflow.
    pub(crate) fn error_within(&self, terms: &[f64], radii: &[f64]) -> Result<ReductionError> {
        if terms.len() != self.n || !(radii.is_empty() || radii.len() == self.n) {
            return Err(Error::InvalidParameter {
                name: "terms",
                reason: format!(
                    "{} terms (and {} radii) priced by a model of {}",
                    terms.len(),
                    radii.len(),
                    self.n
                ),
            });
        }
        if let Some(i) = terms.iter().position(|t| !t.is_finite()) {
            return Err(Error::NonFinite {
                what: format!("reduction term {i}"),
                value: terms[i],
            });
        }
        let abs_sum = terms.iter().map(|t| t.abs()).sum::<f64>();
        let reach = (abs_sum + radii.iter().sum::<f64>()) * (1.0 + self.growth) * (1.0 + 1e-9);
        if reach.is_nan() || reach >= self.limit.1 {
            return Err(overflow_error(
                self.limit.0,
                reach,
                "a partial sum of the all-random model",
            ));
        }
        let mut prefix = Vec::with_capacity(self.n + 1);
        prefix.push(0.0f64);
        let mut run = 0.0;
        for &t in terms {
            run += t;
            prefix.push(run);
        }
        // Higham's bound along each term's path: `random_rounding_error`'s (with the
        // underflow of exact products counted per rounding on a path), and the walk's (the
        // underflow of every rounding, carried by the growth factor). The larger is the
        // model's guaranteed bound, so that it is never below the walk's.
        let mut higham = 0.0;
        for (i, (t, w)) in terms.iter().zip(&self.weights).enumerate() {
            higham += (t.abs() + radii.get(i).copied().unwrap_or(0.0)) * w;
        }
        let mut random_bound = higham;
        if self.is_dot {
            random_bound += self.roundings as f64 * self.accumulator.min_subnormal() / 2.0;
        }
        let random_bound = random_bound * (1.0 + 1e-12);
        let walk_bound = (higham + self.underflow) * (1.0 + self.growth) * (1.0 + 1e-12);
        let guaranteed = random_bound.max(walk_bound);
        if radii.iter().all(|&r| r == 0.0) && self.all_exact(terms, &prefix, abs_sum) {
            // No rounding errs (where `random_rounding_error` may still see a sum that
            // enters a coarser binade as a rounding on its spacing).
            return Ok(ReductionError {
                guaranteed,
                ..ReductionError::default()
            });
        }
        let range_sum = |(s, e): (usize, usize)| {
            if e <= s {
                0.0
            } else {
                prefix[e] - prefix[s]
            }
        };
        // Each operand's value and the grid it lies on: a term's lowest set bit, a computed
        // value's spacing in its format.
        let operand = |o: &Op| -> (f64, f64) {
            match *o {
                Op::None => (0.0, f64::INFINITY),
                Op::Term(i) => (terms[i], lowest_bit(terms[i])),
                Op::Value {
                    first,
                    second,
                    grid,
                } => {
                    let v = range_sum(first) + range_sum(second);
                    (v, grid.ulp(v))
                }
            }
        };
        let (mut variance, mut mean, mut tie_bound, mut repeated) = (0.0, 0.0, 0.0, 0.0);
        let mut table = REPEATS.with(|r| std::mem::take(&mut *r.borrow_mut()));
        let mut reserved = false;
        let no_terms: &[f64] = &[];
        for s in &self.sites {
            // The value rounded, the two operands with their grids, the fused terms.
            let (v, (a, qa), (b, qb), fused) = match s.step {
                Some(value_grid) => {
                    let (start, i) = (s.first.0, s.first.1 - 1);
                    let p0 = prefix[start];
                    let a = prefix[i] - p0;
                    let t = terms[i];
                    // (+ 0.0: the general path's empty fused sum, which makes −0 into +0.)
                    (
                        prefix[i + 1] - p0,
                        (a, value_grid.ulp(a)),
                        (t + 0.0, lowest_bit(t)),
                        no_terms,
                    )
                }
                None => {
                    let fused = &terms[s.fused.0..s.fused.1.max(s.fused.0)];
                    let (b, qb) = operand(&s.ops[1]);
                    (
                        range_sum(s.first) + range_sum(s.second),
                        operand(&s.ops[0]),
                        (b + fused.iter().sum::<f64>(), qb),
                        fused,
                    )
                }
            };
            let ulp = s.grid.ulp(v);
            let first_big = a.abs() >= b.abs();
            let (q_big, small, small_is_term) = if first_big {
                (qa, b, matches!(s.ops[1], Op::Term(_)))
            } else {
                (qb, a, matches!(s.ops[0], Op::Term(_)))
            };
            let big_on_grid = (fused.is_empty() || first_big) && q_big >= ulp;
            if big_on_grid && small != 0.0 && small.abs() < ulp / 2.0 {
                mean -= small;
                continue;
            }
            let small_exact = !fused.is_empty() || small_is_term;
            // A tie: small an odd multiple of half the spacing (its lowest set bit ulp/2).
            if big_on_grid && small_exact && ulp > 0.0 && lowest_bit(small) == ulp / 2.0 {
                tie_bound += ulp / 2.0;
                continue;
            }
            let mut g = qa.min(qb);
            for &t in fused {
                g = g.min(lowest_bit(t));
            }
            if g >= ulp {
                continue;
            }
            let var = ulp * ulp / 12.0 + g * g / 6.0;
            if big_on_grid && small_exact {
                if !reserved {
                    table.reserve(self.sites.len());
                    reserved = true;
                }
                repeated += table.add((ulp.to_bits(), small.to_bits()), var);
            } else {
                variance += var;
            }
        }
        variance += repeated;
        table.clear();
        REPEATS.with(|r| *r.borrow_mut() = table);
        let mut e = growth_applied(random_bound, variance, self.growth);
        e.mean = mean;
        e.tie_bound = tie_bound.min(e.guaranteed);
        e.guaranteed = guaranteed;
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::SplitMix64;
    use crate::format::Overflow;

    /// The compiled model gives `random_rounding_error`'s statistics (bit for bit but for the
    /// order in which repeated roundings' variances are added): every plain
    /// order, sums and dot products (exact and rounded products), Gaussian, constant,
    /// integer and one-outlier rows, narrow and wide accumulators.
    #[test]
    fn compiled_model_is_random_rounding_error() {
        let orders = [
            "sequential",
            "pairwise:8",
            "pairwise:1",
            "blocked:16",
            "blockfma:32",
            "splitk:4:f32:seq",
            "splitk:3:bf16:tree",
            "splitk:4:f32:ring:1",
        ];
        let mut g = SplitMix64::for_name("compiled", 1);
        let (mut checked, mut exact) = (0, 0);
        for n in [1usize, 2, 7, 64, 333, 1024] {
            let rows: Vec<Vec<f64>> = vec![
                (0..n).map(|_| g.normal()).collect(),
                vec![1.7; n],
                (0..n).map(|i| (i % 13) as f64 - 6.0).collect(),
                (0..n)
                    .map(|i| if i == n / 3 { 1e6 } else { g.normal() })
                    .collect(),
            ];
            for order in orders {
                let order: Order = order.parse().unwrap();
                for (input, acc_f) in [
                    (Format::BF16, Format::F32),
                    (Format::F16, Format::F16),
                    (Format::F32, Format::F32),
                    (Format::BF16, Format::BF16),
                ] {
                    for (is_dot, products) in [
                        (false, Products::Exact),
                        (true, Products::Exact),
                        (true, Products::Rounded(Format::BF16)),
                    ] {
                        let acc = Accumulation {
                            products,
                            ..Accumulation::new(input, acc_f, order.clone())
                        };
                        let Ok(Some(model)) = RandomModel::new(&acc, n, is_dot) else {
                            assert!(
                                random_rounding_error(&vec![1.0; n], &acc, is_dot).is_err()
                                    || acc.order == Order::Kahan
                                    || (is_dot && products != Products::Exact)
                            );
                            continue;
                        };
                        for row in &rows {
                            let inputs: Vec<f64> = row
                                .iter()
                                .map(|&v| input.round(v, Overflow::Saturating))
                                .collect();
                            let terms: Vec<f64> = if is_dot {
                                inputs.iter().map(|t| t * 0.75).collect()
                            } else {
                                inputs.clone()
                            };
                            let want = random_rounding_error(&terms, &acc, is_dot);
                            let got = model.error(&terms);
                            // The guaranteed bound: the larger of the all-random model's and
                            // the walk's, never below the walk's.
                            let bound =
                                |w: &ReductionError| match reduction_error(&terms, &acc, is_dot) {
                                    Ok(walk) => w.guaranteed.max(walk.guaranteed),
                                    Err(_) => f64::NAN,
                                };
                            let at = format!("{order} n={n} {input}/{acc_f} dot={is_dot}");
                            match (want, got) {
                                // Every rounding exact (the compiled model's criterion, which
                                // the all-random one does not apply): the engine's result is
                                // the exact sum.
                                (Ok(w), Ok(c))
                                    if (c.variance, c.mean, c.tie_bound) == (0.0, 0.0, 0.0)
                                        && (w.variance, w.mean, w.tie_bound) != (0.0, 0.0, 0.0) =>
                                {
                                    let computed = if is_dot {
                                        crate::order::dot(&inputs, &vec![0.75; n], &acc)
                                    } else {
                                        crate::order::sum(&terms, &acc)
                                    }
                                    .unwrap();
                                    assert_eq!(computed, crate::exact::exact_sum(&terms), "{at}");
                                    assert_eq!(bound(&w), c.guaranteed, "{at}");
                                    exact += 1;
                                }
                                (Ok(w), Ok(c)) => {
                                    assert_eq!(
                                        (bound(&w), w.mean, w.tie_bound),
                                        (c.guaranteed, c.mean, c.tie_bound),
                                        "{at}"
                                    );
                                    let tol = 1e-13 * w.variance;
                                    assert!(
                                        (w.variance - c.variance).abs() <= tol,
                                        "{at}: {w:?} {c:?}"
                                    );
                                    checked += 1;
                                }
                                // Higham's reach refuses a little early (rows near the
                                // accumulator's range): the walk decides those.
                                (Ok(_), Err(Error::Overflow { format, .. }))
                                    if terms.iter().map(|t| t.abs()).sum::<f64>()
                                        > format.max_finite() / 2.0 => {}
                                (w, c) => panic!("{order} n={n}: {w:?} against {c:?}"),
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 1000 && exact > 10, "{checked} {exact}");
    }

    /// A row of another length, a term that is not finite, partial sums that may overflow
    /// (an FP16 accumulator and values that reach its range together) are errors, not
    /// statistics.
    #[test]
    fn other_lengths_non_finite_terms_and_overflow_are_refused() {
        let f16 = Accumulation::new(Format::F16, Format::F16, Order::Sequential);
        let m = RandomModel::new(&f16, 4, false).unwrap().unwrap();
        assert!(m.error(&[1.0, 2.0, 3.0, 4.0]).is_ok());
        assert!(matches!(
            m.error(&[40000.0, 30000.0, 1.0, 1.0]),
            Err(Error::Overflow {
                format: Format::F16,
                ..
            })
        ));
        assert!(matches!(
            m.error(&[1.0, f64::NAN, 1.0, 1.0]),
            Err(Error::NonFinite { .. })
        ));
        let acc = Accumulation::new(Format::BF16, Format::F32, Order::Sequential);
        let m = RandomModel::new(&acc, 8, false).unwrap().unwrap();
        assert!(matches!(
            m.error(&[1.0; 7]),
            Err(Error::InvalidParameter { name: "terms", .. })
        ));
        assert!(matches!(
            m.error_within(&[1.0; 8], &[0.0; 3]),
            Err(Error::InvalidParameter { name: "terms", .. })
        ));
    }
}
