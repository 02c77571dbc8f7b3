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

mod depth;
mod exec;

pub use depth::TermDepth;
pub(crate) use depth::*;
pub(crate) use exec::*;
pub use exec::{dot, sum};

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
