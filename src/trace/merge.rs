//! The canonical merge of per-rank shards into logical tensors: each group of ranks that
//! differ only along partial axes is summed exactly (rounded once), its region of the logical
//! tensor found by composing the split axes' cuts, and copies along replicated axes compared
//! in place — for decoded values ([`Tensor`]) and for stored patterns alike.

use std::borrow::Cow;

use crate::error::{Error, Result};
use crate::exact::ExactAccumulator;
use crate::format::codec::encode_values_into;
use crate::format::{Format, Overflow};
use crate::tensor::Tensor;
use crate::trace::layout::{check_dim, dim_of, layout_err, part_ranges, Layout, Placement};
use crate::trace::mesh::{Axis, Mesh};
use crate::trace::stored::Stored;

/// What a merge joins: decoded values ([`Tensor`]) or stored bit patterns
/// ([`Stored`](crate::trace::stored::Stored)), so a checker can merge shards without widening them.
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
            out.push(rounded_sum(
                pieces.iter().map(|t| t.values()[i]),
                first.format(),
            ));
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
            if let ([a, b], Format::BF16) = (decoded.as_slice(), format) {
                // Two BF16 addends (TP 2's partial sums): patterns straight from the bits,
                // the rest (flagged) by the general way.
                let mut patterns = [0u16; BLOCK];
                let mut flags = [false; BLOCK];
                let len = end - start;
                for i in 0..len {
                    (patterns[i], flags[i]) = bf16_pair_sum(a[i], b[i]);
                }
                for i in 0..len {
                    if flags[i] {
                        let sum = rounded_sum([a[i], b[i]].into_iter(), format);
                        encode_values_into(&[sum], format, "a partial sum", &mut out)?;
                    } else {
                        out.extend_from_slice(&patterns[i].to_le_bytes());
                    }
                }
                continue;
            }
            sums.extend(
                (0..end - start).map(|i| rounded_sum(decoded.iter().map(|buf| buf[i]), format)),
            );
            encode_values_into(&sums, format, "a partial sum", &mut out)?;
        }
        Ok(Stored::from_parts_unchecked(first.shape(), format, out))
    }
}

/// The BF16 pattern of a + b rounded once to BF16 (ties to even), and `true` where this quick
/// way cannot say and [`rounded_sum`] must: a sum that `f64` does not hold exactly (TwoSum's
/// error term not zero), not finite, below BF16's normal range but not zero, or rounding
/// beyond its largest value. Otherwise the `f64` sum is the exact one and rounding its pattern
/// to 8 significant bits is the format's rounding (the carry of a round-up bumps the exponent
/// as it should); branch-free, so that a block of them vectorizes. Test:
/// `bf16_pair_sums_are_the_general_ones`.
#[inline(always)]
fn bf16_pair_sum(a: f64, b: f64) -> (u16, bool) {
    const SIGN: u64 = 1 << 63;
    const SHIFT: u32 = 52 - 7;
    // 2^-126 and 2^128 as f64 patterns.
    const MIN_NORMAL: u64 = (1023 - 126) << 52;
    const OVERFLOW: u64 = (1023 + 128) << 52;
    let t = a + b;
    let bb = t - a;
    let err = (a - (t - bb)) + (b - bb);
    let bits = t.to_bits();
    let mag = bits & !SIGN;
    let rounded = (mag + (1 << (SHIFT - 1)) - 1 + ((mag >> SHIFT) & 1)) & !((1 << SHIFT) - 1);
    let slow = err != 0.0 || !(mag == 0 || mag >= MIN_NORMAL) || rounded >= OVERFLOW;
    let value = f64::from_bits((bits & SIGN) | rounded);
    ((((value as f32).to_bits()) >> 16) as u16, slow)
}

/// The exact sum of `terms` rounded once to `format` (non-saturating): added in `f64` when no
/// step rounds (the common case, checked step by step; the `f64` sum is then the exact one),
/// else by the long accumulator, which rounds the exact sum to the format itself (rounding it
/// to `f64` first could land on a tie of the format's grid that the exact sum is not on).
#[inline]
fn rounded_sum(terms: impl Iterator<Item = f64> + Clone, format: Format) -> f64 {
    match crate::exact::sum_if_exact(terms.clone()) {
        Some(s) => format.round(s, Overflow::NonSaturating),
        None => {
            let mut acc = ExactAccumulator::new();
            terms.for_each(|x| acc.add(x));
            acc.round(format, Overflow::NonSaturating)
        }
    }
}

/// How many spare buffers a pool keeps (see [`merge_reusing`]).
pub(crate) const SPARE_BUFFERS: usize = 4;

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
            let pieces = ranks
                .iter()
                .map(|&r| {
                    slots[r]
                        .take()
                        .ok_or_else(|| layout_err(id, format!("rank {r} taken twice")))
                })
                .collect::<Result<Vec<_>>>()?;
            sum_group(pieces, ranks, id, spare)
        },
        layout,
        mesh,
        id,
        expected,
        spare,
    )
}

/// The piece of a group of ranks (see [`merge_fetched`]): the one shard of a single rank, or
/// the exact, once-rounded sum of the addends `pieces` held by `ranks` (same shape and format,
/// checked), built in a buffer from `spare` to which the owned addends' buffers go back.
pub(crate) fn sum_group<'a, T: Joinable>(
    mut pieces: Vec<Cow<'a, T>>,
    ranks: &[usize],
    id: &str,
    spare: &mut Vec<Vec<T::Unit>>,
) -> Result<Cow<'a, T>> {
    for (t, &r) in pieces.iter().zip(ranks).skip(1) {
        same_kind(&*pieces[0], &**t, ranks[0], r, id)?;
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
    // A placement naming a dimension the shards lack is refused on an axis of size 1 too
    // (a one-rank trace's merge is its one shard).
    for (_, p) in layout.placements() {
        check_dim(p, first.shape(), id)?;
    }
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
pub(crate) fn groups(layout: &Layout, mesh: &Mesh) -> Vec<(Option<Axis>, Vec<usize>)> {
    let mut by_key: std::collections::BTreeMap<(bool, Vec<usize>), Vec<usize>> = Default::default();
    let mut copy_axis = std::collections::HashMap::new();
    let placements: Vec<Placement> = mesh.axes().iter().map(|(a, _)| layout.along(a)).collect();
    for r in 0..mesh.world() {
        let c = mesh.coords(r);
        let key = c
            .iter()
            .zip(&placements)
            .map(|(&i, &p)| if p == Placement::Partial { 0 } else { i })
            .collect();
        let copy = (0..c.len())
            .rev()
            .find(|&k| placements[k] == Placement::Replicate && c[k] > 0)
            .map(|k| mesh.axes()[k].0.clone());
        // Ranks in order: a group's key is first met at its lowest rank.
        let group = by_key.entry((copy.is_some(), key)).or_default();
        if group.is_empty() {
            copy_axis.insert(r, copy);
        }
        group.push(r);
    }
    let mut out: Vec<(Option<Axis>, Vec<usize>)> = by_key
        .into_values()
        .map(|ranks| (copy_axis[&ranks[0]].clone(), ranks))
        .collect();
    out.sort_by_key(|(copy, ranks)| (copy.is_some(), ranks[0]));
    out
}

/// Per dimension of a shard, where its coordinates lie in the logical tensor: segments
/// (length, logical start), in the shard's order.
pub(crate) type DimMap = Vec<(usize, usize)>;

/// The coordinates `start..start + len` of a map.
pub(crate) fn restrict(map: &[(usize, usize)], start: usize, len: usize) -> DimMap {
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
pub(crate) fn axes(mesh: &Mesh, rank: usize) -> Vec<(&Axis, usize, usize)> {
    let c = mesh.coords(rank);
    mesh.axes()
        .iter()
        .zip(c)
        .map(|((a, n), i)| (a, *n, i))
        .collect()
}

/// The logical shape of shards of `shape`, checked: dimensions that exist, sizes and the
/// element count (times `width` units) that fit in memory.
pub(crate) fn logical_shape(
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
    // A placement naming a dimension the shard lacks is refused on an axis of size 1 too.
    for (_, p) in layout.placements() {
        check_dim(p, shape, id)?;
    }
    let mut s = shape.to_vec();
    for (axis, parts, _) in axes(mesh, 0) {
        let p = layout.along(axis);
        check_dim(p, shape, id)?;
        if let Some(d) = dim_of(p) {
            s[d] = s[d].checked_mul(parts).ok_or_else(too_large)?;
        }
    }
    crate::tensor::element_count(&s)
        .and_then(|n| n.checked_mul(width))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(too_large)?;
    Ok(s)
}

/// Where a rank's shard lies in the logical tensor, per dimension: the cuts of the outer
/// axes first, each choosing coordinates of what the outer ones left.
pub(crate) fn dim_maps(
    logical: &[usize],
    layout: &Layout,
    mesh: &Mesh,
    rank: usize,
    id: &str,
) -> Result<Vec<DimMap>> {
    let mut maps: Vec<DimMap> = logical.iter().map(|&n| vec![(n, 0)]).collect();
    for (axis, parts, i) in axes(mesh, rank) {
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
pub(crate) fn runs(
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
pub(crate) fn scatter<'a, T: Joinable>(
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
        if out.capacity() < total {
            // Fresh zeroed pages from the allocator (no copy of the small buffer's bytes,
            // no zeroing pass over them).
            out = vec![T::Unit::default(); total];
        } else {
            out.resize(total, T::Unit::default());
        }
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
                        axis: axis.name().to_string(),
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
    use proptest::prelude::*;

    /// The general way, by the long accumulator: a + b rounded once to BF16, its pattern.
    fn general(a: f64, b: f64) -> Option<u16> {
        let mut acc = ExactAccumulator::new();
        acc.add(a);
        acc.add(b);
        let r = acc.round(Format::BF16, Overflow::NonSaturating);
        Format::BF16.encode(r).ok().map(|p| p as u16)
    }

    fn bf16(pattern: u16) -> f64 {
        f64::from(f32::from_bits(u32::from(pattern) << 16))
    }

    proptest! {
        /// Where the quick way answers, it is the exact sum rounded once (the long
        /// accumulator's), for any two BF16 patterns: every binade, subnormals, zeros of both
        /// signs, infinities and NaNs, ties, overflow.
        #[test]
        fn bf16_pair_sums_are_the_general_ones(x in any::<u16>(), y in any::<u16>(), near in any::<bool>()) {
            // Half the pairs from nearby binades, where the sums round (and tie) most.
            let y = if near { (x & 0xff80) ^ (y & 0x807f) } else { y };
            let (a, b) = (bf16(x), bf16(y));
            let (p, slow) = bf16_pair_sum(a, b);
            if !slow {
                prop_assert_eq!(Some(p), general(a, b), "{} + {}", a, b);
            }
        }
    }

    /// The quick way answers for the sums TP 2's partial outputs hold (normal values of
    /// nearby size, zeros), hands on the rest, and rounds ties to even. Oracle by hand.
    #[test]
    fn bf16_pair_sums_by_hand() {
        let p = |e: i32| 2f64.powi(e);
        // 1 + 2^-8 is a tie: to even 1 (pattern 0x3f80); 1 + 3·2^-8 ties up to 1 + 2^-6.
        assert_eq!(bf16_pair_sum(1.0, p(-8)), (0x3f80, false));
        assert_eq!(bf16_pair_sum(1.0, 3.0 * p(-8)), (0x3f82, false));
        assert_eq!(bf16_pair_sum(-0.0, -0.0), (0x8000, false));
        assert_eq!(bf16_pair_sum(0.0, -0.0), (0x0000, false));
        assert_eq!(bf16_pair_sum(3.0, -3.0), (0x0000, false));
        // Handed on: beyond the range, below its normal values, inexact in f64, not finite.
        let max = Format::BF16.max_finite();
        assert!(bf16_pair_sum(max, max).1);
        assert!(bf16_pair_sum(p(-130), 0.0).1);
        assert!(bf16_pair_sum(1.0, p(-100)).1);
        assert!(bf16_pair_sum(f64::INFINITY, 1.0).1);
        assert!(bf16_pair_sum(f64::NAN, 1.0).1);
    }
}
