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
//!
//! Merging works a group of ranks at a time: the ranks that differ only along partial axes
//! hold addends of the same region; their sum (rounded once, over all partial axes together)
//! is written at the region's place, found by composing the cuts of the split axes. Copies
//! along replicated axes are compared with what their first copy wrote — after their own
//! partial sums are taken. A merge holds the logical tensor and one group's sum, never every
//! shard at once.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::tensor::Tensor;

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
    /// Every axis, in manifest order.
    pub const ALL: [Axis; 3] = [Axis::Dp, Axis::Cp, Axis::Tp];

    /// The axis named "dp", "cp" or "tp".
    pub fn named(name: &str) -> Option<Axis> {
        Axis::ALL.into_iter().find(|a| a.name() == name)
    }

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
pub const MAX_WORLD: usize = crate::limits::RANKS;

impl Mesh {
    /// A mesh, checking that every size is at least 1 and the world at most 2^20 ranks ([`limits::RANKS`](crate::io::limits::RANKS)).
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

    /// This layout with the placement along `axis` replaced by `p`.
    pub fn with(mut self, axis: Axis, p: Placement) -> Layout {
        match axis {
            Axis::Dp => self.dp = p,
            Axis::Cp => self.cp = p,
            Axis::Tp => self.tp = p,
        }
        self
    }
}

/// What makes `layout` unusable on any mesh, if anything: a split of a dimension at or beyond
/// [`limits::DIMS`](crate::io::limits::DIMS), or in 0 or more than
/// [`limits::SPLIT_PARTS`](crate::io::limits::SPLIT_PARTS) groups; cp chunks of such a
/// dimension. Checked on every axis, an axis of size 1 too (it cuts nothing, but a placement
/// no mesh could use is a broken writer's).
pub(crate) fn layout_problem(layout: &Layout) -> Option<(Axis, String)> {
    use crate::limits;
    Axis::ALL.into_iter().find_map(|axis| {
        let bad = match layout.along(axis) {
            Placement::Split { dim, groups } => {
                (dim >= limits::DIMS || !(1..=limits::SPLIT_PARTS).contains(&groups)).then(|| {
                    format!(
                        "a split of dimension {dim} in {groups} group(s) (dimensions below {}, \
                         1 to {} groups)",
                        limits::DIMS,
                        limits::SPLIT_PARTS
                    )
                })
            }
            Placement::CpChunks { dim } => (dim >= limits::DIMS).then(|| {
                format!(
                    "cp chunks of dimension {dim} (dimensions below {})",
                    limits::DIMS
                )
            }),
            _ => None,
        };
        bad.map(|what| (axis, what))
    })
}

pub(crate) fn layout_err(id: &str, reason: String) -> Error {
    Error::Layout {
        id: id.to_string(),
        reason,
    }
}

/// For a split into `parts` along a dimension of size `n` (viewed as `[outer, n, inner]`
/// elements), the flat source ranges of part `i`: a list of (start along the dim, length).
pub(crate) fn part_ranges(
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

pub(crate) fn dim_of(p: Placement) -> Option<usize> {
    match p {
        Placement::Split { dim, .. } | Placement::CpChunks { dim } => Some(dim),
        _ => None,
    }
}

/// (outer, n, inner) of a shape around `dim`.
pub(crate) fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

pub(crate) fn check_dim(p: Placement, shape: &[usize], id: &str) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Format;
    use crate::trace::merge::{merge, merge_cow};
    use crate::trace::stored::Stored;
    use std::borrow::Cow;

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

    fn random_stored(shape: &[usize], f: Format, g: &mut crate::random::SplitMix64) -> Stored {
        let n: usize = shape.iter().product();
        let bytes = (0..n * f.bit_width().div_ceil(8) as usize)
            .map(|_| g.next_u64() as u8)
            .collect();
        Stored::new(shape, f, bytes).unwrap()
    }

    /// Shards merged as stored patterns give the merge of their decoded values bit for bit
    /// (or the same error), for every placement and stored format: with shards cut from a
    /// logical tensor (the merge must give it back) and with random shards (partial sums of
    /// arbitrary patterns, NaN and infinities included; replicas that differ).
    #[test]
    fn stored_merge_is_the_value_merge() {
        use crate::random::SplitMix64;
        let mesh = Mesh::new(2, 2, 2, false).unwrap();
        let placements = [
            Placement::Replicate,
            Placement::Partial,
            Placement::split(0),
            Placement::Split { dim: 1, groups: 3 },
            Placement::CpChunks { dim: 0 },
        ];
        let mut g = SplitMix64::for_name("stored-merge", 0);
        let mut cases = 0;
        for f in [
            Format::F64,
            Format::F32,
            Format::F16,
            Format::BF16,
            Format::E4M3,
            Format::E5M2,
        ] {
            for (k, &dp) in placements.iter().enumerate() {
                for &cp in &placements {
                    let tp = placements[(k + cases) % placements.len()];
                    cases += 1;
                    let layout = Layout { dp, cp, tp };
                    let logical = random_stored(&[16, 24], f, &mut g);
                    let Ok(cut) = shard(&logical.decode(), &layout, &mesh, "x") else {
                        continue;
                    };
                    let stored: Vec<Stored> =
                        cut.iter().map(|t| Stored::encode(t).unwrap()).collect();
                    let mut spare = Vec::new();
                    let owned = |v: &[Stored]| v.iter().cloned().map(Cow::Owned).collect();
                    let merged: Stored =
                        merge_cow(owned(&stored), &layout, &mesh, "x", None, &mut spare).unwrap();
                    if [dp, cp, tp].contains(&Placement::Partial) {
                        // The zeros of the other ranks were added: -0 may turn into +0.
                        let (a, b) = (merged.decode(), logical.decode());
                        for (x, y) in a.values().iter().zip(b.values()) {
                            assert!(x == y || (x.is_nan() && y.is_nan()), "{f} {layout:?}");
                        }
                    } else {
                        assert_eq!(merged, logical, "{f} {layout:?}");
                    }
                    // Random shards of the cut shapes.
                    let random: Vec<Stored> = stored
                        .iter()
                        .map(|s| random_stored(s.shape(), f, &mut g))
                        .collect();
                    let decoded: Vec<Tensor> = random.iter().map(Stored::decode).collect();
                    let by_values = merge(&decoded, &layout, &mesh, "x", None);
                    let by_patterns: Result<Stored> =
                        merge_cow(owned(&random), &layout, &mesh, "x", None, &mut spare);
                    match (by_values, by_patterns) {
                        (Ok(v), Ok(p)) => {
                            let p = p.decode();
                            assert_eq!(v.shape(), p.shape());
                            // A NaN sum is stored as the format's NaN pattern: any payload.
                            for (x, y) in v.values().iter().zip(p.values()) {
                                let same = x.to_bits() == y.to_bits() || x.is_nan() && y.is_nan();
                                assert!(same, "{f} {layout:?}: {x} vs {y}");
                            }
                        }
                        (Err(a), Err(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
                        (a, b) => panic!("{f} {layout:?}: {a:?} vs {b:?}"),
                    }
                }
            }
        }
        assert!(cases >= 150);
    }
}
