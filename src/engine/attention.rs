//! Multi-head (causal) self-attention built from the engine's matmul and softmax steps, in a
//! standard form and in the blockwise "online" form of flash attention / ring attention.
//!
//! Layout: the input is the output of the QKV projection, shape [batch, seq, 3·hidden], with
//! columns [Q | K | V], each split into `heads` contiguous heads of size d = hidden / heads.
//! The output has shape [batch, seq, hidden] (heads concatenated).
//!
//! Per (batch, head), with A the accumulator and I the input format of the policy:
//! 1. S_ij = ra(dot(q_i, k_j)) · scale with scale = ra(1/√d): S_ij = mul(dot, scale), in A;
//!    with `causal`, j > i is masked out.
//! 2. Standard: P = softmax of each row as [`softmax`](crate::engine::softmax) computes it,
//!    kept in A, then rounded to I (flash attention casts P to the input format for the second
//!    matmul). Online (block size B over keys): per key block, m_B, e = ra(exp(ra(S − m_B))),
//!    l_B = Σ e, O_B = dot(fl_I(e), V_B) in A; blocks are merged in order with
//!    m = max(m, m_B), α = ra(exp(ra(m_old − m))), β = ra(exp(ra(m_B − m))),
//!    l = add(mul(l, α), mul(l_B, β)), O = add(mul(O, α), mul(O_B, β)); finally O = div(O, l).
//! 3. Standard: O = P·V with the output rounded to the output format O.
//!
//! The backward pass (both forms) recomputes P_ij = fl_I(ra(exp(ra(S_ij − lse_i)))) from the
//! saved log-sum-exp, as flash attention does, and computes dV = Pᵀ·dO, dP = dO·Vᵀ (in A),
//! dS_ij = mul(mul(P_ij, sub(dP_ij, c_i)), scale) with c_i = dot(P_i, dP_i), then dQ = dS·K and
//! dK = dSᵀ·Q with dS rounded to I.

use crate::engine::matmul::reduce_matrix;
use crate::engine::nn::masked_exp;
use crate::error::{Error, Result};
use crate::format::Format;
use crate::order::{dot_unchecked, sum_unchecked};
use crate::policy::arith::Arith;
use crate::policy::{AttentionImpl, Policy};
use crate::tensor::Tensor;

/// What the backward pass needs.
#[derive(Debug, Clone)]
pub struct AttentionSaved {
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    causal: bool,
    /// Per (batch, head): Q, K, V as [seq, d] row-major values in the input format.
    q: Vec<Vec<f64>>,
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    /// Per (batch, head): the log-sum-exp of each score row, in A.
    lse: Vec<Vec<f64>>,
    input: Format,
    /// The score scale used forward.
    scale: f64,
}

/// Q, K, V split per (batch, head), each [seq, d] row-major.
pub struct Heads {
    /// Batch size.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// Head dimension.
    pub d: usize,
    /// Per (batch, head): Q.
    pub q: Vec<Vec<f64>>,
    /// Per (batch, head): K.
    pub k: Vec<Vec<f64>>,
    /// Per (batch, head): V.
    pub v: Vec<Vec<f64>>,
}

/// The QKV projection [batch, seq, 3·hidden] split into Q, K and V per (batch, head), each
/// rounded to `input`.
pub fn split_heads(
    qkv: &Tensor,
    heads: usize,
    input: Format,
    overflow: crate::Overflow,
) -> Result<Heads> {
    let s = qkv.expect_rank(3, "attention input [batch, seq, 3*hidden]")?;
    let (batch, seq, three_h) = (s[0], s[1], s[2]);
    if heads == 0 || three_h % (3 * heads) != 0 || three_h == 0 {
        return Err(Error::ShapeMismatch {
            what: format!("attention: the last dimension must be 3 * hidden with hidden divisible by heads = {heads}"),
            expected: vec![batch, seq, 3 * heads],
            found: s.to_vec(),
        });
    }
    let hidden = three_h / 3;
    let d = hidden / heads;
    let x = qkv.cast(input, overflow);
    let xv = x.values();
    let mut q = vec![];
    let mut k = vec![];
    let mut v = vec![];
    for b in 0..batch {
        for h in 0..heads {
            let mut qh = Vec::with_capacity(seq * d);
            let mut kh = Vec::with_capacity(seq * d);
            let mut vh = Vec::with_capacity(seq * d);
            for t in 0..seq {
                let base = (b * seq + t) * three_h + h * d;
                qh.extend_from_slice(&xv[base..base + d]);
                kh.extend_from_slice(&xv[base + hidden..base + hidden + d]);
                vh.extend_from_slice(&xv[base + 2 * hidden..base + 2 * hidden + d]);
            }
            q.push(qh);
            k.push(kh);
            v.push(vh);
        }
    }
    Ok(Heads {
        batch,
        seq,
        d,
        q,
        k,
        v,
    })
}

fn transpose_vec(x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for i in 0..rows {
        for j in 0..cols {
            out[j * rows + i] = x[i * cols + j];
        }
    }
    out
}

/// Forward attention; returns the output [batch, seq, hidden] and the saved state.
pub fn attention(
    qkv: &Tensor,
    heads: usize,
    causal: bool,
    imp: AttentionImpl,
    policy: &Policy,
) -> Result<(Tensor, AttentionSaved)> {
    attention_with_scale(qkv, heads, causal, imp, policy, None)
}

/// [`attention`] with the score scale given (`None`: ra(1/√d)); the bug catalog uses it to
/// model a scale computed from the wrong width.
pub fn attention_with_scale(
    qkv: &Tensor,
    heads: usize,
    causal: bool,
    imp: AttentionImpl,
    policy: &Policy,
    scale: Option<f64>,
) -> Result<(Tensor, AttentionSaved)> {
    policy.validate()?;
    if let AttentionImpl::Online { block: 0 } = imp {
        return Err(Error::InvalidParameter {
            name: "block",
            reason: "online attention needs key blocks of at least one element (got 0)".into(),
        });
    }
    let input = policy.input();
    let Heads {
        batch,
        seq,
        d,
        q,
        k,
        v,
    } = split_heads(qkv, heads, input, policy.input_overflow(input))?;
    let (ar, acc, acc_a) = forward_arith(policy);
    let scale = scale.unwrap_or_else(|| ar.ra(1.0 / (d as f64).sqrt()));
    let hidden = heads * d;
    let mut out = vec![0.0; batch * seq * hidden];
    let mut lses = vec![];
    for b in 0..batch {
        for h in 0..heads {
            let bh = b * heads + h;
            let scores = scaled_scores(&q[bh], &k[bh], seq, d, causal, scale, &ar, &acc);
            let (o, lse) = match imp {
                AttentionImpl::Standard => {
                    standard_rows(&scores, &v[bh], seq, d, input, &ar, &acc, &acc_a)
                }
                AttentionImpl::Online { block } => {
                    online_rows(&scores, &v[bh], seq, d, block, input, &ar, &acc, &acc_a)
                }
            };
            for t in 0..seq {
                for j in 0..d {
                    out[(b * seq + t) * hidden + h * d + j] = ar.ro(o[t * d + j]);
                }
            }
            lses.push(lse);
        }
    }
    Ok((
        Tensor::from_parts_unchecked(&[batch, seq, hidden], out, policy.output),
        AttentionSaved {
            batch,
            seq,
            heads,
            head_dim: d,
            causal,
            q,
            k,
            v,
            lse: lses,
            input,
            scale,
        },
    ))
}

/// The forward pass's rounding context, the accumulation of Q·Kᵀ and P·V (input format
/// I) and of the block sums (accumulator format A).
pub fn forward_arith(policy: &Policy) -> (Arith, crate::Accumulation, crate::Accumulation) {
    let ar = Arith::new(
        policy.accumulator(),
        policy.output,
        policy.accumulation.overflow,
    );
    let mut acc = policy.accumulation.clone();
    acc.input = policy.input();
    let mut acc_a = policy.accumulation.clone();
    acc_a.input = policy.accumulator();
    (ar, acc, acc_a)
}

/// S = mul(dot(q_i, k_j), scale) in A, −∞ where masked.
#[allow(clippy::too_many_arguments)]
fn scaled_scores(
    q: &[f64],
    k: &[f64],
    seq: usize,
    d: usize,
    causal: bool,
    scale: f64,
    ar: &Arith,
    acc: &crate::Accumulation,
) -> Vec<f64> {
    let kt = transpose_vec(k, seq, d);
    let raw = reduce_matrix(q, &kt, seq, d, seq, acc);
    let mut s = vec![f64::NEG_INFINITY; seq * seq];
    for i in 0..seq {
        for j in 0..seq {
            if !causal || j <= i {
                s[i * seq + j] = ar.mul(raw[i * seq + j], scale);
            }
        }
    }
    s
}

/// Standard softmax rows then O = fl_I(P)·V in A; returns (O in A, lse per row).
#[allow(clippy::too_many_arguments)]
fn standard_rows(
    s: &[f64],
    v: &[f64],
    seq: usize,
    d: usize,
    input: Format,
    ar: &Arith,
    acc: &crate::Accumulation,
    acc_a: &crate::Accumulation,
) -> (Vec<f64>, Vec<f64>) {
    let mut p = vec![0.0; seq * seq];
    let mut lse = vec![0.0; seq];
    let mut e = vec![0.0; seq];
    for i in 0..seq {
        let row = &s[i * seq..(i + 1) * seq];
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        masked_exp(ar, row, m, &mut e);
        let sum = sum_unchecked(&e, acc_a);
        lse[i] = ar.add(m, ar.ln(sum));
        for j in 0..seq {
            p[i * seq + j] = input.round(ar.div(e[j], sum), ar.ov);
        }
    }
    (reduce_matrix(&p, v, seq, seq, d, acc), lse)
}

/// The running state of one query row in online (blockwise) softmax attention: running max
/// m, denominator l and unnormalized output o, all in the accumulator format. Shared by the
/// engine's online attention and the context-parallel ring attention, so that both compute
/// every block exactly alike.
pub struct OnlineRow {
    m: f64,
    l: f64,
    o: Vec<f64>,
}

/// The arithmetic of an online-attention row: rounding context, the input format P is rounded
/// to, the accumulation of P·V (`acc`) and of the block sums (`acc_a`).
pub struct OnlineArith<'a> {
    /// The rounding context of the scores and the running statistics.
    pub ar: &'a Arith,
    /// The format the probabilities are rounded to before P·V.
    pub input: Format,
    /// The accumulation of the row sums.
    pub acc: &'a crate::Accumulation,
    /// The accumulation of P·V.
    pub acc_a: &'a crate::Accumulation,
}

impl OnlineRow {
    /// An empty row with head dimension `d`.
    pub fn new(d: usize) -> OnlineRow {
        OnlineRow {
            m: f64::NEG_INFINITY,
            l: 0.0,
            o: vec![0.0; d],
        }
    }

    /// Absorb one key block: `scores` (−∞ where masked) and `value(t, j)`, element j of the
    /// block's value row t. m_B = max, e = ra(exp(ra(S − m_B))), l_B = Σ e, O_B = dot(fl_I(e),
    /// V) per column; merged with α = ra(exp(ra(m − m_new))), β = ra(exp(ra(m_B − m_new))),
    /// l = add(mul(l, α), mul(l_B, β)), o likewise. A fully masked block is skipped.
    pub fn absorb(
        &mut self,
        scores: &[f64],
        value: impl Fn(usize, usize) -> f64,
        k: &OnlineArith<'_>,
    ) {
        let ar = k.ar;
        let len = scores.len();
        let mb = scores.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        if mb == f64::NEG_INFINITY {
            return;
        }
        let mut e = vec![0.0; len];
        masked_exp(ar, scores, mb, &mut e);
        let lb = sum_unchecked(&e, k.acc_a);
        let pe: Vec<f64> = e.iter().map(|&x| k.input.round(x, ar.ov)).collect();
        let d = self.o.len();
        let mut col = vec![0.0; len];
        let mut ob = vec![0.0; d];
        for (j, obj) in ob.iter_mut().enumerate() {
            for (t, c) in col.iter_mut().enumerate() {
                *c = value(t, j);
            }
            *obj = dot_unchecked(&pe, &col, k.acc);
        }
        if self.m == f64::NEG_INFINITY {
            self.m = mb;
            self.l = lb;
            self.o = ob;
        } else {
            let m_new = self.m.max(mb);
            let alpha = ar.exp(ar.sub(self.m, m_new));
            let beta = ar.exp(ar.sub(mb, m_new));
            self.l = ar.add(ar.mul(self.l, alpha), ar.mul(lb, beta));
            for (o, &b) in self.o.iter_mut().zip(&ob) {
                *o = ar.add(ar.mul(*o, alpha), ar.mul(b, beta));
            }
            self.m = m_new;
        }
    }

    /// (lse = ra(m + ra(ln l)), the outputs div(o, l) in the accumulator format).
    pub fn finish(&self, ar: &Arith) -> (f64, Vec<f64>) {
        (
            ar.add(self.m, ar.ln(self.l)),
            self.o.iter().map(|&o| ar.div(o, self.l)).collect(),
        )
    }
}

#[allow(clippy::too_many_arguments)]
fn online_rows(
    s: &[f64],
    v: &[f64],
    seq: usize,
    d: usize,
    block: usize,
    input: Format,
    ar: &Arith,
    acc: &crate::Accumulation,
    acc_a: &crate::Accumulation,
) -> (Vec<f64>, Vec<f64>) {
    let k = OnlineArith {
        ar,
        input,
        acc,
        acc_a,
    };
    let mut out = vec![0.0; seq * d];
    let mut lse = vec![0.0; seq];
    for i in 0..seq {
        let row = &s[i * seq..(i + 1) * seq];
        let mut state = OnlineRow::new(d);
        let mut start = 0;
        while start < seq {
            let end = (start + block).min(seq);
            state.absorb(&row[start..end], |t, j| v[(start + t) * d + j], &k);
            start = end;
        }
        let (l, o) = state.finish(ar);
        lse[i] = l;
        out[i * d..(i + 1) * d].copy_from_slice(&o);
    }
    (out, lse)
}

/// Backward attention: d(qkv) of shape [batch, seq, 3·hidden] from dout [batch, seq, hidden].
pub fn attention_backward(
    saved: &AttentionSaved,
    dout: &Tensor,
    policy: &Policy,
) -> Result<Tensor> {
    policy.validate()?;
    let (batch, seq, heads, d) = (saved.batch, saved.seq, saved.heads, saved.head_dim);
    let hidden = heads * d;
    if dout.shape() != [batch, seq, hidden] {
        return Err(Error::ShapeMismatch {
            what: "attention backward: dout must match the forward output".into(),
            expected: vec![batch, seq, hidden],
            found: dout.shape().to_vec(),
        });
    }
    let input = saved.input;
    let ar = Arith::new(
        policy.accumulator(),
        policy.output,
        policy.accumulation.overflow,
    );
    let g = dout.cast(policy.input(), policy.input_overflow(policy.input()));
    let gv = g.values();
    let mut acc = policy.accumulation.clone();
    acc.input = widest_of(policy.input(), input);
    let scale = saved.scale;
    let mut dqkv = vec![0.0; batch * seq * 3 * hidden];
    for b in 0..batch {
        for h in 0..heads {
            let bh = b * heads + h;
            let (q, k, v) = (&saved.q[bh], &saved.k[bh], &saved.v[bh]);
            let mut dout_h = Vec::with_capacity(seq * d);
            for t in 0..seq {
                let base = (b * seq + t) * hidden + h * d;
                dout_h.extend_from_slice(&gv[base..base + d]);
            }
            // Recompute P from S and the saved lse.
            let mut acc_in = policy.accumulation.clone();
            acc_in.input = input;
            let s = scaled_scores(q, k, seq, d, saved.causal, scale, &ar, &acc_in);
            let mut p = vec![0.0; seq * seq];
            for i in 0..seq {
                for j in 0..seq {
                    let x = s[i * seq + j];
                    p[i * seq + j] = if x == f64::NEG_INFINITY {
                        0.0
                    } else {
                        input.round(ar.exp(ar.sub(x, saved.lse[bh][i])), ar.ov)
                    };
                }
            }
            // dV = Pᵀ·dO.
            let pt = transpose_vec(&p, seq, seq);
            let dv = reduce_matrix(&pt, &dout_h, seq, seq, d, &acc);
            // dP = dO·Vᵀ in A.
            let vt = transpose_vec(v, seq, d);
            let dp = reduce_matrix(&dout_h, &vt, seq, d, seq, &acc);
            // dS = P ∘ (dP − c) · scale, rounded to the input format for the next matmuls.
            let mut acc_a = policy.accumulation.clone();
            acc_a.input = widest_of(input, policy.accumulator());
            let mut ds = vec![0.0; seq * seq];
            for i in 0..seq {
                let c = dot_unchecked(
                    &p[i * seq..(i + 1) * seq],
                    &dp[i * seq..(i + 1) * seq],
                    &acc_a,
                );
                for j in 0..seq {
                    let val = ar.mul(ar.mul(p[i * seq + j], ar.sub(dp[i * seq + j], c)), scale);
                    ds[i * seq + j] = policy.input().round(val, ar.ov);
                }
            }
            let dq = reduce_matrix(&ds, k, seq, seq, d, &acc);
            let dst = transpose_vec(&ds, seq, seq);
            let dk = reduce_matrix(&dst, q, seq, seq, d, &acc);
            for t in 0..seq {
                let base = (b * seq + t) * 3 * hidden + h * d;
                for j in 0..d {
                    dqkv[base + j] = ar.ro(dq[t * d + j]);
                    dqkv[base + hidden + j] = ar.ro(dk[t * d + j]);
                    dqkv[base + 2 * hidden + j] = ar.ro(dv[t * d + j]);
                }
            }
        }
    }
    Ok(Tensor::from_parts_unchecked(
        &[batch, seq, 3 * hidden],
        dqkv,
        policy.output,
    ))
}

/// The wider of two formats (the one that holds the other; F64 when neither does).
pub fn widest_of(a: Format, b: Format) -> Format {
    if a.is_subset_of(b) {
        b
    } else if b.is_subset_of(a) {
        a
    } else {
        Format::F64
    }
}
