//! Accumulation orders and emulated reductions (`sum`, `dot`) with exact control of every
//! rounding.
//!
//! A reduction is described by an [`Accumulation`] policy: the format of the inputs, what
//! happens to products ([`Products`]), the accumulator format, the [`Order`] in which terms are
//! combined, and the overflow policy. Every addition is rounded once, correctly, to the
//! accumulator format (no double rounding through `f64`: see [`Format::add_rounded`]); fused
//! steps (an FMA, or a whole block of a block-FMA) are computed exactly and rounded once with
//! an [`ExactAccumulator`].
//!
//! Each order also reports, for a length n, how many roundings each term undergoes and in
//! which format ([`Accumulation::sum_depths`], [`Accumulation::dot_depths`]); Higham's
//! summation bounds are written in terms of these depths (Higham 2002, §4.2 and Lemma 3.1):
//! |ŝ − s| ≤ Σᵢ |xᵢ| · (Πf (1 + u_f)^(dᵢ,f) − 1) when no underflow occurs.
//!
//! The orders and their depths are derived in `papers/formats-and-orders.md`.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::exact::ExactAccumulator;
use crate::format::{Format, Overflow};

/// The order in which the terms of a reduction are combined.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Order {
    /// Left to right: s = x₀, then s = fl(s + xᵢ) for i = 1, …, n−1 (Higham 2002, §4.1,
    /// "recursive summation"). A term entering at step i is rounded n − i times (x₀ and x₁
    /// n − 1 times).
    Sequential,
    /// Recursive halving: a range of at most `base` terms is summed sequentially; a longer
    /// one is split into a first half of ⌈len/2⌉ terms and the rest, each summed pairwise, and
    /// the two results added (Higham 2002, §4.1, "pairwise summation"; NumPy uses base 8 with
    /// its own split). `base` ≥ 1.
    Pairwise {
        /// Largest range summed sequentially.
        base: usize,
    },
    /// Blocks of `block` consecutive terms (the last may be shorter), as GPU GEMM kernels tile
    /// the K dimension. Each block's result is added to a running accumulator in order.
    Blocked {
        /// Terms per block (≥ 1).
        block: usize,
        /// How each block is summed.
        inner: BlockSum,
    },
    /// Split-K: the n terms are cut into `parts` contiguous ranges (part j holds terms
    /// ⌊jn/p⌋ … ⌊(j+1)n/p⌋ − 1), each reduced with `inner` in the accumulator format, rounded to
    /// `partial`, and the partial results combined by `combine` with every addition rounded to
    /// `partial`. This models split-K GEMMs and tensor-parallel row-parallel layers, whose
    /// per-rank partial sums are all-reduced in the communication format.
    SplitK {
        /// Number of parts p (≥ 1).
        parts: usize,
        /// Order used inside each part.
        inner: Box<Order>,
        /// Format of the partial results and of the combining additions.
        partial: Format,
        /// How partial results are combined.
        combine: Combine,
    },
    /// Kahan's compensated summation (Higham 2002, §4.3): s = x₀, c = 0; for each further
    /// term y = fl(xᵢ − c), t = fl(s + y), c = fl(fl(t − s) − y), s = t. Every operation is
    /// rounded to the accumulator format. Error ≤ (2u + O(nu²))·Σ|xᵢ| (Knuth, TAOCP vol. 2, §4.2.2; Goldberg 1991, Thm 8; Higham 2002, §4.3).
    Kahan,
}

impl Order {
    /// [`Order::Pairwise`] with ranges of at most `base` terms summed sequentially.
    pub fn pairwise(base: usize) -> Order {
        Order::Pairwise { base }
    }

    /// [`Order::Blocked`] with each block of `block` terms summed sequentially.
    pub fn blocked(block: usize) -> Order {
        Order::Blocked {
            block,
            inner: BlockSum::Sequential,
        }
    }

    /// [`Order::Blocked`] with each block added to the running total in one fused operation
    /// (tensor cores' block FMA).
    pub fn block_fma(block: usize) -> Order {
        Order::Blocked {
            block,
            inner: BlockSum::Fused,
        }
    }

    /// [`Order::SplitK`] with each part summed sequentially: `parts` partial results rounded to
    /// `partial` and combined by `combine` in `partial`.
    ///
    /// # Examples
    ///
    /// ```
    /// use ttrace::{Combine, Format, Order};
    /// let o = Order::split_k(8, Format::BF16, Combine::Ring { start: 1 });
    /// assert_eq!(o.to_string(), "splitk:8:bf16:ring:1");
    /// assert_eq!("splitk:8:bf16:ring:1".parse::<Order>()?, o);
    /// # Ok::<(), ttrace::Error>(())
    /// ```
    pub fn split_k(parts: usize, partial: Format, combine: Combine) -> Order {
        Order::SplitK {
            parts,
            inner: Box::new(Order::Sequential),
            partial,
            combine,
        }
    }

    /// The format the result of a reduction in this order is a value of, given the
    /// accumulator format: the partial format for split-K (its last additions round there),
    /// the accumulator otherwise.
    pub fn result_format(&self, accumulator: Format) -> Format {
        match self {
            Order::SplitK { partial, .. } => *partial,
            _ => accumulator,
        }
    }
}

/// The text form read by [`Order::from_str`](std::str::FromStr::from_str): `sequential`,
/// `pairwise:B`, `blocked:B`, `blockfma:B`, `kahan`, or `splitk:P:FMT:COMBINE` with COMBINE
/// `seq`, `tree` or `ring:START`, followed by `:inner=ORDER` when the parts are not summed
/// sequentially. Parsing the text gives the order back.
impl std::fmt::Display for Order {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Order::Sequential => f.write_str("sequential"),
            Order::Pairwise { base } => write!(f, "pairwise:{base}"),
            Order::Blocked {
                block,
                inner: BlockSum::Sequential,
            } => write!(f, "blocked:{block}"),
            Order::Blocked {
                block,
                inner: BlockSum::Fused,
            } => write!(f, "blockfma:{block}"),
            Order::Kahan => f.write_str("kahan"),
            Order::SplitK {
                parts,
                inner,
                partial,
                combine,
            } => {
                write!(f, "splitk:{parts}:{partial}:")?;
                match combine {
                    Combine::Sequential => f.write_str("seq")?,
                    Combine::Tree => f.write_str("tree")?,
                    Combine::Ring { start } => write!(f, "ring:{start}")?,
                }
                if **inner != Order::Sequential {
                    write!(f, ":inner={inner}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::str::FromStr for Order {
    type Err = Error;

    /// Parse the text form of [`Order`]'s `Display` (`seq` for `sequential` too; in a split-K
    /// order the partial format defaults to `f32`, the combination to `seq` and a ring's start
    /// to chunk 0's, 1 mod P: [`Combine::ring_for_chunk`]). The order's parameters are checked as [`Accumulation::validate`] does.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidParameter`] (`name` "order") for text that is not an order, or the
    /// parameter error of an order whose parameters are invalid (`blocked:0`).
    fn from_str(s: &str) -> Result<Order> {
        let bad = |why: String| Error::InvalidParameter {
            name: "order",
            reason: format!(
                "'{s}': {why} (sequential, pairwise:B, blocked:B, blockfma:B, kahan, \
                 splitk:P:FMT:seq|tree|ring:START[:inner=ORDER])"
            ),
        };
        let s = s.trim();
        let (head, rest) = s.split_once(':').unwrap_or((s, ""));
        let whole = |what: &str, text: &str| {
            text.parse::<usize>()
                .map_err(|_| bad(format!("{what} '{text}' is not a whole number")))
        };
        let none = |order: Order| {
            if rest.is_empty() {
                Ok(order)
            } else {
                Err(bad(format!("'{head}' takes no parameter")))
            }
        };
        let order = match head {
            "sequential" | "seq" => none(Order::Sequential)?,
            "kahan" => none(Order::Kahan)?,
            "pairwise" => Order::pairwise(whole("base", rest)?),
            "blocked" => Order::blocked(whole("block size", rest)?),
            "blockfma" => Order::block_fma(whole("block size", rest)?),
            "splitk" => {
                let (fields, inner) = match rest.split_once(":inner=") {
                    Some((f, i)) => (f, Box::new(i.parse::<Order>()?)),
                    None => (rest, Box::new(Order::Sequential)),
                };
                let fields: Vec<&str> = fields.split(':').collect();
                let parts = whole("number of parts", fields[0])?;
                let partial = match fields.get(1) {
                    Some(t) => t.parse::<Format>()?,
                    None => Format::F32,
                };
                let combine = match (fields.get(2).copied(), fields.get(3)) {
                    (None | Some("seq" | "sequential"), None) => Combine::Sequential,
                    (Some("tree"), None) => Combine::Tree,
                    // The accumulation order of chunk 0 of a ring reduce-scatter.
                    (Some("ring"), None) => Combine::ring_for_chunk(0, parts)?,
                    (Some("ring"), Some(t)) => Combine::Ring {
                        start: whole("ring start", t)?,
                    },
                    (Some(c), _) => return Err(bad(format!("unknown combination '{c}'"))),
                    (None, Some(_)) => return Err(bad("stray field".into())),
                };
                if fields.len() > 4 {
                    return Err(bad("too many fields".into()));
                }
                Order::SplitK {
                    parts,
                    inner,
                    partial,
                    combine,
                }
            }
            other => return Err(bad(format!("unknown order '{other}'"))),
        };
        validate_order(&order)?;
        Ok(order)
    }
}

/// How the terms inside one block of [`Order::Blocked`] are summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockSum {
    /// The block is summed sequentially on its own (every addition rounded), then added to the
    /// running total: Higham's blocked summation.
    Sequential,
    /// The block's terms and the running total are added exactly and rounded once: the
    /// block fused multiply-add of GPU tensor cores (Blanchard, Higham, Lopez, Mary &
    /// Pranesh, SIAM J. Sci. Comput. 42(3), 2020), with exact products and alignment.
    Fused,
}

/// How the partial results of [`Order::SplitK`] are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Combine {
    /// P₀ + P₁ + … + P_{p−1}, left to right.
    Sequential,
    /// A balanced binary tree over the parts in index order (pairwise with base 1), as a
    /// tree all-reduce does.
    Tree,
    /// Ring order starting at rank `start`: P_start + P_{start+1} + … (indices mod p), the
    /// order in which a ring reduce-scatter accumulates one chunk. In a ring reduce-scatter
    /// the chunk owned by rank c is accumulated starting at rank (c + 1) mod p: see
    /// [`Combine::ring_for_chunk`].
    Ring {
        /// Rank whose partial result the accumulation starts from (< parts).
        start: usize,
    },
}

impl Combine {
    /// The ring order for output chunk `chunk` of a `parts`-rank ring reduce-scatter: the
    /// accumulation starts at rank (chunk + 1) mod parts and ends at the owner, rank `chunk`.
    pub fn ring_for_chunk(chunk: usize, parts: usize) -> Result<Combine> {
        if parts == 0 {
            return Err(Error::InvalidParameter {
                name: "parts",
                reason: "a ring needs at least one rank (got 0)".into(),
            });
        }
        Ok(Combine::Ring {
            start: (chunk + 1) % parts,
        })
    }
}

/// What happens to the products xᵢ·yᵢ of a dot product before they are accumulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Products {
    /// Products are kept exact and each enters the one addition it feeds, rounded once: in
    /// sequential order every step is a fused multiply-add, s = fl(s + xᵢyᵢ).
    Exact,
    /// Each product is first rounded to this format, then accumulated.
    Rounded(Format),
}

/// The arithmetic of one reduction: input format, products, accumulator, order, overflow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accumulation {
    /// Format the inputs are values of (checked on every call).
    pub input: Format,
    /// Handling of products in [`dot`]; ignored by [`sum`].
    pub products: Products,
    /// Format every accumulating addition is rounded to.
    pub accumulator: Format,
    /// Order of the additions.
    pub order: Order,
    /// What rounding does past the largest finite value of a format.
    pub overflow: Overflow,
}

impl Accumulation {
    /// A policy with exact (fused) products and non-saturating overflow.
    pub fn new(input: Format, accumulator: Format, order: Order) -> Self {
        Accumulation {
            input,
            products: Products::Exact,
            accumulator,
            order,
            overflow: Overflow::NonSaturating,
        }
    }

    /// The same policy with another product handling.
    pub fn with_products(mut self, products: Products) -> Self {
        self.products = products;
        self
    }

    /// The same policy with another overflow behaviour.
    pub fn with_overflow(mut self, overflow: Overflow) -> Self {
        self.overflow = overflow;
        self
    }

    /// Check the order's parameters (block sizes and part counts ≥ 1, ring start < parts).
    pub fn validate(&self) -> Result<()> {
        validate_order(&self.order)
    }

    /// For a sum of `n` terms: how many roundings each term undergoes, per format.
    /// Errors: invalid order parameters, or n above `MAX_DEPTH_TERMS`.
    pub fn sum_depths(&self, n: usize) -> Result<Vec<TermDepth>> {
        self.validate()?;
        check_depth_len(n)?;
        let load_rounds = !self.input.is_subset_of(self.accumulator);
        Ok(order_depths(&self.order, n, self.accumulator, load_rounds))
    }

    /// For a dot product of length `n`: how many roundings each product term undergoes, per
    /// format (a rounded product counts one rounding in its product format).
    /// Errors as for [`sum_depths`](Self::sum_depths).
    pub fn dot_depths(&self, n: usize) -> Result<Vec<TermDepth>> {
        self.validate()?;
        check_depth_len(n)?;
        let (load_rounds, product_format) = match self.products {
            Products::Exact => (true, None),
            Products::Rounded(f) => (!f.is_subset_of(self.accumulator), Some(f)),
        };
        let mut depths = order_depths(&self.order, n, self.accumulator, load_rounds);
        if let Some(f) = product_format {
            for d in &mut depths {
                d.add(f, 1);
            }
        }
        Ok(depths)
    }
}

fn validate_order(order: &Order) -> Result<()> {
    match order {
        Order::Sequential | Order::Kahan => Ok(()),
        Order::Pairwise { base } => positive("base", *base),
        Order::Blocked { block, .. } => positive("block", *block),
        Order::SplitK {
            parts,
            inner,
            combine,
            ..
        } => {
            positive("parts", *parts)?;
            let most = crate::io::guard::limits::SPLIT_PARTS;
            if *parts > most {
                return Err(Error::InvalidParameter {
                    name: "parts",
                    reason: format!("a split into {parts} parts exceeds the limit of {most}"),
                });
            }
            if let Combine::Ring { start } = combine {
                if start >= parts {
                    return Err(Error::InvalidParameter {
                        name: "start",
                        reason: format!("ring start rank {start} is not below parts = {parts}"),
                    });
                }
            }
            validate_order(inner)
        }
    }
}

fn positive(name: &'static str, value: usize) -> Result<()> {
    if value == 0 {
        Err(Error::InvalidParameter {
            name,
            reason: "must be at least 1 (got 0)".into(),
        })
    } else {
        Ok(())
    }
}

/// How many roundings one term of a reduction undergoes, counted per format.
///
/// For [`Order::Kahan`] the count is not a number of roundings but Knuth's first-order
/// coefficient: every term is reported with 2 roundings in the accumulator format, and the
/// O(n·u²) remainder of the compensated-summation bound is left to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct TermDepth {
    counts: [u32; 7],
}

impl TermDepth {
    /// Number of roundings to `format`.
    pub fn count(&self, format: Format) -> u32 {
        self.counts[format.index()]
    }

    /// Total number of roundings over all formats.
    pub fn total(&self) -> u32 {
        self.counts.iter().sum()
    }

    fn add(&mut self, format: Format, k: u32) {
        self.counts[format.index()] += k;
    }

    /// Πf (1 + u_f)^(count_f) − 1, with u_f the unit roundoff of each format: the largest
    /// |Π(1 + δ) − 1| over roundings |δ| ≤ u_f (no underflow). This is at most Higham's γ_k
    /// for a single format (Lemma 3.1) and never vacuous. Rounded up to be safe in `f64`.
    pub fn relative_error_bound(&self) -> f64 {
        let mut log = 0.0f64;
        for f in Format::ALL {
            let k = self.counts[f.index()];
            if k > 0 {
                log += k as f64 * f.unit_roundoff().ln_1p();
            }
        }
        // exp_m1 is accurate to a few ulps; inflate by 1e-12 relative to stay an upper bound.
        log.exp_m1() * (1.0 + 1e-12)
    }
}

/// Largest n for which [`Accumulation::sum_depths`] and [`Accumulation::dot_depths`] build
/// their per-term table (2^27 terms, about 3.8 GB).
pub const MAX_DEPTH_TERMS: usize = 1 << 27;

fn check_depth_len(n: usize) -> Result<()> {
    if n > MAX_DEPTH_TERMS {
        return Err(Error::InvalidParameter {
            name: "n",
            reason: format!(
                "a per-term depth table for {n} terms would not fit in memory (limit {MAX_DEPTH_TERMS})"
            ),
        });
    }
    Ok(())
}

fn order_depths(order: &Order, n: usize, acc: Format, load_rounds: bool) -> Vec<TermDepth> {
    let mut out = vec![TermDepth::default(); n];
    fill_depths(order, &mut out, acc, load_rounds);
    out
}

/// Depths of a sequential sum of `len` terms, in rounding counts (see [`Order::Sequential`]).
fn sequential_count(i: usize, len: usize, load_rounds: bool) -> u32 {
    let adds = if i == 0 {
        len.saturating_sub(1)
    } else {
        len - i
    } as u32;
    adds + u32::from(i == 0 && load_rounds)
}

fn fill_depths(order: &Order, out: &mut [TermDepth], acc: Format, load_rounds: bool) {
    let len = out.len();
    match order {
        Order::Sequential => {
            for (i, d) in out.iter_mut().enumerate() {
                d.add(acc, sequential_count(i, len, load_rounds));
            }
        }
        Order::Kahan => {
            for d in out.iter_mut() {
                d.add(acc, 2);
            }
        }
        Order::Pairwise { base } => {
            if len <= *base {
                fill_depths(&Order::Sequential, out, acc, load_rounds);
            } else {
                let h = len.div_ceil(2);
                let (left, right) = out.split_at_mut(h);
                fill_depths(order, left, acc, load_rounds);
                fill_depths(order, right, acc, load_rounds);
                for d in out.iter_mut() {
                    d.add(acc, 1);
                }
            }
        }
        Order::Blocked { block, inner } => {
            let nb = len.div_ceil(*block);
            for (j, chunk) in out.chunks_mut(*block).enumerate() {
                match inner {
                    BlockSum::Sequential => {
                        fill_depths(&Order::Sequential, chunk, acc, load_rounds);
                        for d in chunk.iter_mut() {
                            d.add(acc, sequential_count(j, nb, false));
                        }
                    }
                    BlockSum::Fused => {
                        for d in chunk.iter_mut() {
                            d.add(acc, (nb - j) as u32);
                        }
                    }
                }
            }
        }
        Order::SplitK {
            parts,
            inner,
            partial,
            combine,
        } => {
            let p = *parts;
            // The part results are values of the inner order's result format (the accumulator,
            // or a nested split's partial format); rounding them to `partial` is exact only
            // when that format is contained in it.
            let partial_rounds = !inner.result_format(acc).is_subset_of(*partial);
            for j in 0..p {
                let range = part_range(j, p, len);
                let chunk = &mut out[range];
                fill_depths(inner, chunk, acc, load_rounds);
                let combine_count = match combine {
                    Combine::Sequential => sequential_count(j, p, false),
                    Combine::Ring { start } => sequential_count((j + p - start) % p, p, false),
                    Combine::Tree => tree_depth(j, p),
                };
                for d in chunk.iter_mut() {
                    d.add(*partial, combine_count + u32::from(partial_rounds));
                }
            }
        }
    }
}

/// A value that enters a rounding: nothing (zero), one of the exact terms, or the rounded
/// result of an earlier part of the reduction (the exact sum of its terms, rounded to `format`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Operand {
    None,
    Term(usize),
    Value {
        first: Range<usize>,
        second: Range<usize>,
        format: Format,
    },
}

/// One rounding of a reduction: the format it rounds to, the terms whose exact sum is the
/// value being rounded (one contiguous range, or two when a ring combine wraps around), and
/// what is added: two operands, plus for a fused block the block's terms added exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RoundingSite {
    pub format: Format,
    pub first: Range<usize>,
    pub second: Range<usize>,
    pub ops: [Operand; 2],
    pub fused: Range<usize>,
}

/// Call `emit` for every rounding a reduction of `n` terms performs under `order` (as
/// [`reduce`] executes it). Kahan's order emits nothing (its error is not a tree of
/// roundings); callers treat it separately.
pub(crate) fn for_each_rounding(
    order: &Order,
    n: usize,
    acc: Format,
    load_rounds: bool,
    emit: &mut dyn FnMut(RoundingSite),
) {
    walk(order, 0..n, acc, load_rounds, emit);
}

fn value(r: Range<usize>, format: Format) -> Operand {
    Operand::Value {
        first: r,
        second: 0..0,
        format,
    }
}

fn ranges_of(op: &Operand) -> (Range<usize>, Range<usize>) {
    match op {
        Operand::None => (0..0, 0..0),
        Operand::Term(i) => (*i..*i + 1, 0..0),
        Operand::Value { first, second, .. } => (first.clone(), second.clone()),
    }
}

/// Emit the rounding of a + b to `format` and return its result.
fn add_site(a: Operand, b: Operand, format: Format, emit: &mut dyn FnMut(RoundingSite)) -> Operand {
    let (a1, a2) = ranges_of(&a);
    let (b1, _) = ranges_of(&b);
    // The union of the two operands' ranges, as at most two ranges.
    let (first, second) = if a2.is_empty() {
        if a1.is_empty() {
            (b1, 0..0)
        } else if b1.is_empty() {
            (a1, 0..0)
        } else if a1.end == b1.start {
            (a1.start..b1.end, 0..0)
        } else if b1.end == a1.start {
            (b1.start..a1.end, 0..0)
        } else {
            (a1, b1)
        }
    } else if a2.end == b1.start {
        (a1, a2.start..b1.end)
    } else {
        (a1, a2)
    };
    emit(RoundingSite {
        format,
        first: first.clone(),
        second: second.clone(),
        ops: [a, b],
        fused: 0..0,
    });
    Operand::Value {
        first,
        second,
        format,
    }
}

fn walk_sequential(
    r: Range<usize>,
    acc: Format,
    load_rounds: bool,
    emit: &mut dyn FnMut(RoundingSite),
) -> Operand {
    if r.is_empty() {
        return Operand::None;
    }
    let mut cur = if load_rounds {
        add_site(Operand::Term(r.start), Operand::None, acc, emit)
    } else {
        Operand::Term(r.start)
    };
    for j in r.start + 1..r.end {
        cur = add_site(cur, Operand::Term(j), acc, emit);
    }
    cur
}

fn walk(
    order: &Order,
    r: Range<usize>,
    acc: Format,
    load_rounds: bool,
    emit: &mut dyn FnMut(RoundingSite),
) -> Operand {
    match order {
        Order::Sequential => walk_sequential(r, acc, load_rounds, emit),
        Order::Kahan => value(r, acc),
        Order::Pairwise { base } => {
            let len = r.end - r.start;
            if len <= *base {
                walk_sequential(r, acc, load_rounds, emit)
            } else {
                let mid = r.start + len.div_ceil(2);
                let left = walk(order, r.start..mid, acc, load_rounds, emit);
                let right = walk(order, mid..r.end, acc, load_rounds, emit);
                add_site(left, right, acc, emit)
            }
        }
        Order::Blocked { block, inner } => {
            let mut total = Operand::None;
            let mut start = r.start;
            while start < r.end {
                let end = (start + block).min(r.end);
                match inner {
                    BlockSum::Sequential => {
                        let b = walk_sequential(start..end, acc, load_rounds, emit);
                        total = if total == Operand::None {
                            b
                        } else {
                            add_site(total, b, acc, emit)
                        };
                    }
                    BlockSum::Fused => {
                        let (t1, _) = ranges_of(&total);
                        let whole = if t1.is_empty() {
                            start..end
                        } else {
                            t1.start..end
                        };
                        emit(RoundingSite {
                            format: acc,
                            first: whole.clone(),
                            second: 0..0,
                            ops: [total, Operand::None],
                            fused: start..end,
                        });
                        total = value(whole, acc);
                    }
                }
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
            let p = *parts;
            let len = r.end - r.start;
            let results: Vec<Operand> = (0..p)
                .map(|j| {
                    let q = part_range(j, p, len);
                    let q = r.start + q.start..r.start + q.end;
                    let res = walk(inner, q, acc, load_rounds, emit);
                    if !inner.result_format(acc).is_subset_of(*partial) && res != Operand::None {
                        add_site(res, Operand::None, *partial, emit)
                    } else {
                        res
                    }
                })
                .collect();
            match combine {
                Combine::Sequential => {
                    let mut it = results.into_iter();
                    let mut cur = it.next().unwrap_or(Operand::None);
                    for res in it {
                        cur = add_site(cur, res, *partial, emit);
                    }
                    cur
                }
                Combine::Tree => walk_tree(results, *partial, emit),
                Combine::Ring { start } => {
                    let mut cur = results[*start].clone();
                    for k in 1..p {
                        cur = add_site(cur, results[(start + k) % p].clone(), *partial, emit);
                    }
                    cur
                }
            }
        }
    }
}

/// The pairwise tree (base 1) over the parts' results.
fn walk_tree(
    mut parts: Vec<Operand>,
    format: Format,
    emit: &mut dyn FnMut(RoundingSite),
) -> Operand {
    if parts.len() <= 1 {
        return parts.pop().unwrap_or(Operand::None);
    }
    let h = parts.len().div_ceil(2);
    let right = parts.split_off(h);
    let l = walk_tree(parts, format, emit);
    let r = walk_tree(right, format, emit);
    add_site(l, r, format, emit)
}

/// Number of additions above leaf `i` in the pairwise tree (base 1) over `len` leaves.
fn tree_depth(i: usize, len: usize) -> u32 {
    if len <= 1 {
        return 0;
    }
    let h = len.div_ceil(2);
    1 + if i < h {
        tree_depth(i, h)
    } else {
        tree_depth(i - h, len - h)
    }
}

/// Range of part `j` of `parts` over `len` terms: ⌊j·len/p⌋ .. ⌊(j+1)·len/p⌋.
fn part_range(j: usize, parts: usize, len: usize) -> Range<usize> {
    let start = (j as u128 * len as u128 / parts as u128) as usize;
    let end = ((j as u128 + 1) * len as u128 / parts as u128) as usize;
    start..end
}

/// An exact term: hi + lo, with lo = 0 unless a product of two `f64` values needs two parts.
#[derive(Debug, Clone, Copy)]
struct Term {
    hi: f64,
    lo: f64,
    /// When `lo` ≠ 0, the term is the exact product x·y of these factors.
    x: f64,
    y: f64,
}

/// Where the terms of a reduction come from.
trait Terms {
    fn term(&self, i: usize) -> Term;
    fn add_exact(&self, i: usize, acc: &mut ExactAccumulator);
}

struct SumTerms<'a>(&'a [f64]);

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
}

struct DotTerms<'a> {
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
}

/// The arithmetic context of one reduction level: accumulator format and overflow policy.
#[derive(Clone, Copy)]
struct Ctx {
    acc: Format,
    overflow: Overflow,
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

fn reduce<T: Terms>(terms: &T, range: Range<usize>, order: &Order, ctx: Ctx) -> f64 {
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
fn sequential<T: Terms>(terms: &T, range: Range<usize>, ctx: Ctx) -> f64 {
    if range.is_empty() {
        return 0.0;
    }
    let mut s = ctx.load(terms.term(range.start));
    for i in range.start + 1..range.end {
        s = ctx.add(s, terms.term(i));
    }
    s
}

fn pairwise<T: Terms>(terms: &T, range: Range<usize>, base: usize, ctx: Ctx) -> f64 {
    let len = range.end - range.start;
    if len <= base {
        return sequential(terms, range, ctx);
    }
    let mid = range.start + len.div_ceil(2);
    let left = pairwise(terms, range.start..mid, base, ctx);
    let right = pairwise(terms, mid..range.end, base, ctx);
    ctx.add2(left, right)
}

fn check_inputs(xs: &[f64], format: Format, name: &str) -> Result<()> {
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
pub(crate) fn dot_unchecked(x: &[f64], y: &[f64], policy: &Accumulation) -> f64 {
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
fn sequential_f32_sum(xs: &[f64]) -> f64 {
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
fn sequential_f32_dot(x: &[f64], y: &[f64]) -> f64 {
    if x.is_empty() {
        return 0.0;
    }
    let mut s = x[0] as f32 * y[0] as f32;
    for (&a, &b) in x[1..].iter().zip(&y[1..]) {
        s += a as f32 * b as f32;
    }
    s as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_ranges_cover_everything_once() {
        for len in 0..40 {
            for p in 1..9 {
                let mut next = 0;
                for j in 0..p {
                    let r = part_range(j, p, len);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    /// The rounding sites cover each term exactly as many times as its depth.
    #[test]
    fn rounding_sites_agree_with_depths() {
        let orders = [
            Order::Sequential,
            Order::Pairwise { base: 3 },
            Order::Blocked {
                block: 5,
                inner: BlockSum::Sequential,
            },
            Order::Blocked {
                block: 4,
                inner: BlockSum::Fused,
            },
            Order::SplitK {
                parts: 3,
                inner: Box::new(Order::Pairwise { base: 2 }),
                partial: Format::BF16,
                combine: Combine::Ring { start: 2 },
            },
            Order::SplitK {
                parts: 4,
                inner: Box::new(Order::Sequential),
                partial: Format::F32,
                combine: Combine::Tree,
            },
            Order::SplitK {
                parts: 5,
                inner: Box::new(Order::Blocked {
                    block: 3,
                    inner: BlockSum::Fused,
                }),
                partial: Format::F16,
                combine: Combine::Sequential,
            },
        ];
        for order in orders {
            for n in 0..30 {
                for input in [Format::F32, Format::F64] {
                    let p = Accumulation::new(input, Format::F32, order.clone());
                    let depths = p.sum_depths(n).unwrap();
                    let mut counts = vec![[0u32; 7]; n];
                    for_each_rounding(
                        &order,
                        n,
                        Format::F32,
                        !input.is_subset_of(Format::F32),
                        &mut |s| {
                            for i in s.first.clone().chain(s.second.clone()) {
                                counts[i][s.format.index()] += 1;
                            }
                        },
                    );
                    for i in 0..n {
                        for f in Format::ALL {
                            assert_eq!(
                                counts[i][f.index()],
                                depths[i].count(f),
                                "{order:?} n={n} term {i} {f}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn tree_depth_is_ceil_log2_for_powers_of_two() {
        for k in 0..6 {
            let n = 1usize << k;
            for i in 0..n {
                assert_eq!(tree_depth(i, n), k as u32);
            }
        }
    }

    #[test]
    fn sequential_depths_match_higham() {
        let p = Accumulation::new(Format::F32, Format::F32, Order::Sequential);
        let d: Vec<u32> = p.sum_depths(5).unwrap().iter().map(|d| d.total()).collect();
        assert_eq!(d, vec![4, 4, 3, 2, 1]);
    }

    #[test]
    fn invalid_parameters_are_errors() {
        let p = Accumulation::new(Format::F32, Format::F32, Order::Pairwise { base: 0 });
        assert!(matches!(
            sum(&[1.0], &p),
            Err(Error::InvalidParameter { name: "base", .. })
        ));
        let p = Accumulation::new(
            Format::F32,
            Format::F32,
            Order::SplitK {
                parts: 2,
                inner: Box::new(Order::Sequential),
                partial: Format::F32,
                combine: Combine::Ring { start: 2 },
            },
        );
        assert!(matches!(
            sum(&[1.0], &p),
            Err(Error::InvalidParameter { name: "start", .. })
        ));
        let p = Accumulation::new(Format::F32, Format::F32, Order::Sequential);
        assert!(matches!(
            p.sum_depths(usize::MAX),
            Err(Error::InvalidParameter { name: "n", .. })
        ));
    }
}
