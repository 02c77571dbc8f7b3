//! Per-tensor layouts: one placement per named mesh axis, sharding and the shapes of cuts.
//!
//! A [`Layout`] gives one [`Placement`] per named axis of the [`Mesh`] (an axis it does not
//! name: `Replicate`). Sharding applies the mesh's axes outermost first, each splitting what
//! the outer axes left; merging (`trace::merge`) undoes them innermost first. Placements:
//! * `Replicate` — every rank of the axis holds the same tensor. Merging checks that the copies
//!   agree **bit for bit** and returns [`Error::ReplicaMismatch`] otherwise: a disagreement
//!   means a missing synchronization or a wrong layout, never something to average away.
//! * `Split { dim, groups }` — the dimension is viewed as `[groups, parts, len]` and rank i of
//!   the axis holds `[:, i, :]`. `groups = 1` is a contiguous split (DTensor's `Shard(dim)`);
//!   `groups = 3` is the column-parallel QKV projection, whose output columns are `[Q | K | V]`
//!   with each part's heads taken from all three.
//! * `CpChunks { dim }` — Megatron's load-balanced context-parallel order for causal attention:
//!   the dimension is cut into 2·n chunks and rank i of the axis holds chunks i and
//!   2·n − 1 − i, in that order.
//! * `Partial` — the logical tensor is the sum of the ranks' tensors. Merging sums exactly (long
//!   accumulator) and rounds once to the tensor's format.
//!
//! Merging works a group of ranks at a time: the ranks that differ only along partial axes
//! hold addends of the same region; their sum (rounded once, over all partial axes together)
//! is written at the region's place, found by composing the cuts of the split axes. Copies
//! along replicated axes are compared with what their first copy wrote — after their own
//! partial sums are taken. A merge holds the logical tensor and one group's sum, never every
//! shard at once.

use std::fmt;
use std::hash::{Hash, Hasher};

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::trace::mesh::{Axis, Mesh};

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

/// A tensor's placement along each named mesh axis (an axis it does not name: `Replicate`).
/// Two layouts are equal when they place the tensor alike along every axis, whether or not
/// they name the replicated ones. Written as a JSON object from axis name to placement
/// (`{"dp": {"kind": "split", "dim": 0, "groups": 1}, "tp": {"kind": "replicate"}}`), in the
/// mesh's order once [completed](Layout::completed).
///
/// # Examples
///
/// ```
/// use ttrace::trace::{Axis, Layout, Placement};
/// let l = Layout::replicated().with(Axis::TP, Placement::split(1));
/// assert_eq!(l.along(&Axis::TP), Placement::split(1));
/// assert_eq!(l.along(&Axis::PP), Placement::Replicate);
/// assert_eq!(l, l.clone().with(Axis::DP, Placement::Replicate));
/// ```
#[derive(Clone, Default)]
pub struct Layout {
    along: Vec<(Axis, Placement)>,
}

impl Layout {
    /// Replicated on every rank.
    pub fn replicated() -> Layout {
        Layout::default()
    }

    /// The placement along an axis.
    pub fn along(&self, axis: &Axis) -> Placement {
        self.along
            .iter()
            .find(|(a, _)| a == axis)
            .map_or(Placement::Replicate, |&(_, p)| p)
    }

    /// This layout with the placement along `axis` replaced by `p`.
    pub fn with(mut self, axis: Axis, p: Placement) -> Layout {
        self.set(axis, p);
        self
    }

    /// Replace the placement along `axis` by `p`.
    pub fn set(&mut self, axis: Axis, p: Placement) {
        match self.along.iter_mut().find(|(a, _)| *a == axis) {
            Some(slot) => slot.1 = p,
            None => self.along.push((axis, p)),
        }
    }

    /// The axes the layout names, with their placements, in its order.
    pub fn placements(&self) -> impl Iterator<Item = (&Axis, Placement)> + '_ {
        self.along.iter().map(|(a, p)| (a, *p))
    }

    /// This layout naming every axis of `mesh`, in the mesh's order (`Replicate` where it named
    /// none); the first axis it names that the mesh lacks is an error.
    pub fn completed(&self, mesh: &Mesh) -> std::result::Result<Layout, Axis> {
        if let Some((a, _)) = self.along.iter().find(|(a, _)| !mesh.has(a)) {
            return Err(a.clone());
        }
        Ok(Layout {
            along: mesh
                .axes()
                .iter()
                .map(|(a, _)| (a.clone(), self.along(a)))
                .collect(),
        })
    }

    /// The axes whose placement is not `Replicate`, sorted: what equality and hashing see.
    fn cutting(&self) -> Vec<(&Axis, Placement)> {
        let mut v: Vec<(&Axis, Placement)> = self
            .placements()
            .filter(|(_, p)| *p != Placement::Replicate)
            .collect();
        v.sort_by(|a, b| a.0.cmp(b.0));
        v
    }
}

impl PartialEq for Layout {
    fn eq(&self, other: &Layout) -> bool {
        // Layouts completed against one mesh name the same axes in the same order: compared
        // as they are, without the sorted copy (a manifest compares every rank's entry).
        self.along == other.along || self.cutting() == other.cutting()
    }
}

impl Eq for Layout {}

impl Hash for Layout {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.cutting().hash(h)
    }
}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.placements()).finish()
    }
}

impl Serialize for Layout {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.along.len()))?;
        for (a, p) in &self.along {
            m.serialize_entry(a, p)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Layout {
    /// A JSON object from axis name to placement; an axis named twice is an error.
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Layout, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Layout;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object from mesh axis name to placement")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Layout, A::Error> {
                use serde::de::Error as _;
                let mut l = Layout::default();
                while let Some((axis, p)) = m.next_entry::<Axis, Placement>()? {
                    if l.along.iter().any(|(a, _)| *a == axis) {
                        return Err(A::Error::custom(format!("axis '{axis}' placed twice")));
                    }
                    if l.along.len() >= crate::limits::MESH_AXES {
                        return Err(A::Error::custom(format!(
                            "more than {} axes placed",
                            crate::limits::MESH_AXES
                        )));
                    }
                    l.along.push((axis, p));
                }
                Ok(l)
            }
        }
        d.deserialize_map(V)
    }
}

/// What makes `layout` unusable on any mesh, if anything: a split of a dimension at or beyond
/// [`limits::DIMS`](crate::io::limits::DIMS), or in 0 or more than
/// [`limits::SPLIT_PARTS`](crate::io::limits::SPLIT_PARTS) groups; cp chunks of such a
/// dimension. Checked on every axis, an axis of size 1 too (it cuts nothing, but a placement
/// no mesh could use is a broken writer's).
pub(crate) fn layout_problem(layout: &Layout) -> Option<(Axis, String)> {
    use crate::limits;
    layout.placements().find_map(|(axis, p)| {
        let bad = match p {
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
        bad.map(|what| (axis.clone(), what))
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

/// Split a logical tensor into per-rank shards (indexed by global rank): the mesh's axes cut
/// outermost first, each what the outer ones left.
pub fn shard(logical: &Tensor, layout: &Layout, mesh: &Mesh, id: &str) -> Result<Vec<Tensor>> {
    let mut pieces = vec![logical.clone()];
    for (axis, n) in mesh.axes() {
        // Rank order is row-major: the pieces of the next axis go inside each current piece.
        let mut next = Vec::with_capacity(pieces.len() * n);
        for t in &pieces {
            next.extend(cut(t, layout.along(axis), *n, id)?);
        }
        pieces = next;
    }
    Ok(pieces)
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
    fn cp_chunks_hold_chunk_i_and_its_mirror() {
        let t = iota(&[8]);
        let m = Mesh::megatron(1, 2, 1, false).unwrap();
        let l = Layout::replicated().with(Axis::CP, Placement::CpChunks { dim: 0 });
        let s = shard(&t, &l, &m, "x").unwrap();
        assert_eq!(s[0].values(), &[0.0, 1.0, 6.0, 7.0]);
        assert_eq!(s[1].values(), &[2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn grouped_split_interleaves() {
        // [Q | K | V] with 2 columns each, split over 2 ranks: rank 0 gets q0 k0 v0.
        let t = iota(&[1, 6]);
        let m = Mesh::megatron(2, 1, 1, false).unwrap();
        let l = Layout::replicated().with(Axis::TP, Placement::Split { dim: 1, groups: 3 });
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
        let mesh = Mesh::megatron(2, 2, 2, false).unwrap();
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
                    let layout = Layout::replicated()
                        .with(Axis::DP, dp)
                        .with(Axis::CP, cp)
                        .with(Axis::TP, tp);
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
