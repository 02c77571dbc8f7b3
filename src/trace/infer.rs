//! Layouts a trace writer had to guess, inferred from shapes.
//!
//! A tracer sees a plain tensor made by code it cannot look into (functional code between
//! modules, a hand-written engine's sharded activations, the batch dimension under data
//! parallelism) and cannot know how the ranks' copies form the logical tensor. It marks the
//! axes it guessed; the checker then lists the layouts — the guess with guessed axes changed
//! to replication or a contiguous split of some dimension — that give every rank exactly its
//! shape against the reference's logical shape. One fits: it is taken. Several fit (a batch and
//! a head dimension both halved when dp = tp = 2): the one whose merged tensor is closest to
//! the reference's is taken (`TraceDir::infer_guessed`), which could hide only a bug that
//! exactly permutes whole blocks between those dimensions. None fits: the guess stays and the
//! merge reports it. A context-parallel axis may also hold load-balanced chunks
//! ([`Placement::CpChunks`], torchtitan's and Megatron's default for causal attention), which
//! fit wherever a contiguous split does: the values choose. Shapes cannot tell a replicated
//! tensor from a partial sum, nor a contiguous split from an interleaved one: those stay as
//! guessed, and a wrong guess shows as
//! replicas that differ or a large error — never as a pass.

use super::layout::{dim_of, Layout, Placement};
use super::mesh::{Axis, Mesh};

/// The local shape a rank holds of a logical tensor of shape `logical` under `layout`, or
/// `None` if the layout cannot cut it (a dimension that does not divide, or out of range).
pub(crate) fn local_shape(layout: &Layout, logical: &[usize], mesh: &Mesh) -> Option<Vec<usize>> {
    let mut s = logical.to_vec();
    for (axis, parts) in mesh.axes() {
        let (p, parts) = (layout.along(axis), *parts);
        let Some(d) = dim_of(p) else { continue };
        let whole = match p {
            Placement::Split { groups, .. } => groups.checked_mul(parts)?,
            Placement::CpChunks { .. } => 2 * parts,
            _ => 1,
        };
        let n = *s.get(d)?;
        if whole == 0 || n % whole != 0 {
            return None;
        }
        s[d] = n / parts;
    }
    Some(s)
}

/// The logical shape of a tensor whose rank holds `local` under `layout`.
pub(crate) fn logical_shape(layout: &Layout, local: &[usize], mesh: &Mesh) -> Option<Vec<usize>> {
    let mut s = local.to_vec();
    for (axis, parts) in mesh.axes() {
        if let Some(d) = dim_of(layout.along(axis)) {
            let n = s.get_mut(d)?;
            *n = n.checked_mul(*parts)?;
        }
    }
    Some(s)
}

/// Every layout that makes every rank hold `local` of a logical tensor of shape `logical`,
/// changing only the axes in `free` of `guess`, fewest changes first (the guess itself first
/// when it fits). Two axes may split one dimension (context parallelism's chunks of the
/// sequence, cut again by sequence parallelism): the outer axis cuts first, as the merge nests
/// them (the mesh's axes, outermost first).
pub(crate) fn fitting_layouts(
    guess: &Layout,
    free: &[Axis],
    logical: &[usize],
    local: &[usize],
    mesh: &Mesh,
) -> Vec<Layout> {
    if local.len() != logical.len() {
        return vec![];
    }
    let candidates = variants(guess, free, logical.len(), mesh);
    let mut fits: Vec<(usize, Layout)> = vec![];
    for l in candidates {
        if local_shape(&l, logical, mesh).as_deref() != Some(local) {
            continue;
        }
        let changed = mesh
            .axes()
            .iter()
            .filter(|(a, _)| l.along(a) != guess.along(a))
            .count();
        fits.push((changed, l));
    }
    fits.sort_by_key(|f| f.0);
    fits.into_iter().map(|f| f.1).collect()
}

/// The guess with the axes in `free` changed to replication or a split of each of `ndim`
/// dimensions (for cp also its load-balanced chunks, which shapes cannot tell from a contiguous
/// split); an axis of size 1 keeps its guess (it cuts nothing). The guess first.
fn variants(guess: &Layout, free: &[Axis], ndim: usize, mesh: &Mesh) -> Vec<Layout> {
    let options = |axis: &Axis| -> Vec<Placement> {
        let g = guess.along(axis);
        let mut v = vec![g];
        if mesh.size(axis) > 1 && free.contains(axis) {
            let chunks = (*axis == Axis::CP)
                .then(|| (0..ndim).map(|dim| Placement::CpChunks { dim }))
                .into_iter()
                .flatten();
            let others = std::iter::once(Placement::Replicate)
                .chain((0..ndim).map(Placement::split))
                .chain(chunks);
            v.extend(others.filter(|&p| p != g));
        }
        v
    };
    // Every combination of the axes' options (the mesh's axes, outermost first).
    let mut candidates = vec![guess.clone()];
    for (axis, _) in mesh.axes() {
        let opts = options(axis);
        candidates = candidates
            .iter()
            .flat_map(|l| opts.iter().map(|&p| l.clone().with(axis.clone(), p)))
            .collect();
    }
    candidates
}

/// The logical shapes a tensor whose every rank holds `local` can have when the axes in `free`
/// of `guess` may change (see [`fitting_layouts`]): the guess's first, without repeats.
pub(crate) fn possible_logical_shapes(
    guess: &Layout,
    free: &[Axis],
    local: &[usize],
    mesh: &Mesh,
) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = vec![];
    for l in variants(guess, free, local.len(), mesh) {
        if let Some(s) = logical_shape(&l, local, mesh) {
            if local_shape(&l, &s, mesh).as_deref() == Some(local) && !out.contains(&s) {
                out.push(s);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Axis; 3] = Axis::MEGATRON;

    fn mesh(tp: usize, dp: usize) -> Mesh {
        Mesh::megatron(tp, 1, dp, false).unwrap()
    }

    fn lay(dp: Placement, tp: Placement) -> Layout {
        Layout::replicated()
            .with(Axis::DP, dp)
            .with(Axis::CP, Placement::Replicate)
            .with(Axis::TP, tp)
    }

    fn infer(
        g: &Layout,
        free: &[Axis],
        logical: &[usize],
        local: &[usize],
        m: &Mesh,
    ) -> Vec<Layout> {
        fitting_layouts(g, free, logical, local, m)
    }

    #[test]
    fn a_guess_that_fits_comes_first() {
        let g = lay(Placement::split(1), Placement::Replicate);
        assert_eq!(infer(&g, &ALL, &[8, 4, 16], &[8, 2, 16], &mesh(2, 2))[0], g);
    }

    #[test]
    fn a_sequence_shard_guessed_replicated_is_found_split() {
        // Megatron's sequence-parallel region: [s/tp, b, h] with the batch split over dp.
        let g = lay(Placement::split(1), Placement::Replicate);
        let want = lay(Placement::split(1), Placement::split(0));
        // The one-change explanation first; the other (dp and tp swapped) after it.
        let fits = infer(&g, &ALL, &[16, 4, 8], &[8, 2, 8], &mesh(2, 2));
        assert_eq!(
            fits,
            vec![want, lay(Placement::split(0), Placement::split(1))]
        );
        // Heads split inside attention: [b, heads/tp, s, s].
        let g = lay(Placement::Replicate, Placement::Replicate);
        let want = lay(Placement::Replicate, Placement::split(1));
        assert_eq!(
            infer(&g, &ALL, &[2, 8, 4, 4], &[2, 2, 4, 4], &mesh(4, 1)),
            vec![want]
        );
    }

    #[test]
    fn two_guessing_runs_meet_at_the_shapes_both_can_form() {
        // Heads inside attention, [b, heads/tp, s]: a TP 2 run holds [2, 4, 8], a TP 4 run
        // [2, 2, 8]; the logical [2, 8, 8] is the one shape both can form.
        let g = lay(Placement::Replicate, Placement::Replicate);
        let two = possible_logical_shapes(&g, &ALL, &[2, 4, 8], &mesh(2, 1));
        let four = possible_logical_shapes(&g, &ALL, &[2, 2, 8], &mesh(4, 1));
        // Replicated (the guess) first, then a split of each dimension; no repeats.
        assert_eq!(
            two,
            vec![vec![2, 4, 8], vec![4, 4, 8], vec![2, 8, 8], vec![2, 4, 16]]
        );
        assert_eq!(four[0], vec![2, 2, 8]);
        let both: Vec<&Vec<usize>> = two.iter().filter(|s| four.contains(s)).collect();
        assert_eq!(both, vec![&vec![2, 8, 8]]);
        // A dimension an axis cannot cut evenly under load-balanced chunks is not formed.
        let cp = Mesh::megatron(1, 2, 1, false).unwrap();
        let shapes = possible_logical_shapes(&Layout::replicated(), &[Axis::CP], &[3], &cp);
        assert_eq!(shapes, vec![vec![3], vec![6]]);
    }

    #[test]
    fn equal_sizes_in_two_dimensions_are_ambiguous() {
        // tp = dp = 2 and both dims halved: which axis cut which dimension cannot be told
        // from shapes — both assignments fit, equally far from a replicated guess.
        let g = lay(Placement::Replicate, Placement::Replicate);
        let fits = infer(&g, &ALL, &[4, 4], &[2, 2], &mesh(2, 2));
        assert_eq!(fits.len(), 2);
        assert!(fits.contains(&lay(Placement::split(0), Placement::split(1))));
        assert!(fits.contains(&lay(Placement::split(1), Placement::split(0))));
    }

    #[test]
    fn only_guessed_axes_change() {
        // Megatron's embedding under SP: tp declared as a split of the sequence (dim 1), the
        // batch (dim 0) guessed as dim 1 for dp. Both axes free: two one-change layouts fit;
        // dp alone free: one.
        let g = lay(Placement::split(1), Placement::split(1));
        assert_eq!(
            infer(&g, &ALL, &[2, 16, 8], &[1, 8, 8], &mesh(2, 2)).len(),
            2
        );
        let want = lay(Placement::split(0), Placement::split(1));
        assert_eq!(
            infer(&g, &[Axis::DP], &[2, 16, 8], &[1, 8, 8], &mesh(2, 2)),
            vec![want]
        );
        // A declared axis is never changed, even when nothing else fits.
        let g = lay(Placement::Replicate, Placement::split(2));
        assert!(infer(&g, &[Axis::DP], &[4, 8], &[2, 8], &mesh(2, 1)).is_empty());
    }

    #[test]
    fn context_parallel_chunks_and_a_second_cut_of_the_sequence_are_candidates() {
        // torchtitan: the sequence (dim 1) in load-balanced chunks along cp, each rank's
        // chunks cut again along tp by sequence parallelism; the batch split along dp.
        let m = Mesh::megatron(2, 2, 2, false).unwrap();
        let g = lay(Placement::split(0), Placement::split(1));
        let fits = infer(&g, &[Axis::DP, Axis::CP], &[4, 16, 8], &[2, 4, 8], &m);
        let chunks = g.clone().with(Axis::CP, Placement::CpChunks { dim: 1 });
        assert!(fits.contains(&chunks), "{fits:?}");
        assert!(fits.contains(&g.clone().with(Axis::CP, Placement::split(1))));
        // The nested cut is the one the merge undoes: shard then merge round-trips.
        let n = 4 * 16 * 8;
        let t = crate::tensor::Tensor::from_parts_unchecked(
            &[4, 16, 8],
            (0..n).map(|i| i as f64).collect(),
            crate::format::Format::F32,
        );
        let shards = crate::trace::layout::shard(&t, &chunks, &m, "x").unwrap();
        assert_eq!(shards[0].shape(), &[2, 4, 8]);
        // cp rank 0 holds chunks 0 and 3 of 4 (tokens 0..4 and 12..16); its tp rank 1 the
        // second half of those: tokens 12..16. cp rank 1, tp rank 0: tokens 4..8.
        let at = |cp, tp| m.rank(&[0, cp, tp]);
        assert_eq!(shards[at(0, 1)].values()[0], (12 * 8) as f64);
        assert_eq!(shards[at(1, 0)].values()[0], (4 * 8) as f64);
        // A cp axis that is not free keeps its guess.
        assert!(infer(&g, &[Axis::DP], &[4, 16, 8], &[2, 4, 8], &m).is_empty());
    }

    #[test]
    fn shapes_no_layout_explains_give_none() {
        let g = lay(Placement::Replicate, Placement::Replicate);
        assert!(infer(&g, &ALL, &[6, 4], &[5, 4], &mesh(2, 1)).is_empty());
        assert!(infer(&g, &ALL, &[6, 4], &[6, 4, 1], &mesh(2, 1)).is_empty());
        // A replicated-looking guess that fits stays (shapes cannot tell partial sums).
        assert_eq!(infer(&g, &ALL, &[6, 4], &[6, 4], &mesh(2, 1)), vec![g]);
    }

    #[test]
    fn logical_and_local_shapes_are_inverse() {
        let m = mesh(4, 2);
        let l = lay(Placement::split(1), Placement::Split { dim: 2, groups: 2 });
        let local = local_shape(&l, &[3, 8, 16], &m).unwrap();
        assert_eq!(local, vec![3, 4, 4]);
        assert_eq!(logical_shape(&l, &local, &m).unwrap(), vec![3, 8, 16]);
        // 16 / (2 groups × 4 parts) fits; 12 does not.
        assert!(local_shape(&l, &[3, 8, 12], &m).is_none());
    }
}
