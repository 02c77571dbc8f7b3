//! How many roundings each term of a reduction undergoes in an order ([`TermDepth`]), and
//! every rounding site of an order with the ranges it adds (what the bounds walk).

use super::*;

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

    pub(crate) fn add(&mut self, format: Format, k: u32) {
        self.counts[format.index()] += k;
    }

    /// Each format's count raised to `other`'s where that is larger.
    pub(crate) fn max_with(&mut self, other: &TermDepth) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a = (*a).max(b);
        }
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

pub(crate) fn check_depth_len(n: usize) -> Result<()> {
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

pub(crate) fn order_depths(
    order: &Order,
    n: usize,
    acc: Format,
    load_rounds: bool,
) -> Vec<TermDepth> {
    let mut out = vec![TermDepth::default(); n];
    fill_depths(order, &mut out, acc, load_rounds);
    out
}

/// Depths of a sequential sum of `len` terms, in rounding counts (see [`Order::Sequential`]).
pub(crate) fn sequential_count(i: usize, len: usize, load_rounds: bool) -> u32 {
    let adds = if i == 0 {
        len.saturating_sub(1)
    } else {
        len - i
    } as u32;
    adds + u32::from(i == 0 && load_rounds)
}

pub(crate) fn fill_depths(order: &Order, out: &mut [TermDepth], acc: Format, load_rounds: bool) {
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
        // Not a tree of roundings: `Accumulation::sum_depths` refuses it before this point;
        // one rounding per block step is what remains of it here.
        Order::TensorCore(tc) => {
            let nb = len.div_ceil(tc.block);
            for (j, chunk) in out.chunks_mut(tc.block).enumerate() {
                for d in chunk.iter_mut() {
                    d.add(acc, (nb - j) as u32);
                }
            }
        }
        Order::AnyOf(members) => {
            // Every term at the largest count of each format over the members: a bound on
            // Π(1 + u_f)^count for every member.
            let mut best = vec![TermDepth::default(); len];
            for m in members {
                let mut d = vec![TermDepth::default(); len];
                fill_depths(m, &mut d, acc, load_rounds);
                for (b, x) in best.iter_mut().zip(&d) {
                    b.max_with(x);
                }
            }
            for (o, b) in out.iter_mut().zip(&best) {
                for f in Format::ALL {
                    o.add(f, b.count(f));
                }
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

pub(crate) fn value(r: Range<usize>, format: Format) -> Operand {
    Operand::Value {
        first: r,
        second: 0..0,
        format,
    }
}

pub(crate) fn ranges_of(op: &Operand) -> (Range<usize>, Range<usize>) {
    match op {
        Operand::None => (0..0, 0..0),
        Operand::Term(i) => (*i..*i + 1, 0..0),
        Operand::Value { first, second, .. } => (first.clone(), second.clone()),
    }
}

/// Emit the rounding of a + b to `format` and return its result.
pub(crate) fn add_site(
    a: Operand,
    b: Operand,
    format: Format,
    emit: &mut dyn FnMut(RoundingSite),
) -> Operand {
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

pub(crate) fn walk_sequential(
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

pub(crate) fn walk(
    order: &Order,
    r: Range<usize>,
    acc: Format,
    load_rounds: bool,
    emit: &mut dyn FnMut(RoundingSite),
) -> Operand {
    match order {
        Order::Sequential => walk_sequential(r, acc, load_rounds, emit),
        // Priced by their own analyses (`bounds::reduction`): no sites of their own here.
        Order::Kahan | Order::TensorCore(_) => value(r, acc),
        Order::AnyOf(members) => match members.first() {
            Some(first) => walk(first, r, acc, load_rounds, emit),
            None => value(r, acc),
        },
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
pub(crate) fn walk_tree(
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
pub(crate) fn tree_depth(i: usize, len: usize) -> u32 {
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
