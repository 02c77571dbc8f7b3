//! Collectives emulated with an explicit order and reduction format.
//!
//! Every addition of a reduction is rounded to the reduction format `R` (round to nearest,
//! ties to even), which is what NCCL does for a tensor of dtype `R`. Orders:
//! * **ring** — the flat tensor is cut into `p` contiguous chunks (of ⌈n/p⌉ elements; the last
//!   ones may be shorter or empty); chunk `c` is accumulated along the ring starting at rank
//!   (c + 1) mod p and ending at its owner, rank c: s = x₍c₊₁₎; s = fl(s + x₍c₊₂₎); …;
//!   s = fl(s + x_c) — the order [`Combine::ring_for_chunk`] describes, so the bounds price
//!   exactly what runs here. The all-gather phase copies, so every rank ends with identical
//!   values.
//! * **tree** — a balanced binary tree over the ranks in index order (recursive halving):
//!   ((x₀ + x₁) + (x₂ + x₃)) for p = 4; [`Combine::Tree`].
//!
//! Reduce-scatter along a dimension gives rank r the r-th contiguous slice of that dimension,
//! accumulated in rank r's ring order. All-gather concatenates exactly.

use serde::{Deserialize, Serialize};

use ttrace::trace::merge;
use ttrace::trace::{Axis, Layout, Mesh, Placement};
use ttrace::Combine;
use ttrace::Tensor;
use ttrace::{Error, Result};
use ttrace::{Format, Overflow};

/// The algorithm of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Ring reduce-scatter + all-gather, chunk c accumulated from rank c + 1.
    #[default]
    Ring,
    /// Balanced binary tree over the ranks in index order.
    Tree,
}

impl Algorithm {
    /// The combine order of one chunk of `parts` ranks.
    pub fn combine(self, chunk: usize, parts: usize) -> Result<Combine> {
        match self {
            Algorithm::Ring => Combine::ring_for_chunk(chunk, parts),
            Algorithm::Tree => Ok(Combine::Tree),
        }
    }
}

/// Sum `values` (one per rank) in the order of `combine`, every addition rounded to `r`.
pub fn combine_values(values: &[f64], combine: &Combine, r: Format) -> f64 {
    let rd = |x: f64| r.round(x, Overflow::NonSaturating);
    match combine {
        Combine::Sequential => fold(values.iter().copied(), rd),
        Combine::Ring { start } => {
            let p = values.len();
            fold((0..p).map(|i| values[(start + i) % p.max(1)]), rd)
        }
        Combine::Tree => tree(values, &rd),
    }
}

fn fold(mut it: impl Iterator<Item = f64>, rd: impl Fn(f64) -> f64) -> f64 {
    let Some(first) = it.next() else { return 0.0 };
    it.fold(rd(first), |s, x| rd(s + x))
}

fn tree(values: &[f64], rd: &impl Fn(f64) -> f64) -> f64 {
    match values.len() {
        0 => 0.0,
        1 => rd(values[0]),
        n => {
            let h = n.div_ceil(2);
            rd(tree(&values[..h], rd) + tree(&values[h..], rd))
        }
    }
}

fn check_same(inputs: &[Tensor], what: &str) -> Result<()> {
    let Some(first) = inputs.first() else {
        return Err(Error::InvalidParameter {
            name: "inputs",
            reason: format!("{what} needs at least one rank's tensor"),
        });
    };
    for (r, t) in inputs.iter().enumerate() {
        if t.shape() != first.shape() {
            return Err(Error::ShapeMismatch {
                what: format!("{what}: rank {r}'s tensor differs in shape from rank 0's"),
                expected: first.shape().to_vec(),
                found: t.shape().to_vec(),
            });
        }
    }
    Ok(())
}

/// All-reduce (sum) of one tensor per rank, in reduction format `r`. Returns the reduced tensor
/// (identical on every rank), in format `r`.
pub fn all_reduce(inputs: &[Tensor], algorithm: Algorithm, r: Format) -> Result<Tensor> {
    check_same(inputs, "all-reduce")?;
    let p = inputs.len();
    let n = inputs[0].len();
    let chunk = n.div_ceil(p).max(1);
    let mut out = vec![0.0; n];
    let mut vals = vec![0.0; p];
    for c in 0..p {
        let combine = algorithm.combine(c, p)?;
        for (i, o) in out
            .iter_mut()
            .enumerate()
            .take(((c + 1) * chunk).min(n))
            .skip(c * chunk)
        {
            for (v, t) in vals.iter_mut().zip(inputs) {
                *v = t.values()[i];
            }
            *o = combine_values(&vals, &combine, r);
        }
    }
    Ok(Tensor::from_parts_unchecked(inputs[0].shape(), out, r))
}

/// All-reduce (max) of one tensor per rank: exact.
pub fn all_reduce_max(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

/// Reduce-scatter along `dim` in ring order, reduction format `r`: rank i receives slice i of
/// `dim` (contiguous, `dim` must divide by the number of ranks), each element accumulated
/// starting at rank (i + 1) mod p.
pub fn reduce_scatter(inputs: &[Tensor], dim: usize, r: Format) -> Result<Vec<Tensor>> {
    check_same(inputs, "reduce-scatter")?;
    let p = inputs.len();
    let mesh = Mesh::new([(Axis::TP, p)])?;
    let layout = Layout::replicated().with(Axis::TP, Placement::split(dim));
    // Each rank's tensor cut into the p slices.
    let cuts: Vec<Vec<Tensor>> = inputs
        .iter()
        .map(|t| ttrace::trace::shard(t, &layout, &mesh, "reduce-scatter input"))
        .collect::<Result<_>>()?;
    let mut out = Vec::with_capacity(p);
    let mut vals = vec![0.0; p];
    for i in 0..p {
        let combine = Combine::ring_for_chunk(i, p)?;
        let len = cuts[0][i].len();
        let mut o = Vec::with_capacity(len);
        for e in 0..len {
            for (v, c) in vals.iter_mut().zip(&cuts) {
                *v = c[i].values()[e];
            }
            o.push(combine_values(&vals, &combine, r));
        }
        out.push(Tensor::from_parts_unchecked(cuts[0][i].shape(), o, r));
    }
    Ok(out)
}

/// All-gather along `dim`: the ranks' tensors concatenated in rank order (exact).
pub fn all_gather(inputs: &[Tensor], dim: usize, what: &str) -> Result<Tensor> {
    check_same(inputs, "all-gather")?;
    let mesh = Mesh::new([(Axis::TP, inputs.len())])?;
    let layout = Layout::replicated().with(Axis::TP, Placement::split(dim));
    merge(inputs, &layout, &mesh, what, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ttrace::{sum, Accumulation, Order};

    #[test]
    fn ring_chunk_order_matches_split_k_ring_of_the_bounds() {
        // Four BF16 partials whose order matters in BF16.
        let vals = [1.0, 2f64.powi(-9), 2f64.powi(-9), -1.0];
        for c in 0..4 {
            let combine = Combine::ring_for_chunk(c, 4).unwrap();
            let ours = combine_values(&vals, &combine, Format::BF16);
            let acc = Accumulation::new(
                Format::BF16,
                Format::BF16,
                Order::SplitK {
                    parts: 4,
                    inner: Box::new(Order::Sequential),
                    partial: Format::BF16,
                    combine,
                },
            );
            assert_eq!(ours, sum(&vals, &acc).unwrap(), "chunk {c}");
        }
    }

    #[test]
    fn tree_is_pairwise() {
        let vals = [1.0, 2f64.powi(-9), 2f64.powi(-9), -1.0];
        // (1 + 2^-9) rounds to 1 in BF16 (tie to even), (2^-9 − 1) is exact: sum 2^-9 − ... .
        let t = combine_values(&vals, &Combine::Tree, Format::BF16);
        let expect = Format::BF16.round(
            Format::BF16.round(1.0 + 2f64.powi(-9), Overflow::NonSaturating)
                + Format::BF16.round(2f64.powi(-9) - 1.0, Overflow::NonSaturating),
            Overflow::NonSaturating,
        );
        assert_eq!(t, expect);
    }
}
