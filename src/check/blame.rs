//! Which rank's shard a failing tensor's difference lies in, when it lies in one.
//!
//! A bug on one rank (a shard loaded in the wrong order, an offset applied by one rank, a
//! corrupted gradient shard) leaves the merged tensor wrong only where that rank's shard
//! lands. The difference ‖c − r‖² is summed over each distinct shard's region of the logical
//! tensor (one rank per shard: coordinate 0 along the axes the tensor is replicated over); a
//! shard holding [`SHARE`] of it or more is named. Round-off spreads over all shards (a clean
//! tensor split in two gives each about half), and a difference carried through a reduction
//! over the ranks spreads too: no rank is named then.

use crate::trace::merge::{axes, dim_maps, runs};
use crate::trace::stored::Stored;
use crate::trace::{Layout, Mesh, Placement};

/// The share of the squared difference one shard must hold to be named.
pub(crate) const SHARE: f64 = 0.9;

/// The rank whose shard holds [`SHARE`] or more of ‖c − r‖² (the lowest global rank holding
/// that shard), if one does: `None` for tensors with no split or a partial sum along an axis,
/// shapes that do not fit, or a difference spread over the shards.
pub(crate) fn faulty_rank(
    r: &Stored,
    c: &Stored,
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
) -> Option<usize> {
    if c.shape() != r.shape() {
        return None;
    }
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    let shares = per_shard(r.shape(), layout, mesh, id, &mut |at, len| {
        r.decode_range(at, at + len, &mut xs);
        c.decode_range(at, at + len, &mut ys);
        xs.iter()
            .zip(&ys)
            .map(|(x, y)| y - x)
            .filter(|d| d.is_finite())
            .map(|d| d * d)
            .sum::<f64>()
    })?;
    let total: f64 = shares.iter().map(|s| s.1).sum();
    let (rank, most) = shares.into_iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    (total > 0.0 && most >= SHARE * total).then_some(rank)
}

/// The rank whose shard holds every one of the flat indices `at` of a tensor of shape
/// `logical` (the lowest global rank holding that shard): the elements a test found beyond
/// their bounds, all on one rank, name it. `None` for an empty list, elements on several
/// shards, or the layouts [`faulty_rank`] does not name a rank for.
pub(crate) fn rank_holding(
    at: &[usize],
    logical: &[usize],
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
) -> Option<usize> {
    if at.is_empty() {
        return None;
    }
    let mut sorted = at.to_vec();
    sorted.sort_unstable();
    let held = per_shard(logical, layout, mesh, id, &mut |start, len| {
        let lo = sorted.partition_point(|&i| i < start);
        let hi = sorted.partition_point(|&i| i < start + len);
        (hi - lo) as f64
    })?;
    held.into_iter()
        .find(|&(_, n)| n as usize == sorted.len())
        .map(|(rank, _)| rank)
}

/// `measure` summed over the runs of each distinct shard's region of the logical tensor (one
/// rank per shard: coordinate 0 along the axes the tensor is replicated over), by rank; `None`
/// for a tensor with no split, a partial sum along an axis, or shapes that do not fit.
fn per_shard(
    logical: &[usize],
    layout: &Layout,
    mesh: &Mesh,
    id: &str,
    measure: &mut dyn FnMut(usize, usize) -> f64,
) -> Option<Vec<(usize, f64)>> {
    let mut shard = logical.to_vec();
    let mut split = false;
    for (axis, parts, _) in axes(mesh, 0) {
        match layout.along(axis) {
            Placement::Partial if parts > 1 => return None,
            Placement::Split { dim, .. } | Placement::CpChunks { dim } if parts > 1 => {
                if dim >= shard.len() || shard[dim] % parts != 0 {
                    return None;
                }
                shard[dim] /= parts;
                split = true;
            }
            _ => {}
        }
    }
    if !split {
        return None;
    }
    let mut shares: Vec<(usize, f64)> = vec![];
    for rank in 0..mesh.world() {
        let replica = axes(mesh, rank).iter().any(|&(axis, parts, i)| {
            i > 0
                && parts > 1
                && !matches!(
                    layout.along(axis),
                    Placement::Split { .. } | Placement::CpChunks { .. }
                )
        });
        if replica {
            continue;
        }
        let maps = dim_maps(logical, layout, mesh, rank, id).ok()?;
        let mut sum = 0.0f64;
        runs(&maps, &shard, logical, &mut |_, at, len| {
            sum += measure(at, len);
        });
        shares.push((rank, sum));
    }
    Some(shares)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Axis;

    #[test]
    fn elements_beyond_their_bounds_name_the_rank_whose_shard_holds_them_all() {
        // A 4 × 6 tensor split by columns over TP 2: rank 0 holds columns 0–2, rank 1 3–5.
        let mesh = Mesh::new([(Axis::TP, 2)]).unwrap();
        let layout = Layout::replicated().with(Axis::TP, Placement::split(1));
        let at = |r: usize, c: usize| r * 6 + c;
        let name = |idx: &[usize]| rank_holding(idx, &[4, 6], &layout, &mesh, "x");
        assert_eq!(name(&[at(0, 1), at(3, 2)]), Some(0));
        assert_eq!(name(&[at(1, 3), at(2, 5), at(0, 4)]), Some(1));
        // Spread over both shards, or none at all: no rank.
        assert_eq!(name(&[at(0, 2), at(0, 3)]), None);
        assert_eq!(name(&[]), None);
        // Replicated, or a partial sum: no shard holds an element alone.
        let replicated = Layout::replicated();
        assert_eq!(rank_holding(&[0], &[4, 6], &replicated, &mesh, "x"), None);
        let partial = Layout::replicated().with(Axis::TP, Placement::Partial);
        assert_eq!(rank_holding(&[0], &[4, 6], &partial, &mesh, "x"), None);
    }
}
