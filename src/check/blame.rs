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
    let logical = r.shape();
    if c.shape() != logical {
        return None;
    }
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
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
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
        let mut sq = 0.0f64;
        runs(&maps, &shard, logical, &mut |_, at, len| {
            r.decode_range(at, at + len, &mut xs);
            c.decode_range(at, at + len, &mut ys);
            sq += xs
                .iter()
                .zip(&ys)
                .map(|(x, y)| y - x)
                .filter(|d| d.is_finite())
                .map(|d| d * d)
                .sum::<f64>();
        });
        shares.push((rank, sq));
    }
    let total: f64 = shares.iter().map(|s| s.1).sum();
    let (rank, most) = shares.into_iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    (total > 0.0 && most >= SHARE * total).then_some(rank)
}
