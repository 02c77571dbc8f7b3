//! Attention cores priced through the op registry's `attention` op instead of the local model's
//! gain allowance (`papers/checking.md` §8).
//!
//! A traced `scaled_dot_product_attention` call whose manifest entry names the op
//! (`"op": "attention"` or `"attention:causal"`: no mask, no dropout, the default scale) has
//! both runs' queries, keys and values in the traces. Its output's difference is then split
//! into two parts, each priced without an allowance:
//!
//! * **carried**: ‖A(q_c, k_c, v_c) − A(q_r, k_r, v_r)‖_F, A the exact attention computed in
//!   f64 from each run's stored inputs (`bounds::attention::exact_attention`) — *measured*,
//!   not bounded by κ·Σρ(x);
//! * **own**: each run's rounding of A on its inputs, priced by the attention op on the
//!   reference's inputs with both runs' arithmetic (`attention_threshold`; the inputs in
//!   their stored format, or the autocast dtype where it is coarser, accumulation in FP32, the
//!   output rounded to its stored format). The kernel's order is unknown, so both sides are
//!   priced as online (flash) attention over small key blocks, 16 and 32 keys: more roundings
//!   than a standard or a larger-block kernel does (the op's terms grow with the blocks), and
//!   two different forms, so the op prices two independent roundings rather than identical
//!   arithmetic. Every head's rows join one tensor threshold (`ThresholdSums`: each row a
//!   cluster, as within a head), the heads' roundings being independent of each other.
//!
//! The threshold is carried + own (the triangle inequality: candidate − reference = ΔA +
//! err_c − err_r). Where the model does not apply, the caller keeps the local model: a mask
//! or a fourth input, context parallelism (the keys split over ranks are merged by the
//! engine's own rescaling), inputs that do not merge or differ in shape or format between the
//! runs, an FP64 run (the op's accumulator is FP32 at finest), non-finite inputs, or more
//! than [`WORK_LIMIT`] multiply-adds.

use crate::bounds::attention::{add_head, exact_attention};
use crate::bounds::compare::ThresholdSums;
use crate::bounds::{Confidence, Op, OpSide};
use crate::check::price::OpMeasure;
use crate::format::Format;
use crate::io::TraceDir;
use crate::tensor::Tensor;
use crate::trace::id::{TensorId, TensorRole};
use crate::trace::{Axis, Placement};

/// The most multiply-adds (heads · queries · keys · (head dimension + value dimension), both
/// runs together) an attention site is priced through the op with: beyond it the local model
/// prices it. The op's threshold costs about ten times the exact attention (every output
/// element visits its row's keys for both runs' roundings): at this limit a few seconds of one
/// core per site (one head of 1,024 tokens and dimension 64 is 2.7·10⁸ and took 2.7 s on a
/// loaded 2-core machine, 2026-11-29).
pub const WORK_LIMIT: f64 = 4e8;

/// One run's queries, keys and values of a site, decoded.
struct Operands {
    q: Tensor,
    k: Tensor,
    v: Tensor,
}

/// The op measure of the attention output `id` (`{site}|fwd.output.0` whose module names an
/// attention op), or `None` where the op does not apply (module docs); `delta` is the check's
/// per-tensor failure probability.
pub(crate) fn measure(
    reference: &mut TraceDir,
    candidate: &mut TraceDir,
    id: &str,
    delta: f64,
) -> Option<OpMeasure> {
    let t = TensorId::parse(id)?;
    if t.role != TensorRole::FwdOutput(0) {
        return None;
    }
    let info = reference.module(id)?;
    let causal = match info.op? {
        Op::Attention { causal } => causal,
        _ => return None,
    };
    // The reference's op: the candidate is judged against it (a candidate that called the
    // attention with another scale or a mask computes another op — a finding, not a reason to
    // price it otherwise). Of the candidate's entry only its autocast is read.
    // The kernel's formats: the autocast dtype where coarser than the stored one (the op is on
    // autocast's lower-precision list), FP32 accumulation.
    let autocast = [
        info.arith.autocast,
        candidate.module(id).and_then(|m| m.arith.autocast),
    ]
    .into_iter()
    .flatten()
    .min_by_key(|f| f.precision());
    let ids: Vec<String> = (0..4)
        .map(|i| format!("{}|fwd.input.{i}", t.module))
        .collect();
    if reference.contains(&ids[3]) || !ids[..3].iter().all(|i| reference.contains(i)) {
        return None;
    }
    // Context parallelism splits the keys: the engine merges partial attentions itself.
    let mesh = candidate.mesh_of(id).clone();
    if mesh.size(&Axis::CP) > 1
        && ids[..3].iter().chain([&id.to_string()]).any(|i| {
            candidate
                .layout(i)
                .is_some_and(|l| l.along(&Axis::CP) != Placement::Replicate)
        })
    {
        return None;
    }
    // The heads and the work, from the shapes alone: a site beyond the limit is not read.
    let shapes: Vec<Vec<usize>> = ids[..3]
        .iter()
        .map(|i| reference.logical_shape(i))
        .collect::<Option<_>>()?;
    let heads = Heads::of(&shapes[0], &shapes[1], &shapes[2])?;
    if heads.work() * 2.0 > WORK_LIMIT || heads.n == 0 {
        return None;
    }
    let read = |dir: &mut TraceDir| -> Option<(Operands, Format)> {
        let mut got = Vec::with_capacity(3);
        let mut formats = Vec::with_capacity(3);
        for i in &ids[..3] {
            formats.push(dir.dtype(i)?);
            got.push(dir.logical(i).ok()?);
        }
        if formats.iter().any(|f| *f != formats[0]) {
            return None;
        }
        let v = got.pop()?;
        let k = got.pop()?;
        let q = got.pop()?;
        Some((Operands { q, k, v }, formats[0]))
    };
    let (r, r_format) = read(reference)?;
    let (c, c_format) = read(candidate)?;
    let out_format = reference.dtype(id)?;
    if r_format != c_format || candidate.dtype(id) != Some(out_format) {
        return None;
    }
    let fits = |o: &Operands| {
        [&o.q, &o.k, &o.v]
            .iter()
            .zip(&shapes)
            .all(|(t, s)| t.shape() == s)
    };
    if !fits(&r) || !fits(&c) {
        return None;
    }
    let coarsest = |f: Format| match autocast {
        Some(a) if a.precision() < f.precision() => a,
        _ => f,
    };
    let (input, output) = (coarsest(r_format), coarsest(out_format));
    if input.precision() > Format::F32.precision() || output.precision() > Format::F32.precision() {
        return None;
    }
    let side = |block: usize| -> Option<OpSide> {
        format!("in={input},acc=f32,out={output},form=online:{block}")
            .parse()
            .ok()
    };
    let (rs, cs) = (side(32)?, side(16)?);
    let confidence = Confidence::probabilistic(delta).ok()?;
    let mut sums = ThresholdSums::new(confidence, heads.count * heads.m * heads.dv);
    let (mut carried2, mut norm2) = (0.0f64, 0.0f64);
    for h in 0..heads.count {
        let (qr, kr, vr) = heads.slices(h, &r);
        let (qc, kc, vc) = heads.slices(h, &c);
        let sizes = ((heads.m, heads.n), (heads.d, heads.dv));
        let or = exact_attention(qr, kr, vr, sizes.0, sizes.1, causal);
        let oc = exact_attention(qc, kc, vc, sizes.0, sizes.1, causal);
        carried2 += or
            .iter()
            .zip(&oc)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f64>();
        let tensor = |x: &[f64], rows: usize, cols: usize| {
            Tensor::from_vec(&[rows, cols], x.to_vec(), r_format).ok()
        };
        let (norm, _) = add_head(
            &tensor(qr, heads.m, heads.d)?,
            &tensor(kr, heads.n, heads.d)?,
            &tensor(vr, heads.n, heads.dv)?,
            causal,
            (&rs, &cs),
            &mut sums,
        )
        .ok()?;
        norm2 += norm * norm;
    }
    let m = OpMeasure {
        carried: carried2.sqrt(),
        own: sums.threshold(norm2.sqrt()).abs_frobenius,
    };
    (m.carried.is_finite() && m.own.is_finite()).then_some(m)
}

/// How a site's [..., m, d] queries, [..., n, d] keys and [..., n, dv] values split into
/// heads: leading dimensions equal, but for grouped-query attention the heads dimension
/// (third from last) of the keys and values, which divides the queries' (torch's
/// `enable_gqa`: query head h reads key head h / (Hq / Hk)).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Heads {
    /// Query heads (the product of the leading dimensions).
    count: usize,
    /// Query heads per key head.
    group: usize,
    m: usize,
    n: usize,
    d: usize,
    dv: usize,
}

impl Heads {
    fn of(q: &[usize], k: &[usize], v: &[usize]) -> Option<Heads> {
        let r = q.len();
        if r < 2 || k.len() != r || v.len() != r {
            return None;
        }
        let (m, d, n, dv) = (q[r - 2], q[r - 1], k[r - 2], v[r - 1]);
        if k[r - 1] != d || v[r - 2] != n || d == 0 {
            return None;
        }
        // Keys and values agree on every leading dimension; the queries on all but the heads.
        if k[..r - 2] != v[..r - 2] {
            return None;
        }
        let group = if r >= 3 {
            let (hq, hk) = (q[r - 3], k[r - 3]);
            if hk == 0 || hq % hk != 0 || q[..r - 3] != k[..r - 3] {
                return None;
            }
            hq / hk
        } else {
            1
        };
        Some(Heads {
            count: q[..r - 2].iter().product(),
            group,
            m,
            n,
            d,
            dv,
        })
    }

    /// Multiply-adds of one run's exact attention: scores and P·V.
    fn work(&self) -> f64 {
        self.count as f64 * self.m as f64 * self.n as f64 * (self.d + self.dv) as f64
    }

    /// Query head `h`'s q, and the k and v of the key head it reads.
    fn slices<'a>(&self, h: usize, o: &'a Operands) -> (&'a [f64], &'a [f64], &'a [f64]) {
        let g = h / self.group;
        let (qs, ks, vs) = (self.m * self.d, self.n * self.d, self.n * self.dv);
        (
            &o.q.values()[h * qs..(h + 1) * qs],
            &o.k.values()[g * ks..(g + 1) * ks],
            &o.v.values()[g * vs..(g + 1) * vs],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_read_grouped_keys_and_refuse_shapes_that_do_not_fit() {
        // [batch 2, 4 query heads, 8 tokens, 16] against 2 key heads.
        let h = Heads::of(&[2, 4, 8, 16], &[2, 2, 8, 16], &[2, 2, 8, 4]).unwrap();
        assert_eq!((h.count, h.group, h.m, h.n, h.d, h.dv), (8, 2, 8, 8, 16, 4));
        // Key heads that do not divide the query heads, a head dimension that differs, a
        // batch that differs.
        assert!(Heads::of(&[2, 4, 8, 16], &[2, 3, 8, 16], &[2, 3, 8, 16]).is_none());
        assert!(Heads::of(&[2, 4, 8, 16], &[2, 4, 8, 8], &[2, 4, 8, 16]).is_none());
        assert!(Heads::of(&[2, 4, 8, 16], &[1, 4, 8, 16], &[1, 4, 8, 16]).is_none());
        assert!(Heads::of(&[8], &[8], &[8]).is_none());
    }

    #[test]
    fn the_work_counts_both_products_per_head_and_a_long_head_is_beyond_the_limit() {
        let h = Heads::of(&[2, 4, 8, 16], &[2, 2, 8, 16], &[2, 2, 8, 4]).unwrap();
        // 8 query heads × 8 queries × 8 keys × (16 + 4).
        assert_eq!(h.work(), 8.0 * 8.0 * 8.0 * 20.0);
        // One head of 4,096 tokens and dimension 16, both runs: 1.07e9 > the limit; 1,024
        // tokens: 6.7e7, priced.
        let long = Heads::of(&[1, 1, 4096, 16], &[1, 1, 4096, 16], &[1, 1, 4096, 16]).unwrap();
        assert!(2.0 * long.work() > WORK_LIMIT);
        let short = Heads::of(&[1, 1, 1024, 16], &[1, 1, 1024, 16], &[1, 1, 1024, 16]).unwrap();
        assert!(2.0 * short.work() <= WORK_LIMIT);
    }
}
