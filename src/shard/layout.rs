//! Device mesh, per-tensor layouts, sharding and the canonical merge.
//!
//! A [`Mesh`] has three axes, outermost first: data parallel (`dp`), context parallel (`cp`)
//! and tensor parallel (`tp`, with sequence parallelism on or off). Global rank
//! `r = (d·cp + c)·tp + t` for coordinates (d, c, t), so TP groups are contiguous ranks, as in
//! Megatron-LM's default order.
//!
//! A [`Layout`] gives one [`Placement`] per axis. Sharding applies the axes outermost first
//! (DP, then CP, then TP, each splitting what the outer axis left); merging undoes them
//! innermost first. Placements:
//! * `Replicate` — every rank of the axis holds the same tensor. Merging checks that the copies
//!   agree **bit for bit** and returns [`Error::ReplicaMismatch`] otherwise: a disagreement
//!   means a missing synchronization or a wrong layout, never something to average away.
//! * `Split { dim, groups }` — the dimension is viewed as `[groups, parts, len]` and rank i of
//!   the axis holds `[:, i, :]`. `groups = 1` is a contiguous split; `groups = 3` is the
//!   column-parallel QKV projection, whose output columns are `[Q | K | V]` with each part's
//!   heads taken from all three.
//! * `CpChunks { dim }` — Megatron's load-balanced context-parallel order for causal attention:
//!   the dimension is cut into 2·cp chunks and rank i holds chunks i and 2·cp − 1 − i, in that
//!   order.
//! * `Partial` — the logical tensor is the sum of the ranks' tensors. Merging sums exactly (long
//!   accumulator) and rounds once to the tensor's format.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::engine::tensor::Tensor;
use crate::error::{Error, Result};
use crate::exact::ExactAccumulator;
use crate::format::Overflow;

/// A device mesh: data-, context- and tensor-parallel sizes, and whether sequence parallelism
/// splits the non-tensor-parallel regions along the sequence across the TP group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mesh {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Context-parallel size.
    pub cp: usize,
    /// Data-parallel size.
    pub dp: usize,
    /// Sequence parallelism (only meaningful with `tp > 1`).
    pub sp: bool,
}

/// A rank's coordinates on the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Coords {
    /// Data-parallel index.
    pub dp: usize,
    /// Context-parallel index.
    pub cp: usize,
    /// Tensor-parallel index.
    pub tp: usize,
}

/// One axis of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Axis {
    /// Data parallel.
    Dp,
    /// Context parallel.
    Cp,
    /// Tensor parallel.
    Tp,
}

impl Axis {
    /// "dp", "cp" or "tp".
    pub fn name(self) -> &'static str {
        match self {
            Axis::Dp => "dp",
            Axis::Cp => "cp",
            Axis::Tp => "tp",
        }
    }
}

/// The largest mesh accepted (2^20 ranks): far beyond any training run, small enough that
/// rank arithmetic cannot overflow.
pub const MAX_WORLD: usize = crate::io::guard::limits::RANKS;

impl Mesh {
    /// A mesh, checking that every size is at least 1 and the world at most [`MAX_WORLD`].
    pub fn new(tp: usize, cp: usize, dp: usize, sp: bool) -> Result<Mesh> {
        for (name, v) in [("tp", tp), ("cp", cp), ("dp", dp)] {
            if v == 0 {
                return Err(Error::InvalidParameter {
                    name,
                    reason: "a mesh axis must have at least one rank (got 0)".into(),
                });
            }
        }
        match tp.checked_mul(cp).and_then(|x| x.checked_mul(dp)) {
            Some(world) if world <= MAX_WORLD => Ok(Mesh { tp, cp, dp, sp }),
            _ => Err(Error::InvalidParameter {
                name: "mesh",
                reason: format!(
                    "tp × cp × dp = {tp} × {cp} × {dp} ranks exceeds {MAX_WORLD} (a corrupted manifest?)"
                ),
            }),
        }
    }

    /// The single-device mesh.
    pub fn single() -> Mesh {
        Mesh {
            tp: 1,
            cp: 1,
            dp: 1,
            sp: false,
        }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.tp * self.cp * self.dp
    }

    /// Size of an axis.
    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Dp => self.dp,
            Axis::Cp => self.cp,
            Axis::Tp => self.tp,
        }
    }

    /// Global rank of coordinates.
    pub fn rank(&self, c: Coords) -> usize {
        (c.dp * self.cp + c.cp) * self.tp + c.tp
    }

    /// Coordinates of a global rank (`rank < world`).
    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            dp: rank / (self.tp * self.cp),
            cp: (rank / self.tp) % self.cp,
            tp: rank % self.tp,
        }
    }

    /// Whether sequence parallelism is in effect (SP with more than one TP rank).
    pub fn sequence_parallel(&self) -> bool {
        self.sp && self.tp > 1
    }

    /// Short label such as `tp4-sp-cp2-dp2`.
    pub fn label(&self) -> String {
        format!(
            "tp{}{}-cp{}-dp{}",
            self.tp,
            if self.sp { "-sp" } else { "" },
            self.cp,
            self.dp
        )
    }
}

/// How a tensor is laid out along one mesh axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Placement {
    /// Every rank of the axis holds the whole tensor; copies must agree bit for bit.
    Replicate,
    /// Split along `dim`, viewed as `[groups, parts, len]`; rank i holds `[:, i, :]`.
    Split {
        /// The dimension.
        dim: usize,
        /// Interleaved groups (1 = contiguous).
        groups: usize,
    },
    /// Context-parallel load-balanced chunks along `dim`: rank i holds chunks i and
    /// 2·parts − 1 − i of 2·parts.
    CpChunks {
        /// The dimension.
        dim: usize,
    },
    /// The logical tensor is the sum over the axis.
    Partial,
}

impl Placement {
    /// A contiguous split along `dim`.
    pub fn split(dim: usize) -> Placement {
        Placement::Split { dim, groups: 1 }
    }
}

/// A tensor's placement along each mesh axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// Along the data-parallel axis.
    pub dp: Placement,
    /// Along the context-parallel axis.
    pub cp: Placement,
    /// Along the tensor-parallel axis.
    pub tp: Placement,
}

impl Layout {
    /// Replicated on every rank.
    pub fn replicated() -> Layout {
        Layout {
            dp: Placement::Replicate,
            cp: Placement::Replicate,
            tp: Placement::Replicate,
        }
    }

    /// The placement along an axis.
    pub fn along(&self, axis: Axis) -> Placement {
        match axis {
            Axis::Dp => self.dp,
            Axis::Cp => self.cp,
            Axis::Tp => self.tp,
        }
    }
}

fn layout_err(id: &str, reason: String) -> Error {
    Error::Layout {
        id: id.to_string(),
        reason,
    }
}

/// For a split into `parts` along a dimension of size `n` (viewed as `[outer, n, inner]`
/// elements), the flat source ranges of part `i`: a list of (start along the dim, length).
fn part_ranges(
    p: Placement,
    n: usize,
    parts: usize,
    i: usize,
    id: &str,
) -> Result<Vec<(usize, usize)>> {
    match p {
        Placement::Split { groups, .. } => {
            let Some(whole) = groups.checked_mul(parts).filter(|&w| w > 0) else {
                return Err(Error::InvalidParameter {
                    name: "groups",
                    reason: format!(
                        "{groups} group(s) × {parts} parts is not a usable split of a \
                         dimension of size {n}"
                    ),
                });
            };
            if n % whole != 0 {
                return Err(layout_err(
                    id,
                    format!(
                        "a dimension of size {n} cannot be split into {groups} group(s) of \
                         {parts} parts"
                    ),
                ));
            }
            let len = n / whole;
            Ok((0..groups).map(|g| ((g * parts + i) * len, len)).collect())
        }
        Placement::CpChunks { .. } => {
            if n % (2 * parts) != 0 {
                return Err(layout_err(
                    id,
                    format!(
                        "a dimension of size {n} cannot be cut into 2·{parts} load-balanced chunks"
                    ),
                ));
            }
            let c = n / (2 * parts);
            Ok(vec![(i * c, c), ((2 * parts - 1 - i) * c, c)])
        }
        _ => Ok(vec![(0, n)]),
    }
}

fn dim_of(p: Placement) -> Option<usize> {
    match p {
        Placement::Split { dim, .. } | Placement::CpChunks { dim } => Some(dim),
        _ => None,
    }
}

/// (outer, n, inner) of a shape around `dim`.
fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

fn check_dim(p: Placement, shape: &[usize], id: &str) -> Result<()> {
    if let Some(d) = dim_of(p) {
        if d >= shape.len() {
            return Err(layout_err(
                id,
                format!("placement {p:?} names dimension {d}, but the tensor has shape {shape:?}"),
            ));
        }
    }
    Ok(())
}

/// Cut `t` into the `parts` pieces of one axis.
fn cut(t: &Tensor, p: Placement, parts: usize, id: &str) -> Result<Vec<Tensor>> {
    check_dim(p, t.shape(), id)?;
    match p {
        Placement::Replicate => Ok(vec![t.clone(); parts]),
        Placement::Partial => {
            // Rank 0 holds the value, the others zeros: an exact decomposition.
            let mut out = vec![t.clone()];
            out.extend((1..parts).map(|_| Tensor::zeros(t.shape(), t.format())));
            Ok(out)
        }
        Placement::Split { dim, .. } | Placement::CpChunks { dim } => {
            let (outer, n, inner) = around(t.shape(), dim);
            let v = t.values();
            (0..parts)
                .map(|i| {
                    let ranges = part_ranges(p, n, parts, i, id)?;
                    let local: usize = ranges.iter().map(|r| r.1).sum();
                    let mut out = Vec::with_capacity(outer * local * inner);
                    for o in 0..outer {
                        for &(start, len) in &ranges {
                            let base = (o * n + start) * inner;
                            out.extend_from_slice(&v[base..base + len * inner]);
                        }
                    }
                    let mut shape = t.shape().to_vec();
                    shape[dim] = local;
                    Ok(Tensor::from_parts_unchecked(&shape, out, t.format()))
                })
                .collect()
        }
    }
}

/// Join the `pieces` of one axis (in axis order) back into one tensor.
fn join(
    mut pieces: Vec<Cow<'_, Tensor>>,
    p: Placement,
    id: &str,
    axis: Axis,
    ranks: &[usize],
    spare: &mut Vec<Vec<f64>>,
) -> Result<Tensor> {
    let first: &Tensor = &pieces[0];
    for (k, t) in pieces.iter().enumerate() {
        if t.shape() != first.shape() {
            return Err(layout_err(
                id,
                format!(
                    "shards along {} have different shapes: rank {} has {:?}, rank {} has {:?}",
                    axis.name(),
                    ranks[0],
                    first.shape(),
                    ranks[k],
                    t.shape()
                ),
            ));
        }
        if t.format() != first.format() {
            return Err(layout_err(
                id,
                format!(
                    "shards along {} have different formats ({} and {})",
                    axis.name(),
                    first.format(),
                    t.format()
                ),
            ));
        }
    }
    check_dim(p, first.shape(), id)?;
    let parts = pieces.len();
    match p {
        Placement::Replicate => {
            for (k, t) in pieces.iter().enumerate().skip(1) {
                if let Some(i) = first
                    .values()
                    .iter()
                    .zip(t.values())
                    .position(|(a, b)| a.to_bits() != b.to_bits())
                {
                    return Err(Error::ReplicaMismatch {
                        id: id.to_string(),
                        axis: axis.name(),
                        rank: ranks[k],
                        index: i,
                        values: (first.values()[i], t.values()[i]),
                    });
                }
            }
            // Moved when owned (merged along an earlier axis, or given by value).
            Ok(pieces.swap_remove(0).into_owned())
        }
        Placement::Partial => {
            let n = first.len();
            let mut out = take_spare(spare, n);
            out.clear();
            for i in 0..n {
                let mut acc = ExactAccumulator::new();
                for t in &pieces {
                    acc.add(t.values()[i]);
                }
                out.push(first.format().round(acc.to_f64(), Overflow::NonSaturating));
            }
            let (shape, format) = (first.shape().to_vec(), first.format());
            keep_buffers(pieces, spare);
            Ok(Tensor::from_parts_unchecked(&shape, out, format))
        }
        Placement::Split { dim, .. } | Placement::CpChunks { dim } => {
            let (outer, local, inner) = around(first.shape(), dim);
            // Sizes from files: checked (a wrapped product would "match" an empty tensor).
            let (n, total) = local
                .checked_mul(parts)
                .and_then(|n| Some((n, outer.checked_mul(n)?.checked_mul(inner)?)))
                .ok_or_else(|| {
                    layout_err(
                        id,
                        format!(
                            "the merged shape ({parts} shards of {:?} along dim {dim}) has \
                             more elements than memory can index",
                            first.shape()
                        ),
                    )
                })?;
            let mut out = take_spare(spare, total);
            out.clear();
            out.resize(total, 0.0);
            for (i, t) in pieces.iter().enumerate() {
                let ranges = part_ranges(p, n, parts, i, id)?;
                let v = t.values();
                let mut src = 0;
                for o in 0..outer {
                    for &(start, len) in &ranges {
                        let base = (o * n + start) * inner;
                        out[base..base + len * inner].copy_from_slice(&v[src..src + len * inner]);
                        src += len * inner;
                    }
                }
            }
            let mut shape = first.shape().to_vec();
            shape[dim] = n;
            let format = first.format();
            keep_buffers(pieces, spare);
            Ok(Tensor::from_parts_unchecked(&shape, out, format))
        }
    }
}

/// How many buffers of joined pieces a merge keeps for its later joins (see
/// [`merge_reusing`]).
const SPARE_BUFFERS: usize = 4;

/// The spare buffer that best fits `len` elements: the smallest holding them, else the largest
/// (growing a buffer that is too small would cost fresh pages). Empty when there is none.
pub fn take_spare(spare: &mut Vec<Vec<f64>>, len: usize) -> Vec<f64> {
    let fits = spare
        .iter()
        .enumerate()
        .filter(|(_, v)| v.capacity() >= len)
        .min_by_key(|(_, v)| v.capacity())
        .map(|(i, _)| i);
    let pick = fits.or_else(|| {
        spare
            .iter()
            .enumerate()
            .max_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i)
    });
    pick.map(|i| spare.swap_remove(i)).unwrap_or_default()
}

/// Keep the buffers of owned pieces (joined already) for later joins.
fn keep_buffers(pieces: Vec<Cow<'_, Tensor>>, spare: &mut Vec<Vec<f64>>) {
    for t in pieces {
        if let Cow::Owned(t) = t {
            give_spare(spare, t);
        }
    }
}

/// Keep a tensor's buffer in `spare` for reuse (up to a few; empty buffers are not kept) —
/// the counterpart of [`take_spare`].
pub fn give_spare(spare: &mut Vec<Vec<f64>>, t: Tensor) {
    if spare.len() < SPARE_BUFFERS {
        let v = t.into_values();
        if v.capacity() > 0 {
            spare.push(v);
        }
    }
}

/// Split a logical tensor into per-rank shards (indexed by global rank).
pub fn shard(logical: &Tensor, layout: &Layout, mesh: &Mesh, id: &str) -> Result<Vec<Tensor>> {
    let by_dp = cut(logical, layout.dp, mesh.dp, id)?;
    let mut out = vec![Tensor::zeros(&[], logical.format()); mesh.world()];
    for (d, t_d) in by_dp.iter().enumerate() {
        let by_cp = cut(t_d, layout.cp, mesh.cp, id)?;
        for (c, t_c) in by_cp.iter().enumerate() {
            let by_tp = cut(t_c, layout.tp, mesh.tp, id)?;
            for (t, piece) in by_tp.into_iter().enumerate() {
                out[mesh.rank(Coords {
                    dp: d,
                    cp: c,
                    tp: t,
                })] = piece;
            }
        }
    }
    Ok(out)
}

/// Merge per-rank shards (indexed by global rank) into the logical tensor. With `expected`,
/// the merged shape must equal it. Errors name the tensor: wrong number of shards, shards of
/// different shapes, a split that does not divide, replicas that differ
/// ([`Error::ReplicaMismatch`]), or a merged shape other than the expected one.
pub fn merge(
    shards: &[Tensor],
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
    expected: Option<&[usize]>,
) -> Result<Tensor> {
    merge_cow(
        shards.iter().map(Cow::Borrowed).collect(),
        layout,
        mesh,
        id,
        expected,
        &mut Vec::new(),
    )
}

/// [`merge`] taking the shards by value: replicated shards are moved, not copied (the
/// checker's path, where tensors are large and read from files).
pub fn merge_owned(
    shards: Vec<Tensor>,
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
    expected: Option<&[usize]>,
) -> Result<Tensor> {
    merge_reusing(shards, layout, mesh, id, expected, &mut Vec::new())
}

/// [`merge_owned`] with a pool of spare buffers: joined tensors are built in buffers taken
/// from `spare` (their contents are replaced), and the buffers of shards consumed by a join
/// go back to it (up to a few) — so a caller merging tensor after tensor (the checker) does
/// not pay for fresh pages each time.
pub fn merge_reusing(
    shards: Vec<Tensor>,
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
    expected: Option<&[usize]>,
    spare: &mut Vec<Vec<f64>>,
) -> Result<Tensor> {
    merge_cow(
        shards.into_iter().map(Cow::Owned).collect(),
        layout,
        mesh,
        id,
        expected,
        spare,
    )
}

fn merge_cow(
    shards: Vec<Cow<'_, Tensor>>,
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
    expected: Option<&[usize]>,
    spare: &mut Vec<Vec<f64>>,
) -> Result<Tensor> {
    if shards.len() != mesh.world() {
        return Err(layout_err(
            id,
            format!(
                "{} shards given for a mesh of {} ranks ({})",
                shards.len(),
                mesh.world(),
                mesh.label()
            ),
        ));
    }
    let mut slots: Vec<Option<Cow<'_, Tensor>>> = shards.into_iter().map(Some).collect();
    let mut per_dp = Vec::with_capacity(mesh.dp);
    for d in 0..mesh.dp {
        let mut per_cp = Vec::with_capacity(mesh.cp);
        for c in 0..mesh.cp {
            let ranks: Vec<usize> = (0..mesh.tp)
                .map(|t| {
                    mesh.rank(Coords {
                        dp: d,
                        cp: c,
                        tp: t,
                    })
                })
                .collect();
            let pieces: Vec<Cow<'_, Tensor>> = ranks
                .iter()
                .map(|&r| {
                    slots[r]
                        .take()
                        .ok_or_else(|| layout_err(id, format!("rank {r} taken twice")))
                })
                .collect::<Result<_>>()?;
            per_cp.push(Cow::Owned(join(
                pieces,
                layout.tp,
                id,
                Axis::Tp,
                &ranks,
                spare,
            )?));
        }
        let ranks: Vec<usize> = (0..mesh.cp)
            .map(|c| {
                mesh.rank(Coords {
                    dp: d,
                    cp: c,
                    tp: 0,
                })
            })
            .collect();
        per_dp.push(Cow::Owned(join(
            per_cp,
            layout.cp,
            id,
            Axis::Cp,
            &ranks,
            spare,
        )?));
    }
    let ranks: Vec<usize> = (0..mesh.dp)
        .map(|d| {
            mesh.rank(Coords {
                dp: d,
                cp: 0,
                tp: 0,
            })
        })
        .collect();
    let merged = join(per_dp, layout.dp, id, Axis::Dp, &ranks, spare)?;
    if let Some(e) = expected {
        if merged.shape() != e {
            return Err(layout_err(
                id,
                format!(
                    "merging under {layout:?} gives shape {:?}, but the logical tensor has \
                     shape {e:?}; the declared layout is wrong",
                    merged.shape()
                ),
            ));
        }
    }
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Format;

    fn iota(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_parts_unchecked(shape, (0..n).map(|i| i as f64).collect(), Format::F32)
    }

    #[test]
    fn rank_coordinates_round_trip() {
        let m = Mesh::new(4, 2, 2, true).unwrap();
        for r in 0..m.world() {
            assert_eq!(m.rank(m.coords(r)), r);
        }
        assert_eq!(
            m.coords(5),
            Coords {
                dp: 0,
                cp: 1,
                tp: 1
            }
        );
    }

    #[test]
    fn cp_chunks_hold_chunk_i_and_its_mirror() {
        let t = iota(&[8]);
        let m = Mesh::new(1, 2, 1, false).unwrap();
        let l = Layout {
            cp: Placement::CpChunks { dim: 0 },
            ..Layout::replicated()
        };
        let s = shard(&t, &l, &m, "x").unwrap();
        assert_eq!(s[0].values(), &[0.0, 1.0, 6.0, 7.0]);
        assert_eq!(s[1].values(), &[2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn grouped_split_interleaves() {
        // [Q | K | V] with 2 columns each, split over 2 ranks: rank 0 gets q0 k0 v0.
        let t = iota(&[1, 6]);
        let m = Mesh::new(2, 1, 1, false).unwrap();
        let l = Layout {
            tp: Placement::Split { dim: 1, groups: 3 },
            ..Layout::replicated()
        };
        let s = shard(&t, &l, &m, "qkv").unwrap();
        assert_eq!(s[0].values(), &[0.0, 2.0, 4.0]);
        assert_eq!(s[1].values(), &[1.0, 3.0, 5.0]);
    }
}
