//! Context-parallel ring attention, forward and backward, with the engine's arithmetic.
//!
//! Each of the `cp` ranks of a context-parallel group holds the QKV rows of two sequence chunks
//! (chunk i and 2·cp − 1 − i of 2·cp, the load-balanced order). KV blocks travel around the
//! ring: at step s rank i processes the keys of rank (i − s) mod cp, chunk by chunk (and in key
//! blocks of `block` within a chunk), with the causal mask evaluated on global positions.
//!
//! Every per-block quantity is computed exactly as the engine's online attention
//! ([`AttentionImpl::Online`](ttrace::engine::AttentionImpl)) computes it for the same block —
//! scores, block max, exponentials, block sums, block outputs — and blocks are merged with the
//! same rescaling arithmetic, so with a reference that runs online attention with the chunk as
//! its block, **only the order of the merges differs**.
//!
//! Backward (two passes over the ring, so that the quantities are the reference's):
//! 1. P = fl_I(exp(S − lse)) recomputed per block, dP = dO·Vᵀ, and cᵢ = Σ_blocks dot(Pᵢ, dPᵢ)
//!    with one partial dot per chunk, the partials added in ring order in A (the reference
//!    takes one dot over the whole row);
//! 2. dS = fl_I(P ∘ (dP − c) · scale); dQ accumulated over the chunks in ring order in A (one
//!    partial dot per chunk); dK and dV of a chunk are partial dots over each query rank's rows,
//!    accumulated in A as the block travels home (owner first, then the next ranks), then
//!    rounded to the output format.

use ttrace::__lab::Arith;
use ttrace::__lab::{forward_arith, split_heads, widest_of, OnlineArith, OnlineRow};
use ttrace::Format;
use ttrace::Policy;
use ttrace::Tensor;
use ttrace::{__lab::dot_unchecked, Accumulation};
use ttrace::{Error, Result};

/// Deviations from correct ring attention, for the bug catalog ([`crate::bugs::Bug`]). The
/// default is correct ring attention.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RingOptions {
    /// Score scale (`None`: ra(1/√d)).
    pub scale: Option<f64>,
    /// Evaluate the causal mask as if rank i held the contiguous chunks 2i and 2i + 1.
    pub contiguous_positions: bool,
    /// Added to the log-sum-exp when the backward recomputes P for remote key blocks.
    pub remote_lse_offset: f64,
    /// The backward uses the rank's own K and V for remote steps of the ring.
    pub stale_kv: bool,
}

/// What the ring backward needs.
#[derive(Debug, Clone)]
pub struct RingSaved {
    cp: usize,
    batch: usize,
    /// Local rows per rank (2 chunks).
    rows: usize,
    heads: usize,
    d: usize,
    /// Per rank, per (batch, head): Q, K, V [rows, d] in the input format.
    q: Vec<Vec<Vec<f64>>>,
    k: Vec<Vec<Vec<f64>>>,
    v: Vec<Vec<Vec<f64>>>,
    /// Per rank, per (batch, head): lse of each local row.
    lse: Vec<Vec<Vec<f64>>>,
    input: Format,
    scale: f64,
    options: RingOptions,
}

/// Global position of local row `r` of CP rank `i` (chunks of `c` rows); with `contiguous`
/// (a bug) as if rank i held chunks 2i and 2i + 1.
fn position(i: usize, r: usize, c: usize, cp: usize, contiguous: bool) -> usize {
    if contiguous {
        i * 2 * c + r
    } else if r < c {
        i * c + r
    } else {
        (2 * cp - 1 - i) * c + (r - c)
    }
}

/// The local row ranges (chunks) of a rank's keys, in ring order for query rank `i`:
/// (source rank, first local row, rows).
fn ring_chunks(i: usize, cp: usize, c: usize) -> Vec<(usize, usize)> {
    let mut out = vec![];
    for s in 0..cp {
        let src = (i + cp - s) % cp;
        out.push((src, 0));
        out.push((src, c));
    }
    out
}

/// Forward ring attention over one context-parallel group: `qkv[i]` is rank i's
/// [batch, 2·c, 3·hidden_local] input; returns each rank's [batch, 2·c, hidden_local] output.
pub fn ring_attention(
    qkv: &[Tensor],
    heads: usize,
    block: usize,
    policy: &Policy,
) -> Result<(Vec<Tensor>, RingSaved)> {
    ring_attention_with(qkv, heads, block, policy, RingOptions::default())
}

/// [`ring_attention`] with deviations (see [`RingOptions`]).
pub fn ring_attention_with(
    qkv: &[Tensor],
    heads: usize,
    block: usize,
    policy: &Policy,
    options: RingOptions,
) -> Result<(Vec<Tensor>, RingSaved)> {
    policy.validate()?;
    let cp = qkv.len();
    if cp == 0 || block == 0 {
        return Err(Error::InvalidParameter {
            name: "cp",
            reason: "ring attention needs at least one rank and a block of at least 1".into(),
        });
    }
    let input = policy.input();
    let ov = policy.input_overflow(input);
    let (ar, acc, acc_a) = forward_arith(policy);
    let mut parts = vec![];
    for t in qkv {
        parts.push(split_heads(t, heads, input, ov)?);
    }
    let (batch, rows, d) = (parts[0].batch, parts[0].seq, parts[0].d);
    for (i, p) in parts.iter().enumerate() {
        if (p.batch, p.seq, p.d) != (batch, rows, d) {
            return Err(Error::ShapeMismatch {
                what: format!("ring attention: rank {i}'s input differs from rank 0's"),
                expected: vec![batch, rows, d],
                found: vec![p.batch, p.seq, p.d],
            });
        }
    }
    if rows % 2 != 0 {
        return Err(Error::InvalidParameter {
            name: "rows",
            reason: format!("a context-parallel rank holds two chunks; {rows} rows is odd"),
        });
    }
    let c = rows / 2;
    let scale = options
        .scale
        .unwrap_or_else(|| ar.ra(1.0 / (d as f64).sqrt()));
    let contiguous = options.contiguous_positions;
    let hidden = heads * d;
    let mut outs = vec![];
    let mut lses = vec![];
    let mut sc = vec![0.0; block];
    let online = OnlineArith {
        ar: &ar,
        input,
        acc: &acc,
        acc_a: &acc_a,
    };
    for i in 0..cp {
        let mut out = vec![0.0; batch * rows * hidden];
        let mut lse_i = vec![];
        for b in 0..batch {
            for h in 0..heads {
                let bh = b * heads + h;
                let q = &parts[i].q[bh];
                let mut lse = vec![0.0; rows];
                for t in 0..rows {
                    let qp = position(i, t, c, cp, contiguous);
                    let qt = &q[t * d..(t + 1) * d];
                    let mut state = OnlineRow::new(d);
                    for (src, first) in ring_chunks(i, cp, c) {
                        let (k, v) = (&parts[src].k[bh], &parts[src].v[bh]);
                        let mut start = 0;
                        while start < c {
                            let len = block.min(c - start);
                            for (j, scj) in sc[..len].iter_mut().enumerate() {
                                let r = first + start + j;
                                *scj = if position(src, r, c, cp, contiguous) <= qp {
                                    ar.mul(dot_unchecked(qt, &k[r * d..(r + 1) * d], &acc), scale)
                                } else {
                                    f64::NEG_INFINITY
                                };
                            }
                            let base = first + start;
                            state.absorb(&sc[..len], |t, jj| v[(base + t) * d + jj], &online);
                            start += len;
                        }
                    }
                    let (l, o) = state.finish(&ar);
                    lse[t] = l;
                    for (jj, oj) in o.iter().enumerate() {
                        out[(b * rows + t) * hidden + h * d + jj] = ar.ro(*oj);
                    }
                }
                lse_i.push(lse);
            }
        }
        outs.push(Tensor::from_parts_unchecked(
            &[batch, rows, hidden],
            out,
            policy.output,
        ));
        lses.push(lse_i);
    }
    let mut q = vec![];
    let mut k = vec![];
    let mut v = vec![];
    for p in parts {
        q.push(p.q);
        k.push(p.k);
        v.push(p.v);
    }
    Ok((
        outs,
        RingSaved {
            cp,
            batch,
            rows,
            heads,
            d,
            q,
            k,
            v,
            lse: lses,
            input,
            scale,
            options,
        },
    ))
}

/// Backward ring attention: from each rank's output gradient [batch, 2·c, hidden_local], each
/// rank's d(qkv) [batch, 2·c, 3·hidden_local].
pub fn ring_attention_backward(
    saved: &RingSaved,
    dout: &[Tensor],
    policy: &Policy,
) -> Result<Vec<Tensor>> {
    policy.validate()?;
    let RingSaved {
        cp,
        batch,
        rows,
        heads,
        d,
        input,
        ..
    } = *saved;
    let hidden = heads * d;
    if dout.len() != cp {
        return Err(Error::LengthMismatch {
            what: "ring attention backward: one output gradient per rank",
            left: cp,
            right: dout.len(),
        });
    }
    for t in dout {
        if t.shape() != [batch, rows, hidden] {
            return Err(Error::ShapeMismatch {
                what: "ring attention backward: dout must match the forward output".into(),
                expected: vec![batch, rows, hidden],
                found: t.shape().to_vec(),
            });
        }
    }
    let c = rows / 2;
    let ar = Arith::new(
        policy.accumulator(),
        policy.output,
        policy.accumulation.overflow,
    );
    let gin = policy.input();
    let g: Vec<Tensor> = dout
        .iter()
        .map(|t| t.cast(gin, policy.input_overflow(gin)))
        .collect();
    let with_input = |f: Format| -> Accumulation {
        let mut a = policy.accumulation.clone();
        a.input = f;
        a
    };
    let acc = with_input(widest_of(gin, input));
    let acc_in = with_input(input);
    let acc_a = with_input(widest_of(input, policy.accumulator()));
    let scale = saved.scale;
    let opts = saved.options;
    let three = 3 * hidden;
    let mut dqkv: Vec<Vec<f64>> = vec![vec![0.0; batch * rows * three]; cp];
    for b in 0..batch {
        for h in 0..heads {
            let bh = b * heads + h;
            // dK, dV partials: [owner][query rank] -> rows × d.
            let mut dk_part = vec![vec![vec![0.0; rows * d]; cp]; cp];
            let mut dv_part = vec![vec![vec![0.0; rows * d]; cp]; cp];
            for i in 0..cp {
                let q = &saved.q[i][bh];
                let lse = &saved.lse[i][bh];
                let go: Vec<f64> = (0..rows)
                    .flat_map(|t| {
                        let base = (b * rows + t) * hidden + h * d;
                        g[i].values()[base..base + d].to_vec()
                    })
                    .collect();
                // P and dP for every (local query row, source rank, key row).
                let mut p = vec![vec![0.0; rows * rows]; cp];
                let mut dp = vec![vec![0.0; rows * rows]; cp];
                for src in 0..cp {
                    // A stale block: the rank's own K and V stand in for a remote rank's.
                    let kv = if opts.stale_kv { i } else { src };
                    let (k, v) = (&saved.k[kv][bh], &saved.v[kv][bh]);
                    let offset = if src == i {
                        0.0
                    } else {
                        opts.remote_lse_offset
                    };
                    for t in 0..rows {
                        let qp = position(i, t, c, cp, opts.contiguous_positions);
                        for r in 0..rows {
                            if position(src, r, c, cp, opts.contiguous_positions) <= qp {
                                let s = ar.mul(
                                    dot_unchecked(
                                        &q[t * d..(t + 1) * d],
                                        &k[r * d..(r + 1) * d],
                                        &acc_in,
                                    ),
                                    scale,
                                );
                                let l = if offset == 0.0 {
                                    lse[t]
                                } else {
                                    lse[t] + offset
                                };
                                p[src][t * rows + r] = input.round(ar.exp(ar.sub(s, l)), ar.ov);
                            }
                            dp[src][t * rows + r] = dot_unchecked(
                                &go[t * d..(t + 1) * d],
                                &v[r * d..(r + 1) * d],
                                &acc,
                            );
                        }
                    }
                }
                let order = ring_chunks(i, cp, c);
                let mut dq = vec![0.0; rows * d];
                for t in 0..rows {
                    // Pass 1: c_t over the chunks in ring order.
                    let mut ct = 0.0;
                    for (n, &(src, first)) in order.iter().enumerate() {
                        let rng = t * rows + first..t * rows + first + c;
                        let part = dot_unchecked(&p[src][rng.clone()], &dp[src][rng], &acc_a);
                        ct = if n == 0 { part } else { ar.add(ct, part) };
                    }
                    // Pass 2: dS, dQ partials per chunk.
                    let mut dq_t = vec![0.0; d];
                    for (n, &(src, first)) in order.iter().enumerate() {
                        let k = &saved.k[if opts.stale_kv { i } else { src }][bh];
                        let ds: Vec<f64> = (first..first + c)
                            .map(|r| {
                                let x = t * rows + r;
                                gin.round(
                                    ar.mul(ar.mul(p[src][x], ar.sub(dp[src][x], ct)), scale),
                                    ar.ov,
                                )
                            })
                            .collect();
                        for (jj, dqj) in dq_t.iter_mut().enumerate() {
                            let kc: Vec<f64> = (first..first + c).map(|r| k[r * d + jj]).collect();
                            let part = dot_unchecked(&ds, &kc, &acc);
                            *dqj = if n == 0 { part } else { ar.add(*dqj, part) };
                        }
                        // Store dS for the dK partials.
                        for (off, &x) in ds.iter().enumerate() {
                            p_ds_store(&mut dp[src], t, rows, first + off, x);
                        }
                    }
                    dq[t * d..(t + 1) * d].copy_from_slice(&dq_t);
                }
                // dK, dV partials of each source's keys over this rank's query rows.
                for src in 0..cp {
                    for r in 0..rows {
                        for jj in 0..d {
                            let dsc: Vec<f64> = (0..rows).map(|t| dp[src][t * rows + r]).collect();
                            let qc: Vec<f64> = (0..rows).map(|t| q[t * d + jj]).collect();
                            dk_part[src][i][r * d + jj] = dot_unchecked(&dsc, &qc, &acc);
                            let pc: Vec<f64> = (0..rows).map(|t| p[src][t * rows + r]).collect();
                            let gc: Vec<f64> = (0..rows).map(|t| go[t * d + jj]).collect();
                            dv_part[src][i][r * d + jj] = dot_unchecked(&pc, &gc, &acc);
                        }
                    }
                }
                for t in 0..rows {
                    let base = (b * rows + t) * three + h * d;
                    for jj in 0..d {
                        dqkv[i][base + jj] = ar.ro(dq[t * d + jj]);
                    }
                }
            }
            // dK, dV travel home: owner first, then ranks owner+1, ... (mod cp).
            for (owner, out) in dqkv.iter_mut().enumerate() {
                for r in 0..rows {
                    for jj in 0..d {
                        let (mut sk, mut sv) = (0.0, 0.0);
                        for s in 0..cp {
                            let i = (owner + s) % cp;
                            let (pk, pv) =
                                (dk_part[owner][i][r * d + jj], dv_part[owner][i][r * d + jj]);
                            if s == 0 {
                                sk = pk;
                                sv = pv;
                            } else {
                                sk = ar.add(sk, pk);
                                sv = ar.add(sv, pv);
                            }
                        }
                        let base = (b * rows + r) * three + h * d + jj;
                        out[base + hidden] = ar.ro(sk);
                        out[base + 2 * hidden] = ar.ro(sv);
                    }
                }
            }
        }
    }
    Ok(dqkv
        .into_iter()
        .map(|v| Tensor::from_parts_unchecked(&[batch, rows, three], v, policy.output))
        .collect())
}

/// dP is no longer needed once dS of an element is known: store dS in its place.
fn p_ds_store(dp: &mut [f64], t: usize, rows: usize, r: usize, x: f64) {
    dp[t * rows + r] = x;
}
