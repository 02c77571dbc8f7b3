//! Fresh differences: where a sharded run's arithmetic differs from the reference's on the
//! *same* inputs, and by how much (per element, before the site's output rounding).
//!
//! A site is a traced tensor whose op reduces in another order on the mesh (see
//! `papers/sharding.md` §3):
//! * row-parallel forward outputs (`attn.proj`, `mlp.fc2`) and column-parallel input gradients
//!   (`attn.qkv`, `mlp.fc1`, `lm_head`) with tp > 1: K split over the TP ranks, partials
//!   rounded to the activation format and combined in it;
//! * parameter gradients whose token sum is split over ranks (DP×CP, and TP under sequence
//!   parallelism for replicated parameters), combined in the gradient format;
//! * the loss with dp·cp > 1;
//! * attention with cp > 1: outputs merged chunk by chunk in ring order, dQ/dK/dV accumulated
//!   per chunk / per query rank.
//!
//! Each element's difference ε = (candidate's value) − (reference's value), both before the
//! output rounding, is modelled with the reduction error model of `bounds::reduction`
//! (Higham–Mary uniform rounding, with the exact partial sums of the reference's data): the
//! reference's single reduction and the candidate's grouped reduction (each group's partial
//! reduced in the reference order, the partial rounded to the partial format, the partials
//! combined in ring order in the combine format) are independent executions, so
//! E ε² = Var_r + Var_c + (mean_c − mean_r)² + (tie bounds)². The result is E ε² per element.

use crate::shard::{ParallelStyle, ShardingPlan};
use std::collections::HashMap;

use crate::shard::collective::Algorithm;
use ttrace::__lab::random_rounding_error as reduction_error;
use ttrace::__lab::widest_of;
use ttrace::bounds::ReductionError;
use ttrace::engine::{Gpt, NormKind};
use ttrace::engine::{OpClass, Pass};
use ttrace::trace::ModuleKind;
use ttrace::trace::TensorId;
use ttrace::trace::Trace;
use ttrace::trace::{Axis, Mesh};
use ttrace::Format;
use ttrace::Policy;
use ttrace::Result;
use ttrace::{Accumulation, Order};

/// E ε² per element, by canonical id of the traced tensor.
pub type FreshSites = HashMap<String, Vec<f64>>;

fn rounding(fmt: Format, v: f64) -> ReductionError {
    if fmt.round(v, ttrace::Overflow::NonSaturating) == v {
        return ReductionError::default();
    }
    let ulp = fmt.ulp(v).unwrap_or(0.0);
    ReductionError {
        guaranteed: ulp / 2.0,
        mean: 0.0,
        variance: ulp * ulp / 12.0,
        tie_bound: 0.0,
    }
}

/// The candidate's grouped reduction of `groups` (each a list of exact terms): each group
/// reduced under `inner`, its result rounded to `partial`, the partials combined in
/// `combine` sequentially from group `start` (ring order), or as a balanced tree when `start`
/// is `None`.
fn grouped(
    groups: &[Vec<f64>],
    inner: &Accumulation,
    is_dot: bool,
    partial: Format,
    combine: Format,
    start: Option<usize>,
) -> Result<ReductionError> {
    let tree = start.is_none();
    let start = start.unwrap_or(0);
    let mut total = ReductionError::default();
    let mut partials = Vec::with_capacity(groups.len());
    let p = groups.len().max(1);
    for i in 0..groups.len() {
        let g = &groups[(start + i) % p];
        if g.is_empty() {
            partials.push(0.0);
            continue;
        }
        total = total.plus(reduction_error(g, inner, is_dot)?);
        let s: f64 = g.iter().sum();
        total = total.plus(rounding(partial, s));
        partials.push(s);
    }
    let order = if tree {
        Order::Pairwise { base: 1 }
    } else {
        Order::Sequential
    };
    let acc = Accumulation::new(partial, combine, order);
    Ok(total.plus(reduction_error(&partials, &acc, false)?))
}

/// E ε² of one element: the reference reduces `terms` (in order) under `reference`, the
/// candidate reduces the terms grouped by `owners` (group g: the terms owned by g, in order).
///
/// The leading run of terms owned by the first term's owner is reduced identically by both
/// sides when the order is sequential (same terms, same order, same format), so its rounding
/// errors are shared and cancel: its variance, counted once on each side, is removed twice.
#[allow(clippy::too_many_arguments)]
fn element(
    terms: &[f64],
    reference: &Accumulation,
    owners: &[usize],
    parts: usize,
    is_dot: bool,
    partial: Format,
    combine: Format,
    start: Option<usize>,
) -> Result<f64> {
    let groups = group_terms(owners, terms, parts);
    let er = reduction_error(terms, reference, is_dot)?;
    let ec = grouped(&groups, reference, is_dot, partial, combine, start)?;
    let mut var = er.variance + ec.variance;
    if reference.order == Order::Sequential && !owners.is_empty() {
        let lead = owners.iter().take_while(|&&o| o == owners[0]).count();
        if lead >= 2 {
            let shared = reduction_error(&terms[..lead], reference, is_dot)?;
            var = (var - 2.0 * shared.variance).max(0.0);
        }
    }
    Ok(var + (ec.mean - er.mean).powi(2) + (er.tie_bound + ec.tie_bound).powi(2))
}

/// E ε² of every element of C[rows, cols] = Σ_k A(t, k)·B(k, col) when the reduction over k
/// is split over `parts` ranks by `owners[k]`, partials and combine in `fmt`, the combine of
/// output element e in the ring order of its all-reduce chunk (`ring(start)`).
#[allow(clippy::too_many_arguments)]
fn split_k_site(
    (rows, cols, kdim): (usize, usize, usize),
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize) -> f64,
    owners: &[usize],
    parts: usize,
    acc: &Accumulation,
    fmt: Format,
    ring: &impl Fn(usize) -> Option<usize>,
) -> Result<Vec<f64>> {
    let chunk = (rows * cols).div_ceil(parts);
    let mut v = Vec::with_capacity(rows * cols);
    let mut terms = vec![0.0; kdim];
    for t in 0..rows {
        for col in 0..cols {
            for (k, tk) in terms.iter_mut().enumerate() {
                *tk = a(t, k) * b(k, col);
            }
            let e = (t * cols + col) / chunk;
            let start = ring((e + 1) % parts);
            v.push(element(&terms, acc, owners, parts, true, fmt, fmt, start)?);
        }
    }
    Ok(v)
}

fn acc_of(p: &Policy, input: Format) -> Accumulation {
    let mut a = p.accumulation.clone();
    a.input = input;
    a
}

/// Which rank groups the logical tokens (b, s) belong to.
struct Tokens {
    batch: usize,
    seq: usize,
    /// Owner group per token for a DP×CP reduction.
    dpcp: Vec<usize>,
    /// Owner group per token for a DP×CP×TP (sequence-parallel) reduction.
    all: Vec<usize>,
}

impl Tokens {
    fn new(batch: usize, seq: usize, mesh: &Mesh) -> Tokens {
        let bl = batch / mesh.size(&Axis::DP);
        let c = seq / (2 * mesh.size(&Axis::CP));
        let mut dpcp = vec![];
        let mut all = vec![];
        for b in 0..batch {
            for s in 0..seq {
                let chunk = s / c;
                let (ci, local) = if chunk < mesh.size(&Axis::CP) {
                    (chunk, s - chunk * c)
                } else {
                    (2 * mesh.size(&Axis::CP) - 1 - chunk, c + s - chunk * c)
                };
                let g = (b / bl) * mesh.size(&Axis::CP) + ci;
                let t = if mesh.sequence_parallel() {
                    local / (2 * c / mesh.size(&Axis::TP))
                } else {
                    0
                };
                dpcp.push(g);
                all.push(t * mesh.size(&Axis::DP) * mesh.size(&Axis::CP) + g);
            }
        }
        Tokens {
            batch,
            seq,
            dpcp,
            all,
        }
    }

    fn n(&self) -> usize {
        self.batch * self.seq
    }
}

/// Group `(owner, term)` pairs into `parts` lists (owner order, term order kept).
fn group_terms(owners: &[usize], terms: &[f64], parts: usize) -> Vec<Vec<f64>> {
    let mut g = vec![vec![]; parts];
    for (&o, &t) in owners.iter().zip(terms) {
        g[o].push(t);
    }
    g
}

/// The TP rank that owns output feature k of a column-parallel layer with `out` features in
/// `groups` interleaved groups.
fn column_owner(groups: usize, k: usize, out: usize, tp: usize) -> usize {
    let len = out / (groups * tp);
    (k % (out / groups)) / len
}

/// Every fresh site of `model` (its last step traced in `reference`) on `mesh`, its linears
/// split by `plan` ([`ShardedGpt::plan`](crate::shard::ShardedGpt::plan)).
pub fn fresh_sites(
    model: &Gpt,
    reference: &Trace,
    mesh: &Mesh,
    plan: &ShardingPlan,
    algorithm: Algorithm,
) -> Result<FreshSites> {
    let tree = algorithm == Algorithm::Tree;
    let ring = |s: usize| if tree { None } else { Some(s) };
    let cfg = model.config();
    let recipe = model.recipe();
    let act = recipe.activation_format;
    let gf = recipe.grad_format;
    let tokens = Tokens::new(cfg.batch, cfg.seq, mesh);
    let n_dpcp = mesh.size(&Axis::DP) * mesh.size(&Axis::CP);
    let n_all = n_dpcp * mesh.size(&Axis::TP);
    let mut sites = FreshSites::new();
    let tp = mesh.size(&Axis::TP);
    for m in model.modules() {
        let name = &m.name;
        // Parameter-gradient groups: replicated parameters under SP use every rank.
        let replicated_groups = |is_replicated: bool| -> (&Vec<usize>, usize) {
            if is_replicated && mesh.sequence_parallel() {
                (&tokens.all, n_all)
            } else {
                (&tokens.dpcp, n_dpcp)
            }
        };
        match m.kind {
            ModuleKind::Linear => {
                let style = plan.linear_style(name);
                let row = style == ParallelStyle::Rowwise;
                let groups = match style {
                    ParallelStyle::Colwise { groups } => groups,
                    ParallelStyle::Rowwise => 1,
                };
                let x = reference.require(&TensorId::fwd_input(name, 0).to_string())?;
                let g = reference.require(&TensorId::grad_output(name, 0).to_string())?;
                let w = model.param(&m.params[0])?;
                let (out, inp) = (w.shape()[0], w.shape()[1]);
                let rows = x.len() / inp;
                let (xv, gv, wv) = (x.values(), g.values(), w.values());
                let fwd = recipe.policy(OpClass::Matmul, Pass::Forward);
                let dg = recipe.policy(OpClass::MatmulGradInput, Pass::Backward);
                let wg = recipe.policy(OpClass::MatmulGradWeight, Pass::Backward);
                if tp > 1 && row {
                    // y_tj = Σ_k x_tk W_jk, K split contiguously over TP.
                    let owners: Vec<usize> = (0..inp).map(|k| k / (inp / tp)).collect();
                    let v = split_k_site(
                        (rows, out, inp),
                        |t, k| xv[t * inp + k],
                        |k, j| wv[j * inp + k],
                        &owners,
                        tp,
                        &acc_of(fwd, fwd.input()),
                        act,
                        &ring,
                    )?;
                    // The bias: the reference adds it inside its accumulation, the candidate
                    // after the all-reduce — one rounding in the accumulator format on each
                    // side, at slightly different points: counted as two independent ones.
                    let v = if m.params.len() > 1 {
                        let y = reference.require(&TensorId::fwd_output(name, 0).to_string())?;
                        let a = fwd.accumulator();
                        v.iter()
                            .zip(y.values())
                            .map(|(&e2, &yv)| {
                                let ulp = a.ulp(yv).unwrap_or(0.0);
                                e2 + ulp * ulp / 6.0
                            })
                            .collect()
                    } else {
                        v
                    };
                    sites.insert(TensorId::fwd_output(name, 0).to_string(), v);
                }
                if tp > 1 && !row {
                    // dx_tk = Σ_j g_tj W_jk, the out features split over TP.
                    let owners: Vec<usize> =
                        (0..out).map(|j| column_owner(groups, j, out, tp)).collect();
                    let v = split_k_site(
                        (rows, inp, out),
                        |t, j| gv[t * out + j],
                        |j, k| wv[j * inp + k],
                        &owners,
                        tp,
                        &acc_of(dg, dg.input()),
                        act,
                        &ring,
                    )?;
                    sites.insert(TensorId::grad_input(name, 0).to_string(), v);
                }
                if n_dpcp > 1 {
                    // dW_jk = Σ_t g_tj x_tk over tokens split over DP×CP.
                    let acc = acc_of(wg, wg.input());
                    let mut v = Vec::with_capacity(out * inp);
                    let mut terms = vec![0.0; rows];
                    for j in 0..out {
                        for k in 0..inp {
                            for (t, tt) in terms.iter_mut().enumerate() {
                                *tt = gv[t * out + j] * xv[t * inp + k];
                            }
                            v.push(element(
                                &terms,
                                &acc,
                                &tokens.dpcp,
                                n_dpcp,
                                true,
                                gf,
                                gf,
                                ring(1),
                            )?);
                        }
                    }
                    sites.insert(TensorId::param_grad(&m.params[0]).to_string(), v);
                }
                if let Some(bias) = m.params.get(1) {
                    let (owners, parts) = replicated_groups(row);
                    if parts > 1 {
                        let acc = acc_of(wg, g.format());
                        let mut v = Vec::with_capacity(out);
                        let mut terms = vec![0.0; rows];
                        for j in 0..out {
                            for (t, tt) in terms.iter_mut().enumerate() {
                                *tt = gv[t * out + j];
                            }
                            v.push(element(
                                &terms,
                                &acc,
                                owners,
                                parts,
                                false,
                                gf,
                                gf,
                                ring(1),
                            )?);
                        }
                        sites.insert(TensorId::param_grad(bias).to_string(), v);
                    }
                }
            }
            ModuleKind::Norm => {
                let (owners, parts) = replicated_groups(true);
                if parts == 1 {
                    continue;
                }
                let x = reference.require(&TensorId::fwd_input(name, 0).to_string())?;
                let g = reference.require(&TensorId::grad_output(name, 0).to_string())?;
                let h = cfg.hidden;
                let rows = x.len() / h;
                // x̂ in f64.
                let mut xhat = vec![0.0; x.len()];
                for r in 0..rows {
                    let row = &x.values()[r * h..(r + 1) * h];
                    let mean = if cfg.norm == NormKind::LayerNorm {
                        row.iter().sum::<f64>() / h as f64
                    } else {
                        0.0
                    };
                    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / h as f64;
                    let inv = 1.0 / (var + cfg.norm_eps).sqrt();
                    for i in 0..h {
                        xhat[r * h + i] = (row[i] - mean) * inv;
                    }
                }
                let p = recipe.policy(OpClass::Norm, Pass::Backward);
                let acc = acc_of(p, p.accumulator());
                let mut vw = Vec::with_capacity(h);
                let mut vb = Vec::with_capacity(h);
                let mut tw = vec![0.0; rows];
                let mut tb = vec![0.0; rows];
                for i in 0..h {
                    for r in 0..rows {
                        tb[r] = g.values()[r * h + i];
                        tw[r] = tb[r] * xhat[r * h + i];
                    }
                    vw.push(element(&tw, &acc, owners, parts, false, gf, gf, ring(1))?);
                    vb.push(element(&tb, &acc, owners, parts, false, gf, gf, ring(1))?);
                }
                sites.insert(TensorId::param_grad(&m.params[0]).to_string(), vw);
                if let Some(b) = m.params.get(1) {
                    sites.insert(TensorId::param_grad(b).to_string(), vb);
                }
            }
            ModuleKind::Embedding => {
                let (owners, parts) = replicated_groups(true);
                if parts == 1 {
                    continue;
                }
                let g = reference.require(&TensorId::grad_output(name, 0).to_string())?;
                let h = cfg.hidden;
                let p = recipe.policy(OpClass::Elementwise, Pass::Backward);
                let acc = acc_of(p, p.input());
                let ids = model.tokens();
                let mut vte = vec![0.0; cfg.vocab * h];
                for v in 0..cfg.vocab {
                    let pos: Vec<usize> = (0..tokens.n()).filter(|&t| ids[t] == v).collect();
                    if pos.len() < 2 {
                        continue;
                    }
                    let own: Vec<usize> = pos.iter().map(|&t| owners[t]).collect();
                    for i in 0..h {
                        let terms: Vec<f64> = pos.iter().map(|&t| g.values()[t * h + i]).collect();
                        vte[v * h + i] =
                            element(&terms, &acc, &own, parts, false, gf, gf, ring(1))?;
                    }
                }
                sites.insert(TensorId::param_grad(&m.params[0]).to_string(), vte);
                let mut vpe = vec![0.0; cfg.seq * h];
                for s in 0..cfg.seq {
                    let pos: Vec<usize> = (0..cfg.batch).map(|b| b * cfg.seq + s).collect();
                    let own: Vec<usize> = pos.iter().map(|&t| owners[t]).collect();
                    for i in 0..h {
                        let terms: Vec<f64> = pos.iter().map(|&t| g.values()[t * h + i]).collect();
                        vpe[s * h + i] =
                            element(&terms, &acc, &own, parts, false, gf, gf, ring(1))?;
                    }
                }
                sites.insert(TensorId::param_grad(&m.params[1]).to_string(), vpe);
            }
            ModuleKind::Loss if n_dpcp > 1 => {
                let z = reference.require(&TensorId::fwd_input(name, 0).to_string())?;
                let v = cfg.vocab;
                let n = tokens.n();
                let terms: Vec<f64> = (0..n)
                    .map(|t| {
                        let row = &z.values()[t * v..(t + 1) * v];
                        let mx = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                        let lse = mx + row.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
                        (lse - row[model.targets()[t]]) / n as f64
                    })
                    .collect();
                let p = recipe.policy(OpClass::Loss, Pass::Forward);
                let acc = acc_of(p, p.accumulator());
                let a = p.accumulator();
                sites.insert(
                    TensorId::fwd_output(name, 0).to_string(),
                    vec![element(
                        &terms,
                        &acc,
                        &tokens.dpcp,
                        n_dpcp,
                        false,
                        a,
                        p.output,
                        ring(1),
                    )?],
                );
            }
            ModuleKind::Attention if mesh.size(&Axis::CP) > 1 => {
                attention_sites(model, reference, mesh, name, &mut sites)?;
            }
            _ => {}
        }
    }
    Ok(sites)
}

/// Variance factor (in units of u²/3) of one side's block merges: `order` lists the visible
/// blocks in merge order; `w[B]` is block B's share of the softmax denominator and `o[B]` its
/// normalized partial output. Each merge rounds l·α, l_B·β and their sum (and the same three
/// for o); α and β multiply o and l alike, so their own roundings cancel in o/l.
fn merge_variance(order: &[usize], w: &[f64], o: &[f64]) -> (f64, f64) {
    let (mut wl, mut ol) = (0.0, 0.0);
    let (mut vl, mut vo) = (0.0, 0.0);
    for (k, &bk) in order.iter().enumerate() {
        if k > 0 {
            vl += wl * wl + w[bk] * w[bk] + (wl + w[bk]) * (wl + w[bk]);
            vo += ol * ol + o[bk] * o[bk] + (ol + o[bk]) * (ol + o[bk]);
        }
        wl += w[bk];
        ol += o[bk];
    }
    (vl, vo)
}

/// E of the square of a Gaussian difference of standard deviation `s` after both sides round
/// onto a grid of spacing `ulp` (uniform phase): s² + ulp·E|ε| bounds it (E|ε| = s·√(2/π)).
fn rounded_var(s: f64, ulp: f64) -> f64 {
    s * s + ulp * s * (2.0 / std::f64::consts::PI).sqrt()
}

/// Context-parallel attention (papers/sharding.md §3.4). Per (batch, head, query row), with
/// exact P in f64:
/// * forward: both sides merge the same block partials (m_B, l_B, O_B — computed identically)
///   in different orders, so only the merge roundings differ ([`merge_variance`], both
///   sides) plus the final division; the log-sum-exp inherits the denominator's error;
/// * backward: P = fl_I(exp(S − lse)) flips where lse differs; c = Σ P·dP is reduced per chunk
///   then combined (order difference) and moves with P; dS = fl_I(P(dP − c)·scale) inherits
///   both and flips on its grid; dQ (by key chunk), dK and dV (by query rank) are grouped
///   reductions plus what dS and P carry in.
fn attention_sites(
    model: &Gpt,
    reference: &Trace,
    mesh: &Mesh,
    name: &str,
    sites: &mut FreshSites,
) -> Result<()> {
    let cfg = model.config();
    let recipe = model.recipe();
    let pf = recipe.policy(OpClass::Softmax, Pass::Forward);
    let pb = recipe.policy(OpClass::Softmax, Pass::Backward);
    let a = pf.accumulator();
    let u2 = a.unit_roundoff().powi(2) / 3.0;
    let fin = pf.input();
    let gin = pb.input();
    let qkv = reference.require(&TensorId::fwd_input(name, 0).to_string())?;
    let dout = reference.require(&TensorId::grad_output(name, 0).to_string())?;
    let (b_n, s_n, h) = (cfg.batch, cfg.seq, cfg.hidden);
    let heads = cfg.heads;
    let d = h / heads;
    let cp = mesh.size(&Axis::CP);
    let c = s_n / (2 * cp);
    let nb = 2 * cp;
    let qrank_of = |s: usize| {
        let ch = s / c;
        if ch < cp {
            ch
        } else {
            2 * cp - 1 - ch
        }
    };
    let ring_blocks = |r: usize| -> Vec<usize> {
        (0..cp)
            .flat_map(|st| {
                let src = (r + cp - st) % cp;
                [src, 2 * cp - 1 - src]
            })
            .collect()
    };
    let scale = 1.0 / (d as f64).sqrt();
    let acc_b = acc_of(pb, widest_of(gin, fin));
    let acc_a = acc_of(pb, widest_of(fin, a));
    let mut vo = vec![0.0; b_n * s_n * h];
    let mut vd = vec![0.0; b_n * s_n * 3 * h];
    let at = |b: usize, s: usize, w: usize, hh: usize, j: usize| {
        qkv.values()[(b * s_n + s) * 3 * h + w * h + hh * d + j]
    };
    let key_chunks: Vec<usize> = (0..s_n).map(|j| j / c).collect();
    let q_ranks: Vec<usize> = (0..s_n).map(qrank_of).collect();
    let ulp = |f: Format, v: f64| f.ulp(v).unwrap_or(0.0);
    for b in 0..b_n {
        for hh in 0..heads {
            let go = |i: usize, t: usize| dout.values()[(b * s_n + i) * h + hh * d + t];
            let mut p = vec![0.0; s_n * s_n];
            let mut var_lse = vec![0.0; s_n];
            for i in 0..s_n {
                let sc: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..d)
                            .map(|t| at(b, i, 0, hh, t) * at(b, j, 1, hh, t))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let mx = sc.iter().fold(f64::NEG_INFINITY, |x, &y| x.max(y));
                let l: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                for j in 0..=i {
                    p[i * s_n + j] = (sc[j] - mx).exp() / l;
                }
                let lse = mx + l.ln();
                // Block shares and partial outputs.
                let mut w = vec![0.0; nb];
                for j in 0..=i {
                    w[j / c] += p[i * s_n + j];
                }
                let visible = |order: Vec<usize>| -> Vec<usize> {
                    order.into_iter().filter(|&bk| bk * c <= i).collect()
                };
                let ref_order = visible((0..nb).collect());
                let cand_order = visible(ring_blocks(qrank_of(i)));
                let (vl_r, _) = merge_variance(&ref_order, &w, &w);
                let (vl_c, _) = merge_variance(&cand_order, &w, &w);
                let vl = vl_r + vl_c;
                var_lse[i] = u2 * (vl + 2.0 * (l.ln().powi(2) + lse * lse));
                for t in 0..d {
                    let mut o = vec![0.0; nb];
                    for j in 0..=i {
                        o[j / c] += p[i * s_n + j] * at(b, j, 2, hh, t);
                    }
                    let out: f64 = o.iter().sum();
                    let (_, vo_r) = merge_variance(&ref_order, &w, &o);
                    let (_, vo_c) = merge_variance(&cand_order, &w, &o);
                    vo[(b * s_n + i) * h + hh * d + t] =
                        u2 * (vo_r + vo_c + out * out * vl + 2.0 * out * out);
                }
            }
            // Backward.
            let mut var_p = vec![0.0; s_n * s_n];
            let mut var_ds = vec![0.0; s_n * s_n];
            let mut ds = vec![0.0; s_n * s_n];
            for i in 0..s_n {
                let dp: Vec<f64> = (0..s_n)
                    .map(|j| (0..d).map(|t| go(i, t) * at(b, j, 2, hh, t)).sum())
                    .collect();
                let sl = var_lse[i].sqrt();
                for j in 0..=i {
                    let pij = p[i * s_n + j];
                    var_p[i * s_n + j] = rounded_var(pij * sl, ulp(fin, pij));
                }
                let terms: Vec<f64> = (0..s_n).map(|j| p[i * s_n + j] * dp[j]).collect();
                let ci: f64 = terms.iter().sum();
                let var_c = element(
                    &terms,
                    &acc_a,
                    &key_chunks,
                    nb,
                    true,
                    a,
                    a,
                    Some(qrank_of(i)),
                )? + (0..s_n)
                    .map(|j| var_p[i * s_n + j] * dp[j] * dp[j])
                    .sum::<f64>();
                for j in 0..=i {
                    let pij = p[i * s_n + j];
                    let x = pij * (dp[j] - ci) * scale;
                    ds[i * s_n + j] = x;
                    let pre = scale
                        * scale
                        * (var_p[i * s_n + j] * (dp[j] - ci).powi(2) + pij * pij * var_c);
                    var_ds[i * s_n + j] = rounded_var(pre.sqrt(), ulp(gin, x));
                }
            }
            for i in 0..s_n {
                let start = Some(qrank_of(i));
                for t in 0..d {
                    // dQ_it = Σ_j dS_ij k_jt, grouped by key chunk.
                    let terms: Vec<f64> = (0..s_n)
                        .map(|j| ds[i * s_n + j] * at(b, j, 1, hh, t))
                        .collect();
                    let carried: f64 = (0..s_n)
                        .map(|j| var_ds[i * s_n + j] * at(b, j, 1, hh, t).powi(2))
                        .sum();
                    vd[(b * s_n + i) * 3 * h + hh * d + t] =
                        element(&terms, &acc_b, &key_chunks, nb, true, a, a, start)? + carried;
                    // dK_it = Σ_q dS_qi q_qt and dV_it = Σ_q P_qi dO_qt, grouped by query rank.
                    let terms: Vec<f64> = (0..s_n)
                        .map(|q| ds[q * s_n + i] * at(b, q, 0, hh, t))
                        .collect();
                    let carried: f64 = (0..s_n)
                        .map(|q| var_ds[q * s_n + i] * at(b, q, 0, hh, t).powi(2))
                        .sum();
                    vd[(b * s_n + i) * 3 * h + h + hh * d + t] =
                        element(&terms, &acc_b, &q_ranks, cp, true, a, a, start)? + carried;
                    let terms: Vec<f64> = (0..s_n).map(|q| p[q * s_n + i] * go(q, t)).collect();
                    let carried: f64 = (0..s_n)
                        .map(|q| var_p[q * s_n + i] * go(q, t).powi(2))
                        .sum();
                    vd[(b * s_n + i) * 3 * h + 2 * h + hh * d + t] =
                        element(&terms, &acc_b, &q_ranks, cp, true, a, a, start)? + carried;
                }
            }
        }
    }
    sites.insert(TensorId::fwd_output(name, 0).to_string(), vo);
    sites.insert(TensorId::grad_input(name, 0).to_string(), vd);
    Ok(())
}

/// Local thresholds for the localizer: for every fresh site of `reference`, a bound on
/// ‖cand − ref‖_F of that tensor when the module runs on the reference's own inputs — the
/// site's own difference only. Per element: a sub-Gaussian part with proxy E ε² (capped at
/// 8σ as its high-probability size), then, where the tensor's format is narrower than FP32,
/// both sides rounding nearly equal values to it (`ElementDiff::round_both`); combined with
/// `bounds::tensor_threshold` at `confidence`. Tensors without a fresh site are absent
/// (threshold 0: they must be bit-identical).
pub fn local_thresholds(
    sites: &FreshSites,
    reference: &Trace,
    confidence: ttrace::bounds::Confidence,
) -> Result<HashMap<String, f64>> {
    use ttrace::bounds::{tensor_threshold, ElementDiff};
    let mut out = HashMap::new();
    for (id, var) in sites {
        let r = reference.require(id)?;
        let fmt = r.format();
        let narrow = fmt.is_subset_of(Format::F32) && fmt != Format::F32;
        let diffs: Vec<ElementDiff> = var
            .iter()
            .zip(r.values())
            .filter(|(&v, _)| v > 0.0)
            .map(|(&v, &x)| {
                let mut d = ElementDiff {
                    proxy: v,
                    guaranteed: 8.0 * v.sqrt(),
                    ..ElementDiff::default()
                };
                if narrow {
                    d.round_both(fmt, x.abs());
                }
                d
            })
            .collect();
        let norm = r.values().iter().map(|x| x * x).sum::<f64>().sqrt();
        out.insert(
            id.clone(),
            tensor_threshold(&diffs, norm, confidence).abs_frobenius,
        );
    }
    Ok(out)
}
