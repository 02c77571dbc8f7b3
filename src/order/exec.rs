//! Executing a reduction in an order: [`sum`] and [`dot`] with every addition correctly
//! rounded to the accumulator format (native `f32` where that is exactly the same).

use super::*;

/// Range of part `j` of `parts` over `len` terms: ⌊j·len/p⌋ .. ⌊(j+1)·len/p⌋.
pub(crate) fn part_range(j: usize, parts: usize, len: usize) -> Range<usize> {
    let start = (j as u128 * len as u128 / parts as u128) as usize;
    let end = ((j as u128 + 1) * len as u128 / parts as u128) as usize;
    start..end
}

/// An exact term: hi + lo, with lo = 0 unless a product of two `f64` values needs two parts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Term {
    pub(crate) hi: f64,
    lo: f64,
    /// When `lo` ≠ 0, the term is the exact product x·y of these factors.
    x: f64,
    y: f64,
}

/// Where the terms of a reduction come from.
pub(crate) trait Terms {
    fn term(&self, i: usize) -> Term;
    fn add_exact(&self, i: usize, acc: &mut ExactAccumulator);
    /// The exponent a tensor core aligns term `i` by (see [`TensorCoreSum`]): e_x + e_y for
    /// an exact product, the value's own exponent otherwise; `None` for a zero or a
    /// non-finite term.
    fn align_exponent(&self, i: usize) -> Option<i32>;
}

pub(crate) struct SumTerms<'a>(&'a [f64]);

impl Terms for SumTerms<'_> {
    #[inline]
    fn term(&self, i: usize) -> Term {
        Term {
            hi: self.0[i],
            lo: 0.0,
            x: 0.0,
            y: 0.0,
        }
    }
    fn add_exact(&self, i: usize, acc: &mut ExactAccumulator) {
        acc.add(self.0[i]);
    }
    #[inline]
    fn align_exponent(&self, i: usize) -> Option<i32> {
        value_exponent(self.0[i])
    }
}

/// Exact values with the exponents a tensor core aligns them by (products given by their
/// value and their factors' exponent sum).
pub(crate) struct AlignedTerms<'a> {
    values: &'a [f64],
    exps: &'a [Option<i32>],
}

impl<'a> AlignedTerms<'a> {
    /// `exps[i]` is the alignment exponent of `values[i]`; the slices have one length.
    pub(crate) fn new(values: &'a [f64], exps: &'a [Option<i32>]) -> AlignedTerms<'a> {
        debug_assert_eq!(values.len(), exps.len());
        AlignedTerms { values, exps }
    }
}

impl Terms for AlignedTerms<'_> {
    #[inline]
    fn term(&self, i: usize) -> Term {
        Term {
            hi: self.values[i],
            lo: 0.0,
            x: 0.0,
            y: 0.0,
        }
    }
    fn add_exact(&self, i: usize, acc: &mut ExactAccumulator) {
        acc.add(self.values[i]);
    }
    #[inline]
    fn align_exponent(&self, i: usize) -> Option<i32> {
        self.exps[i]
    }
}

pub(crate) struct DotTerms<'a> {
    x: &'a [f64],
    y: &'a [f64],
    products: Products,
    overflow: Overflow,
    /// Whether the product of two inputs is always exact in `f64` (input precision ≤ 26).
    exact_in_f64: bool,
}

impl DotTerms<'_> {
    #[inline]
    fn exact_product(&self, i: usize) -> Term {
        let (a, b) = (self.x[i], self.y[i]);
        let hi = a * b;
        if self.exact_in_f64 || !hi.is_finite() {
            Term {
                hi,
                lo: 0.0,
                x: a,
                y: b,
            }
        } else {
            // TwoProduct with an FMA (Ogita, Rump & Oishi 2005): exact unless the product underflows.
            Term {
                hi,
                lo: a.mul_add(b, -hi),
                x: a,
                y: b,
            }
        }
    }
}

impl Terms for DotTerms<'_> {
    #[inline]
    fn term(&self, i: usize) -> Term {
        let t = self.exact_product(i);
        match self.products {
            Products::Exact => t,
            Products::Rounded(f) => Term {
                hi: if t.lo == 0.0 {
                    f.round(t.hi, self.overflow)
                } else {
                    f.add_rounded(t.hi, t.lo, self.overflow)
                },
                lo: 0.0,
                x: 0.0,
                y: 0.0,
            },
        }
    }
    fn add_exact(&self, i: usize, acc: &mut ExactAccumulator) {
        match self.products {
            Products::Exact => acc.add_product(self.x[i], self.y[i]),
            Products::Rounded(_) => acc.add(self.term(i).hi),
        }
    }
    #[inline]
    fn align_exponent(&self, i: usize) -> Option<i32> {
        match self.products {
            Products::Exact => product_exponent(self.x[i], self.y[i]),
            Products::Rounded(_) => value_exponent(self.term(i).hi),
        }
    }
}

/// The arithmetic context of one reduction level: accumulator format and overflow policy.
#[derive(Clone, Copy)]
pub(crate) struct Ctx {
    pub(crate) acc: Format,
    pub(crate) overflow: Overflow,
}

impl Ctx {
    /// fl(t): a term loaded into the accumulator.
    #[inline]
    fn load(&self, t: Term) -> f64 {
        if t.lo == 0.0 {
            self.acc.round(t.hi, self.overflow)
        } else {
            self.acc.add_rounded(t.hi, t.lo, self.overflow)
        }
    }

    /// fl(a + t).
    #[inline]
    fn add(&self, a: f64, t: Term) -> f64 {
        if t.lo == 0.0 {
            self.acc.add_rounded(a, t.hi, self.overflow)
        } else if self.acc == Format::F64 {
            // fl64(a + x·y) with one rounding: a fused multiply-add.
            t.x.mul_add(t.y, a)
        } else {
            let mut e = ExactAccumulator::new();
            e.add(a);
            e.add(t.hi);
            e.add(t.lo);
            e.round(self.acc, self.overflow)
        }
    }

    /// fl(a + b) for two values.
    #[inline]
    fn add2(&self, a: f64, b: f64) -> f64 {
        self.acc.add_rounded(a, b, self.overflow)
    }
}

pub(crate) fn reduce<T: Terms>(terms: &T, range: Range<usize>, order: &Order, ctx: Ctx) -> f64 {
    match order {
        Order::Sequential => sequential(terms, range, ctx),
        Order::Pairwise { base } => pairwise(terms, range, *base, ctx),
        Order::Blocked { block, inner } => {
            let mut total = 0.0;
            let mut exact = match inner {
                BlockSum::Fused => Some(ExactAccumulator::new()),
                BlockSum::Sequential => None,
            };
            let mut start = range.start;
            let mut first = true;
            while start < range.end {
                let end = (start + block).min(range.end);
                match exact.as_mut() {
                    None => {
                        let s = sequential(terms, start..end, ctx);
                        total = if first { s } else { ctx.add2(total, s) };
                    }
                    Some(acc) => {
                        acc.clear();
                        acc.add(total);
                        for i in start..end {
                            terms.add_exact(i, acc);
                        }
                        total = acc.round(ctx.acc, ctx.overflow);
                    }
                }
                first = false;
                start = end;
            }
            total
        }
        Order::SplitK {
            parts,
            inner,
            partial,
            combine,
        } => {
            let len = range.end - range.start;
            let p = *parts;
            let partial_ctx = Ctx {
                acc: *partial,
                overflow: ctx.overflow,
            };
            let partials: Vec<f64> = (0..p)
                .map(|j| {
                    let r = part_range(j, p, len);
                    let s = reduce(
                        terms,
                        range.start + r.start..range.start + r.end,
                        inner,
                        ctx,
                    );
                    partial.round(s, ctx.overflow)
                })
                .collect();
            let values = SumTerms(&partials);
            match combine {
                Combine::Sequential => sequential(&values, 0..p, partial_ctx),
                Combine::Tree => pairwise(&values, 0..p, 1, partial_ctx),
                Combine::Ring { start } => {
                    let mut s = partials[*start];
                    for k in 1..p {
                        s = partial_ctx.add2(s, partials[(start + k) % p]);
                    }
                    s
                }
            }
        }
        Order::TensorCore(tc) => tensorcore::run(terms, range, tc, ctx),
        Order::AnyOf(members) => match members.first() {
            // An order of unknown kernel: executed as its first member.
            Some(first) => reduce(terms, range, first, ctx),
            None => sequential(terms, range, ctx),
        },
        Order::Kahan => {
            if range.is_empty() {
                return 0.0;
            }
            let mut s = ctx.load(terms.term(range.start));
            let mut c = 0.0;
            for i in range.start + 1..range.end {
                let t = terms.term(i);
                let y = ctx.add(-c, t);
                let next = ctx.add2(s, y);
                c = ctx.add2(ctx.add2(next, -s), -y);
                s = next;
            }
            s
        }
    }
}

#[inline]
pub(crate) fn sequential<T: Terms>(terms: &T, range: Range<usize>, ctx: Ctx) -> f64 {
    if range.is_empty() {
        return 0.0;
    }
    let mut s = ctx.load(terms.term(range.start));
    for i in range.start + 1..range.end {
        s = ctx.add(s, terms.term(i));
    }
    s
}

pub(crate) fn pairwise<T: Terms>(terms: &T, range: Range<usize>, base: usize, ctx: Ctx) -> f64 {
    let len = range.end - range.start;
    if len <= base {
        return sequential(terms, range, ctx);
    }
    let mid = range.start + len.div_ceil(2);
    let left = pairwise(terms, range.start..mid, base, ctx);
    let right = pairwise(terms, mid..range.end, base, ctx);
    ctx.add2(left, right)
}

pub(crate) fn check_inputs(xs: &[f64], format: Format, name: &str) -> Result<()> {
    match format.first_unrepresentable(xs) {
        None => Ok(()),
        Some(i) => Err(Error::NotRepresentable {
            value: xs[i],
            format,
            what: format!("input {name}[{i}]"),
        }),
    }
}

/// Σ xᵢ under `policy`, every addition rounded to the accumulator format in the policy's
/// order. An empty sum is +0.
///
/// Errors: an element that is not a value of `policy.input`
/// ([`Error::NotRepresentable`], naming its index), or invalid order parameters.
/// NaN and infinities propagate as in IEEE arithmetic.
///
/// ```
/// use ttrace::{sum, Accumulation, Format, Order};
/// // 1 + 0 + 2^-8 + 2^-8 in BF16: sequentially each 2^-8 is a tie that rounds back to 1 ...
/// let xs = [1.0, 0.0, 2f64.powi(-8), 2f64.powi(-8)];
/// let seq = Accumulation::new(Format::BF16, Format::BF16, Order::Sequential);
/// assert_eq!(sum(&xs, &seq).unwrap(), 1.0);
/// // ... while the pairwise tree (1 + 0) + (2^-8 + 2^-8) keeps them.
/// let pw = Accumulation::new(Format::BF16, Format::BF16, Order::Pairwise { base: 1 });
/// assert_eq!(sum(&xs, &pw).unwrap(), 1.0 + 2f64.powi(-7));
/// ```
pub fn sum(xs: &[f64], policy: &Accumulation) -> Result<f64> {
    policy.validate()?;
    check_inputs(xs, policy.input, "x")?;
    Ok(sum_unchecked(xs, policy))
}

/// [`sum`] without validating the policy or the inputs (the caller has).
pub(crate) fn sum_unchecked(xs: &[f64], policy: &Accumulation) -> f64 {
    let ctx = Ctx {
        acc: policy.accumulator,
        overflow: policy.overflow,
    };
    if policy.order == Order::Sequential
        && policy.accumulator == Format::F32
        && policy.input.is_subset_of(Format::F32)
        && policy.overflow == Overflow::NonSaturating
    {
        return sequential_f32_sum(xs);
    }
    reduce(&SumTerms(xs), 0..xs.len(), &policy.order, ctx)
}

/// Σ xᵢ·yᵢ under `policy`: products handled as `policy.products` says, then accumulated as in
/// [`sum`]. An empty dot product is +0.
///
/// Errors: different lengths ([`Error::LengthMismatch`]), an element that is not a value of
/// `policy.input`, or invalid order parameters. With `F64` inputs and exact products the
/// product is split by an FMA, which is exact unless it underflows.
pub fn dot(x: &[f64], y: &[f64], policy: &Accumulation) -> Result<f64> {
    if x.len() != y.len() {
        return Err(Error::LengthMismatch {
            what: "dot",
            left: x.len(),
            right: y.len(),
        });
    }
    policy.validate()?;
    check_inputs(x, policy.input, "x")?;
    check_inputs(y, policy.input, "y")?;
    Ok(dot_unchecked(x, y, policy))
}

/// [`dot`] without validating the policy, the lengths or the inputs (the caller has).
pub fn dot_unchecked(x: &[f64], y: &[f64], policy: &Accumulation) -> f64 {
    debug_assert_eq!(x.len(), y.len());
    let ctx = Ctx {
        acc: policy.accumulator,
        overflow: policy.overflow,
    };
    if policy.order == Order::Sequential
        && policy.accumulator == Format::F32
        && policy.products == Products::Rounded(Format::F32)
        && policy.input.is_subset_of(Format::F32)
        && policy.overflow == Overflow::NonSaturating
    {
        return sequential_f32_dot(x, y);
    }
    let terms = DotTerms {
        x,
        y,
        products: policy.products,
        overflow: policy.overflow,
        exact_in_f64: policy.input.precision() <= 26,
    };
    reduce(&terms, 0..x.len(), &policy.order, ctx)
}

/// Native `f32` recursive summation: for `f32` inputs and accumulator each `f32` addition is
/// exactly the correctly rounded sum the emulation would compute.
pub(crate) fn sequential_f32_sum(xs: &[f64]) -> f64 {
    let mut it = xs.iter();
    let Some(&first) = it.next() else {
        return 0.0;
    };
    let mut s = first as f32;
    for &x in it {
        s += x as f32;
    }
    s as f64
}

/// Native `f32` dot product with products rounded to `f32` (no FMA contraction in Rust).
pub(crate) fn sequential_f32_dot(x: &[f64], y: &[f64]) -> f64 {
    if x.is_empty() {
        return 0.0;
    }
    let mut s = x[0] as f32 * y[0] as f32;
    for (&a, &b) in x[1..].iter().zip(&y[1..]) {
        s += a as f32 * b as f32;
    }
    s as f64
}
