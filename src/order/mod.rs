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
pub(crate) mod exec;
mod tensorcore;

pub use depth::TermDepth;
pub(crate) use depth::*;
pub(crate) use exec::*;
pub use exec::{dot, sum};
pub(crate) use tensorcore::{product_exponent, truncate_to, value_exponent};
pub use tensorcore::{AccRounding, TensorCoreSum};

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
    /// A hardware matrix unit's accumulation ([`TensorCoreSum`]): block FMAs aligned to the
    /// block's largest exponent and cut to a fixed number of bits, an internal accumulator
    /// narrower than FP32, promoted into the accumulator format every P terms. Inputs must
    /// have at most 26 significant bits (their products exact in `f64`).
    TensorCore(TensorCoreSum),
    /// Some order of this family, which one unknown (a vendor kernel that picks its blocking
    /// and split by shape): priced to hold for every member — guaranteed bounds are the
    /// largest over the members, probabilistic ones cover each member's deterministic part
    /// and the largest variance — and executed as the first member. At least one member; no
    /// member is itself a family.
    AnyOf(Vec<Order>),
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
    /// the widest of the members' for a family, the accumulator otherwise.
    pub fn result_format(&self, accumulator: Format) -> Format {
        match self {
            Order::SplitK { partial, .. } => *partial,
            Order::AnyOf(members) => members
                .iter()
                .map(|m| m.result_format(accumulator))
                .max_by_key(|f| f.precision())
                .unwrap_or(accumulator),
            _ => accumulator,
        }
    }

    /// The family of orders a vendor kernel of unknown blocking may run, its partial results
    /// in `partial` (the accumulator format): one sequential chain of fused multiply-adds
    /// (cuBLAS's per-thread K loop), a full binary tree, NumPy's pairwise order, blocks of
    /// 32, and split-K / per-thread partial sums combined sequentially or by a tree over
    /// 2, 4, 8, 32 and 256 parts (split-K GEMMs, warp and block reductions). The text `any`
    /// (or `any:FMT`) names it.
    ///
    /// # Examples
    ///
    /// ```
    /// use ttrace::{Format, Order};
    /// let any = Order::unknown_kernel(Format::F32);
    /// assert_eq!("any".parse::<Order>()?, any);
    /// assert_eq!(any.to_string().parse::<Order>()?, any);
    /// # Ok::<(), ttrace::Error>(())
    /// ```
    pub fn unknown_kernel(partial: Format) -> Order {
        let split = |parts: usize, combine: Combine| Order::SplitK {
            parts,
            inner: Box::new(Order::Sequential),
            partial,
            combine,
        };
        Order::AnyOf(vec![
            Order::Sequential,
            Order::Pairwise { base: 1 },
            Order::Pairwise { base: 8 },
            Order::blocked(32),
            split(2, Combine::Sequential),
            split(4, Combine::Tree),
            split(8, Combine::Tree),
            split(32, Combine::Tree),
            split(256, Combine::Tree),
        ])
    }

    /// What cuBLAS may run for an FP8 GEMM on Hopper (`torch._scaled_mm`), a family: the
    /// tensor cores of [`TensorCoreSum::hopper_fp8_fast`] (`fast`, `use_fast_accum=True`) or
    /// [`TensorCoreSum::hopper_fp8`] (promoted every 128 terms) over the whole of K, or K split
    /// into 2, 3, 4, 6, 8, 16 or 32 parts whose results are added in FP32 — cuBLAS splits K
    /// for some shapes (on an H100, fast-accumulation GEMMs of K ≥ 8192 with few output
    /// tiles), and which split it picks is not visible from outside. The texts
    /// `hopper-fp8-fast` and `hopper-fp8` name these; `tc:…` one configuration.
    ///
    /// # Examples
    ///
    /// ```
    /// use ttrace::Order;
    /// let family: Order = "hopper-fp8-fast".parse()?;
    /// assert_eq!(family, Order::hopper_fp8_gemm(true));
    /// assert!(family.to_string().starts_with("any(tc:32:13:14:rz|splitk:2:f32:seq:inner=tc:32:13:14:rz|"));
    /// # Ok::<(), ttrace::Error>(())
    /// ```
    pub fn hopper_fp8_gemm(fast: bool) -> Order {
        let tc = Order::TensorCore(if fast {
            TensorCoreSum::hopper_fp8_fast()
        } else {
            TensorCoreSum::hopper_fp8()
        });
        let mut members = vec![tc.clone()];
        for parts in [2, 3, 4, 6, 8, 16, 32] {
            members.push(Order::SplitK {
                parts,
                inner: Box::new(tc.clone()),
                partial: Format::F32,
                combine: Combine::Sequential,
            });
        }
        Order::AnyOf(members)
    }

    /// Whether a tensor-core accumulation occurs anywhere in this order (its error is then
    /// priced from the data, not from per-term depths).
    pub fn has_tensor_core(&self) -> bool {
        match self {
            Order::TensorCore(_) => true,
            Order::SplitK { inner, .. } => inner.has_tensor_core(),
            Order::AnyOf(m) => m.iter().any(Order::has_tensor_core),
            _ => false,
        }
    }

    /// The orders this one may run: itself when it holds no family, else one order per
    /// member — a family's members, and for a split-K over a family the split-K over each
    /// member. A threshold for a family holds whichever member runs.
    ///
    /// # Examples
    ///
    /// ```
    /// use ttrace::{Format, Order};
    /// let split: Order = "splitk:4:f32:tree:inner=any(sequential|pairwise:8)".parse()?;
    /// let members = split.members();
    /// assert_eq!(members.len(), 2);
    /// assert_eq!(members[1], "splitk:4:f32:tree:inner=pairwise:8".parse()?);
    /// assert_eq!(Order::Sequential.members(), vec![Order::Sequential]);
    /// assert_eq!(Order::unknown_kernel(Format::F32).members().len(), 9);
    /// # Ok::<(), ttrace::Error>(())
    /// ```
    pub fn members(&self) -> Vec<Order> {
        match self {
            Order::AnyOf(m) => m.iter().flat_map(Order::members).collect(),
            Order::SplitK {
                parts,
                inner,
                partial,
                combine,
            } if inner.has_family() => inner
                .members()
                .into_iter()
                .map(|m| Order::SplitK {
                    parts: *parts,
                    inner: Box::new(m),
                    partial: *partial,
                    combine: *combine,
                })
                .collect(),
            _ => vec![self.clone()],
        }
    }

    /// Whether a family of orders ([`Order::AnyOf`]) occurs anywhere in this order.
    pub fn has_family(&self) -> bool {
        match self {
            Order::AnyOf(_) => true,
            Order::SplitK { inner, .. } => inner.has_family(),
            _ => false,
        }
    }
}

/// The text form read by [`Order::from_str`](std::str::FromStr::from_str): `sequential`,
/// `pairwise:B`, `blocked:B`, `blockfma:B`, `kahan`, `splitk:P:FMT:COMBINE` with COMBINE
/// `seq`, `tree` or `ring:START`, followed by `:inner=ORDER` when the parts are not summed
/// sequentially, `tc:BLOCK:ALIGN:ACC_BITS:rz|rn[:promote=P]` for a tensor core
/// ([`TensorCoreSum`]), `hopper-fp8` and `hopper-fp8-fast` for what cuBLAS runs
/// ([`Order::hopper_fp8_gemm`]), and `any(ORDER|ORDER|…)`
/// for an order of unknown kernel ([`Order::AnyOf`]; `any` or `any:FMT` for
/// [`Order::unknown_kernel`]). Parsing the text gives the order back.
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
            Order::TensorCore(tc) => tc.write(f),
            Order::AnyOf(members) => {
                f.write_str("any(")?;
                for (i, m) in members.iter().enumerate() {
                    if i > 0 {
                        f.write_str("|")?;
                    }
                    write!(f, "{m}")?;
                }
                f.write_str(")")
            }
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
                 splitk:P:FMT:seq|tree|ring:START[:inner=ORDER], \
                 tc:BLOCK:ALIGN:ACC_BITS:rz|rn[:promote=P], hopper-fp8[-fast], any, \
                 any(ORDER|ORDER|...))"
            ),
        };
        let s = s.trim();
        if let Some(list) = s.strip_prefix("any(") {
            let list = list
                .strip_suffix(')')
                .ok_or_else(|| bad("a family 'any(' must end with ')'".into()))?;
            let members = split_members(list)
                .into_iter()
                .map(str::parse::<Order>)
                .collect::<Result<Vec<Order>>>()?;
            let order = Order::AnyOf(members);
            validate_order(&order)?;
            return Ok(order);
        }
        if s == "any" {
            return Ok(Order::unknown_kernel(Format::F32));
        }
        match s {
            "hopper-fp8" => return Ok(Order::hopper_fp8_gemm(false)),
            "hopper-fp8-fast" => return Ok(Order::hopper_fp8_gemm(true)),
            _ => {}
        }
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
            "tc" => Order::TensorCore(TensorCoreSum::parse_fields(rest).map_err(bad)?),
            "any" => Order::unknown_kernel(rest.parse::<Format>()?),
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

    /// Check the order's parameters (block sizes and part counts ≥ 1, ring start < parts, a
    /// tensor core's ranges) and that a tensor-core order gets inputs of at most 26
    /// significant bits (so that its products are exact in `f64`).
    pub fn validate(&self) -> Result<()> {
        validate_order(&self.order)?;
        if self.order.has_tensor_core() && self.input.precision() > 26 {
            return Err(Error::InvalidParameter {
                name: "order",
                reason: format!(
                    "a tensor-core accumulation takes inputs of at most 26 significant bits \
                     (got {})",
                    self.input
                ),
            });
        }
        Ok(())
    }

    /// For a sum of `n` terms: how many roundings each term undergoes, per format.
    /// Errors: invalid order parameters, or n above `MAX_DEPTH_TERMS`.
    pub fn sum_depths(&self, n: usize) -> Result<Vec<TermDepth>> {
        self.validate()?;
        check_depth_len(n)?;
        refuse_tensor_core(&self.order)?;
        let load_rounds = !self.input.is_subset_of(self.accumulator);
        Ok(order_depths(&self.order, n, self.accumulator, load_rounds))
    }

    /// For a dot product of length `n`: how many roundings each product term undergoes, per
    /// format (a rounded product counts one rounding in its product format).
    /// Errors as for [`sum_depths`](Self::sum_depths).
    pub fn dot_depths(&self, n: usize) -> Result<Vec<TermDepth>> {
        self.validate()?;
        check_depth_len(n)?;
        refuse_tensor_core(&self.order)?;
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

/// A tensor core's error is not a count of roundings relative to each term (its truncation
/// is relative to the block's largest addend): depth-based bounds refuse it.
fn refuse_tensor_core(order: &Order) -> Result<()> {
    if order.has_tensor_core() {
        return Err(Error::InvalidParameter {
            name: "order",
            reason: format!(
                "'{order}': a tensor-core accumulation has no per-term rounding depths; it is \
                 priced from the data (bounds::reduction_error, matmul_threshold)"
            ),
        });
    }
    Ok(())
}

/// Split a family's member list at the `|` that are not inside a nested `any(…)`.
fn split_members(list: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0usize, 0usize, vec![]);
    for (i, ch) in list.char_indices() {
        match ch {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            '|' if depth == 0 => {
                out.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&list[start..]);
    out
}

fn validate_order(order: &Order) -> Result<()> {
    match order {
        Order::Sequential | Order::Kahan => Ok(()),
        Order::TensorCore(tc) => tc.validate(),
        Order::AnyOf(members) => {
            if members.is_empty() {
                return Err(Error::InvalidParameter {
                    name: "order",
                    reason: "a family of orders needs at least one member".into(),
                });
            }
            for m in members {
                if matches!(m, Order::AnyOf(_)) {
                    return Err(Error::InvalidParameter {
                        name: "order",
                        reason: "a family of orders cannot hold another family".into(),
                    });
                }
                validate_order(m)?;
            }
            Ok(())
        }
        Order::Pairwise { base } => positive("base", *base),
        Order::Blocked { block, .. } => positive("block", *block),
        Order::SplitK {
            parts,
            inner,
            combine,
            ..
        } => {
            positive("parts", *parts)?;
            let most = crate::limits::SPLIT_PARTS;
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
