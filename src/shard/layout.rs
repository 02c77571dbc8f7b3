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

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::engine::tensor::Tensor;
use crate::error::{Error, Result};
use crate::exact::ExactAccumulator;
use crate::format::{Format, Overflow};
use crate::io::safetensors::encode_values;
use crate::io::stored::Stored;

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

/// What a merge joins: decoded values ([`Tensor`]) or stored bit patterns
/// ([`Stored`](crate::io::stored::Stored)), so a checker can merge shards without widening them.
pub(crate) trait Joinable: Clone {
    /// One unit of the buffer: an `f64` value, or one byte of a stored pattern.
    type Unit: Copy + Default;
    /// The shape.
    fn shape(&self) -> &[usize];
    /// The format.
    fn format(&self) -> Format;
    /// Units per element.
    fn width(&self) -> usize;
    /// The elements' units, in order.
    fn units(&self) -> &[Self::Unit];
    /// A tensor from units known to hold `shape`'s elements.
    fn assemble(shape: &[usize], format: Format, units: Vec<Self::Unit>) -> Self;
    /// The buffer, for reuse.
    fn into_units(self) -> Vec<Self::Unit>;
    /// The first position where two runs of units differ bit for bit.
    fn first_unit_difference(a: &[Self::Unit], b: &[Self::Unit]) -> Option<usize>;
    /// The value of one element's units.
    fn value_of(format: Format, units: &[Self::Unit]) -> f64;
    /// The elementwise sum of `pieces` (same shape and format, at least one), each element
    /// summed exactly and rounded once to the format, built in `out`.
    fn exact_sum(pieces: &[&Self], out: Vec<Self::Unit>) -> Result<Self>;
}

impl Joinable for Tensor {
    type Unit = f64;
    fn shape(&self) -> &[usize] {
        Tensor::shape(self)
    }
    fn format(&self) -> Format {
        Tensor::format(self)
    }
    fn width(&self) -> usize {
        1
    }
    fn units(&self) -> &[f64] {
        self.values()
    }
    fn assemble(shape: &[usize], format: Format, units: Vec<f64>) -> Tensor {
        Tensor::from_parts_unchecked(shape, units, format)
    }
    fn into_units(self) -> Vec<f64> {
        self.into_values()
    }
    fn first_unit_difference(a: &[f64], b: &[f64]) -> Option<usize> {
        a.iter()
            .zip(b)
            .position(|(x, y)| x.to_bits() != y.to_bits())
    }
    fn value_of(_: Format, units: &[f64]) -> f64 {
        units[0]
    }
    fn exact_sum(pieces: &[&Tensor], mut out: Vec<f64>) -> Result<Tensor> {
        let first = pieces[0];
        out.clear();
        for i in 0..first.len() {
            let mut acc = ExactAccumulator::new();
            for t in pieces {
                acc.add(t.values()[i]);
            }
            out.push(first.format().round(acc.to_f64(), Overflow::NonSaturating));
        }
        Ok(Tensor::from_parts_unchecked(
            first.shape(),
            out,
            first.format(),
        ))
    }
}

impl Joinable for Stored {
    type Unit = u8;
    fn shape(&self) -> &[usize] {
        Stored::shape(self)
    }
    fn format(&self) -> Format {
        Stored::format(self)
    }
    fn width(&self) -> usize {
        Stored::width(self)
    }
    fn units(&self) -> &[u8] {
        self.bytes()
    }
    fn assemble(shape: &[usize], format: Format, units: Vec<u8>) -> Stored {
        Stored::from_parts_unchecked(shape, format, units)
    }
    fn into_units(self) -> Vec<u8> {
        self.into_bytes()
    }
    fn first_unit_difference(a: &[u8], b: &[u8]) -> Option<usize> {
        if a == b {
            return None;
        }
        a.iter().zip(b).position(|(x, y)| x != y)
    }
    fn value_of(format: Format, units: &[u8]) -> f64 {
        Stored::from_parts_unchecked(&[], format, units.to_vec()).value(0)
    }
    fn exact_sum(pieces: &[&Stored], mut out: Vec<u8>) -> Result<Stored> {
        // A block of every piece decoded at a time: memory stays that of the patterns.
        const BLOCK: usize = 1 << 12;
        let first = pieces[0];
        let (n, format) = (first.len(), first.format());
        out.clear();
        let mut decoded = vec![Vec::new(); pieces.len()];
        let mut sums = Vec::with_capacity(BLOCK.min(n));
        for start in (0..n).step_by(BLOCK) {
            let end = (start + BLOCK).min(n);
            for (t, buf) in pieces.iter().zip(&mut decoded) {
                t.decode_range(start, end, buf);
            }
            sums.clear();
            sums.extend((0..end - start).map(|i| {
                let mut acc = ExactAccumulator::new();
                for buf in &decoded {
                    acc.add(buf[i]);
                }
                format.round(acc.to_f64(), Overflow::NonSaturating)
            }));
            out.extend_from_slice(&encode_values(&sums, format, "a partial sum")?);
        }
        Ok(Stored::from_parts_unchecked(first.shape(), format, out))
    }
}

/// How many spare buffers a pool keeps (see [`merge_reusing`]).
const SPARE_BUFFERS: usize = 4;

/// The spare buffer that best fits `len` elements: the smallest holding them, else the largest
/// (growing a buffer that is too small would cost fresh pages). Empty when there is none.
pub(crate) fn take_spare<U>(spare: &mut Vec<Vec<U>>, len: usize) -> Vec<U> {
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

/// Keep a buffer in `spare` for reuse (up to a few; empty buffers are not kept).
pub(crate) fn keep<U>(spare: &mut Vec<Vec<U>>, v: Vec<U>) {
    if spare.len() < SPARE_BUFFERS && v.capacity() > 0 {
        spare.push(v);
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

/// [`merge`] taking the shards by value: a shard that holds the whole tensor (replicated on
/// every axis) is moved, not copied.
pub fn merge_owned(
    shards: Vec<Tensor>,
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
    expected: Option<&[usize]>,
) -> Result<Tensor> {
    merge_reusing(shards, layout, mesh, id, expected, &mut Vec::new())
}

/// [`merge_owned`] with a pool of spare buffers: the merged tensor (and any partial sum) is
/// built in a buffer taken from `spare` (its contents are replaced), and the buffers of the
/// shards it consumed go back to it (up to a few) — so a caller merging tensor after tensor
/// does not pay for fresh pages each time.
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

/// [`merge_reusing`] for values or stored patterns, borrowed or owned (see
/// [`merge_fetched`]).
pub(crate) fn merge_cow<T: Joinable>(
    shards: Vec<Cow<'_, T>>,
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
    expected: Option<&[usize]>,
    spare: &mut Vec<Vec<T::Unit>>,
) -> Result<T> {
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
    let mut slots: Vec<Option<Cow<'_, T>>> = shards.into_iter().map(Some).collect();
    merge_fetched(
        &mut |ranks, spare| {
            let mut pieces: Vec<Cow<'_, T>> = Vec::with_capacity(ranks.len());
            for &r in ranks {
                let t = slots[r]
                    .take()
                    .ok_or_else(|| layout_err(id, format!("rank {r} taken twice")))?;
                if let Some(first) = pieces.first() {
                    same_kind(&**first, &*t, ranks[0], r, id)?;
                }
                pieces.push(t);
            }
            if pieces.len() == 1 {
                return Ok(pieces.swap_remove(0));
            }
            let refs: Vec<&T> = pieces.iter().map(|t| &**t).collect();
            let sum = T::exact_sum(&refs, take_spare(spare, refs[0].units().len()))?;
            for t in pieces {
                if let Cow::Owned(t) = t {
                    keep(spare, t.into_units());
                }
            }
            Ok(Cow::Owned(sum))
        },
        layout,
        mesh,
        id,
        expected,
        spare,
    )
}

/// An error unless two shards have one shape and one format.
pub(crate) fn same_kind<T: Joinable>(a: &T, b: &T, ra: usize, rb: usize, id: &str) -> Result<()> {
    if a.shape() != b.shape() || a.format() != b.format() {
        return Err(layout_err(
            id,
            format!(
                "shards differ: rank {ra} holds {} {:?}, rank {rb} holds {} {:?}",
                a.format(),
                a.shape(),
                b.format(),
                b.shape()
            ),
        ));
    }
    Ok(())
}

/// Gives the sum of the shards of `ranks` (the addends of one partial sum, in rank order), or
/// the shard itself for one rank, given the pool of spare buffers to build it in.
pub(crate) type Fetch<'f, 'a, T> =
    dyn FnMut(&[usize], &mut Vec<Vec<<T as Joinable>::Unit>>) -> Result<Cow<'a, T>> + 'f;

/// [`merge_cow`] with the shards fetched on demand, each once, a group at a time: the ranks
/// that differ only along partial axes hold addends of the same region (their sum, taken
/// exactly and rounded once, is fetched as one piece); the region is written into the logical
/// tensor — or, for a copy along a replicated axis, compared with what the first copy wrote.
/// Memory: the logical tensor and one group's sum (plus what `fetch` needs to form it).
pub(crate) fn merge_fetched<'a, T: Joinable>(
    fetch: &mut Fetch<'_, 'a, T>,
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
    expected: Option<&[usize]>,
    spare: &mut Vec<Vec<T::Unit>>,
) -> Result<T> {
    let groups = groups(layout, mesh);
    let first = fetch(&groups[0].1, spare)?;
    let merged = if groups.len() == 1 {
        first.into_owned()
    } else {
        scatter(first, &groups, fetch, layout, mesh, id, spare)?
    };
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

/// The ranks grouped by their coordinates along the split and replicated axes (the members
/// of a group differ along partial axes only: addends of one region), each group with the
/// innermost replicated axis along which it is a copy (`None` for first copies); first
/// copies first, each list in rank order.
fn groups(layout: &Layout, mesh: &Mesh) -> Vec<(Option<Axis>, Vec<usize>)> {
    let mut by_key: std::collections::BTreeMap<(bool, [usize; 3]), Vec<usize>> = Default::default();
    let mut copy_axis = std::collections::HashMap::new();
    for r in 0..mesh.world() {
        let c = axes(mesh, mesh.coords(r));
        let key = c.map(|(axis, _, i)| {
            if layout.along(axis) == Placement::Partial {
                0
            } else {
                i
            }
        });
        let copy = c
            .iter()
            .rev()
            .find(|&&(axis, _, i)| layout.along(axis) == Placement::Replicate && i > 0)
            .map(|&(axis, _, _)| axis);
        // Ranks in order: a group's key is first met at its lowest rank.
        let group = by_key.entry((copy.is_some(), key)).or_default();
        if group.is_empty() {
            copy_axis.insert(r, copy);
        }
        group.push(r);
    }
    let mut out: Vec<(Option<Axis>, Vec<usize>)> = by_key
        .into_values()
        .map(|ranks| (copy_axis[&ranks[0]], ranks))
        .collect();
    out.sort_by_key(|(copy, ranks)| (copy.is_some(), ranks[0]));
    out
}

/// Per dimension of a shard, where its coordinates lie in the logical tensor: segments
/// (length, logical start), in the shard's order.
type DimMap = Vec<(usize, usize)>;

/// The coordinates `start..start + len` of a map.
fn restrict(map: &[(usize, usize)], start: usize, len: usize) -> DimMap {
    let (end, mut at, mut out) = (start + len, 0usize, vec![]);
    for &(l, logical) in map {
        let (a, b) = (at.max(start), (at + l).min(end));
        if a < b {
            out.push((b - a, logical + (a - at)));
        }
        at += l;
        if at >= end {
            break;
        }
    }
    out
}

/// The mesh axes, outermost first, with their sizes and a rank's coordinate along each.
fn axes(mesh: &Mesh, c: Coords) -> [(Axis, usize, usize); 3] {
    [
        (Axis::Dp, mesh.dp, c.dp),
        (Axis::Cp, mesh.cp, c.cp),
        (Axis::Tp, mesh.tp, c.tp),
    ]
}

/// The logical shape of shards of `shape`, checked: dimensions that exist, sizes and the
/// element count (times `width` units) that fit in memory.
fn logical_shape(
    shape: &[usize],
    width: usize,
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
) -> Result<Vec<usize>> {
    let too_large = || {
        layout_err(
            id,
            format!(
                "the merged shape ({} shards of {shape:?}) has more elements than memory can \
                 index",
                mesh.world()
            ),
        )
    };
    let mut s = shape.to_vec();
    for (axis, parts, _) in axes(
        mesh,
        Coords {
            dp: 0,
            cp: 0,
            tp: 0,
        },
    ) {
        let p = layout.along(axis);
        check_dim(p, shape, id)?;
        if let Some(d) = dim_of(p) {
            s[d] = s[d].checked_mul(parts).ok_or_else(too_large)?;
        }
    }
    crate::engine::tensor::element_count(&s)
        .and_then(|n| n.checked_mul(width))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(too_large)?;
    Ok(s)
}

/// Where a rank's shard lies in the logical tensor, per dimension: the cuts of the outer
/// axes first, each choosing coordinates of what the outer ones left.
fn dim_maps(
    logical: &[usize],
    layout: &Layout,
    mesh: &Mesh,
    rank: usize,
    id: &str,
) -> Result<Vec<DimMap>> {
    let mut maps: Vec<DimMap> = logical.iter().map(|&n| vec![(n, 0)]).collect();
    for (axis, parts, i) in axes(mesh, mesh.coords(rank)) {
        let p = layout.along(axis);
        if let Some(d) = dim_of(p) {
            let n = maps[d].iter().map(|s| s.0).sum();
            let ranges = part_ranges(p, n, parts, i, id)?;
            maps[d] = ranges
                .iter()
                .flat_map(|&(start, len)| restrict(&maps[d], start, len))
                .collect();
        }
    }
    Ok(maps)
}

/// The contiguous runs of a shard of `shape` in the logical tensor, as (shard element,
/// logical element, elements): the dimensions after the last one its maps cut are copied
/// whole; the ones before it are walked.
fn runs(
    maps: &[DimMap],
    shape: &[usize],
    logical: &[usize],
    f: &mut dyn FnMut(usize, usize, usize),
) {
    let total: usize = shape.iter().product();
    if total == 0 {
        return;
    }
    let whole = |k: usize| maps[k].len() == 1 && maps[k][0] == (logical[k], 0);
    let Some(cut) = (0..shape.len()).rev().find(|&k| !whole(k)) else {
        f(0, 0, total);
        return;
    };
    let inner: usize = shape[cut + 1..].iter().product();
    let stride = |dims: &[usize], k: usize| dims[k + 1..].iter().product::<usize>();
    // Per walked dimension: the logical coordinate of each shard coordinate.
    let tables: Vec<Vec<usize>> = (0..cut)
        .map(|k| {
            maps[k]
                .iter()
                .flat_map(|&(len, start)| start..start + len)
                .collect()
        })
        .collect();
    let mut idx = vec![0usize; cut];
    loop {
        let (mut src, mut dst) = (0, 0);
        for k in 0..cut {
            src += idx[k] * stride(shape, k);
            dst += tables[k][idx[k]] * stride(logical, k);
        }
        let mut at = 0;
        for &(len, start) in &maps[cut] {
            f(src + at * inner, dst + start * inner, len * inner);
            at += len;
        }
        // The next walked coordinate, innermost fastest.
        let Some(k) = (0..cut).rev().find(|&k| idx[k] + 1 < shape[k]) else {
            return;
        };
        idx[k] += 1;
        idx[k + 1..].iter_mut().for_each(|i| *i = 0);
    }
}

/// The logical tensor from the groups' pieces (`first` is the first group's): first copies
/// written at their regions, other copies compared with what is there.
fn scatter<'a, T: Joinable>(
    first: Cow<'a, T>,
    groups: &[(Option<Axis>, Vec<usize>)],
    fetch: &mut Fetch<'_, 'a, T>,
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
    spare: &mut Vec<Vec<T::Unit>>,
) -> Result<T> {
    let (shape, format, w) = (first.shape().to_vec(), first.format(), first.width());
    let logical = logical_shape(&shape, w, layout, mesh, id)?;
    let mut out = if shape == logical {
        // The first piece is the whole tensor (no axis splits it): moved when owned.
        first.into_owned().into_units()
    } else {
        // Checked by `logical_shape`.
        let total = logical.iter().product::<usize>() * w;
        let mut out = take_spare(spare, total);
        out.clear();
        out.resize(total, T::Unit::default());
        let maps = dim_maps(&logical, layout, mesh, groups[0].1[0], id)?;
        let src = first.units();
        runs(&maps, &shape, &logical, &mut |s, d, n| {
            out[d * w..(d + n) * w].copy_from_slice(&src[s * w..(s + n) * w])
        });
        if let Cow::Owned(t) = first {
            keep(spare, t.into_units());
        }
        out
    };
    for (copy, ranks) in &groups[1..] {
        let r = ranks[0];
        let t = fetch(ranks, spare)?;
        if t.shape() != shape.as_slice() || t.format() != format {
            return Err(layout_err(
                id,
                format!(
                    "shards differ: rank 0 holds {format} {shape:?}, rank {r} holds {} {:?}",
                    t.format(),
                    t.shape()
                ),
            ));
        }
        let maps = dim_maps(&logical, layout, mesh, r, id)?;
        let src = t.units();
        match copy {
            None => runs(&maps, &shape, &logical, &mut |s, d, n| {
                out[d * w..(d + n) * w].copy_from_slice(&src[s * w..(s + n) * w])
            }),
            Some(axis) => {
                let mut first_diff = None;
                runs(&maps, &shape, &logical, &mut |s, d, n| {
                    if first_diff.is_none() {
                        let (a, b) = (&out[d * w..(d + n) * w], &src[s * w..(s + n) * w]);
                        first_diff = T::first_unit_difference(a, b).map(|u| (d + u / w, s + u / w));
                    }
                });
                if let Some((d, s)) = first_diff {
                    return Err(Error::ReplicaMismatch {
                        id: id.to_string(),
                        axis: axis.name(),
                        rank: r,
                        index: d,
                        values: (
                            T::value_of(format, &out[d * w..(d + 1) * w]),
                            T::value_of(format, &src[s * w..(s + 1) * w]),
                        ),
                    });
                }
            }
        }
        if let Cow::Owned(t) = t {
            keep(spare, t.into_units());
        }
    }
    Ok(T::assemble(&logical, format, out))
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

    fn random_stored(
        shape: &[usize],
        f: Format,
        g: &mut crate::engine::init::SplitMix64,
    ) -> Stored {
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
        use crate::engine::init::SplitMix64;
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
