//! Elementwise ops, softmax (standard and online), LayerNorm / RMSNorm, embedding and
//! cross-entropy, forward and backward, each under a [`Policy`].
//!
//! Every op is defined by the scalar steps written in its doc comment, with the rounding
//! conventions of `arith` (ra: one rounding to the accumulator format A; ro: to the output
//! format O; reductions by the policy's [`Accumulation`]). Inputs are
//! first rounded to the policy's input format. Ops work along the last dimension; leading
//! dimensions are rows.

use crate::error::{Error, Result};
use crate::format::Format;
use crate::order::{dot_unchecked, sum_unchecked, Accumulation};
use crate::policy::arith::Arith;
use crate::policy::{gelu_f64, gelu_grad_f64, Policy, Variance};
use crate::tensor::Tensor;

fn arith(policy: &Policy) -> Arith {
    Arith::new(
        policy.accumulator(),
        policy.output,
        policy.accumulation.overflow,
    )
}

/// The policy's accumulation with its input format replaced by `input` (the format of the
/// values actually reduced).
fn acc_for(policy: &Policy, input: Format) -> Accumulation {
    let mut a = policy.accumulation.clone();
    a.input = input;
    a
}

/// Inputs rounded to the policy's input format.
fn cast_in(t: &Tensor, policy: &Policy) -> Tensor {
    t.cast(policy.input(), policy.input_overflow(policy.input()))
}

fn same_shape(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            what: what.to_string(),
            expected: a.shape().to_vec(),
            found: b.shape().to_vec(),
        });
    }
    Ok(())
}

fn last_dim(t: &Tensor, what: &str) -> Result<(usize, usize)> {
    match t.shape().last() {
        Some(&n) if n > 0 => Ok((t.len() / n, n)),
        _ => Err(Error::ShapeMismatch {
            what: format!("{what}: needs a non-empty last dimension"),
            expected: vec![1],
            found: t.shape().to_vec(),
        }),
    }
}

fn map_unary(x: &Tensor, policy: &Policy, f: impl Fn(&Arith, f64) -> f64) -> Result<Tensor> {
    policy.validate()?;
    let ar = arith(policy);
    let xi = cast_in(x, policy);
    let out: Vec<f64> = xi.values().iter().map(|&v| ar.ro(f(&ar, v))).collect();
    Ok(Tensor::from_parts_unchecked(x.shape(), out, policy.output))
}

fn map_binary(
    a: &Tensor,
    b: &Tensor,
    policy: &Policy,
    what: &str,
    f: impl Fn(&Arith, f64, f64) -> f64,
) -> Result<Tensor> {
    policy.validate()?;
    same_shape(a, b, what)?;
    let ar = arith(policy);
    let ai = cast_in(a, policy);
    let bi = cast_in(b, policy);
    let out: Vec<f64> = ai
        .values()
        .iter()
        .zip(bi.values())
        .map(|(&x, &y)| ar.ro(f(&ar, x, y)))
        .collect();
    Ok(Tensor::from_parts_unchecked(a.shape(), out, policy.output))
}

/// a + b elementwise: ro(add(a, b)). Shapes must be equal.
pub fn add(a: &Tensor, b: &Tensor, policy: &Policy) -> Result<Tensor> {
    map_binary(a, b, policy, "add: operand shapes differ", |ar, x, y| {
        ar.add(x, y)
    })
}

/// c·x elementwise with the constant first rounded to A: ro(mul(x, ra(c))).
pub fn scale(x: &Tensor, c: f64, policy: &Policy) -> Result<Tensor> {
    if !c.is_finite() {
        return Err(Error::NonFinite {
            what: "scale constant".into(),
            value: c,
        });
    }
    let ar = arith(policy);
    let cr = ar.ra(c);
    map_unary(x, policy, |ar, v| ar.mul(v, cr))
}

/// GELU in its tanh form, 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))), evaluated in `f64` and
/// rounded once: ro(ra(gelu(x))).
pub fn gelu(x: &Tensor, policy: &Policy) -> Result<Tensor> {
    map_unary(x, policy, |ar, v| ar.ra(gelu_f64(v)))
}

/// dx = ro(mul(dy, ra(gelu'(x)))).
pub fn gelu_backward(x: &Tensor, dy: &Tensor, policy: &Policy) -> Result<Tensor> {
    map_binary(
        x,
        dy,
        policy,
        "gelu backward: x and dy shapes differ",
        |ar, v, g| ar.mul(g, ar.ra(gelu_grad_f64(v))),
    )
}

/// exp(x) elementwise, evaluated in `f64` and rounded once: ro(ra(exp(x))) (the op the
/// elementwise threshold prices as `exp`; softmax computes its numerators in its own way).
///
/// # Examples
///
/// ```
/// use ttrace::engine::exp;
/// use ttrace::{Format, Policy, Tensor};
/// let x = Tensor::from_vec(&[3], vec![0.0, 1.0, -2.0], Format::BF16)?;
/// let p: Policy = "in=bf16,acc=f32,out=bf16".parse()?;
/// let y = exp(&x, &p)?;
/// assert_eq!(y.values()[0], 1.0);
/// assert_eq!(y.values()[1], 2.71875); // e rounded to BF16
/// # Ok::<(), ttrace::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidParameter`](crate::Error::InvalidParameter) for an invalid policy.
pub fn exp(x: &Tensor, policy: &Policy) -> Result<Tensor> {
    map_unary(x, policy, |ar, v| ar.ra(v.exp()))
}

/// SiLU, x·σ(x), evaluated in `f64` and rounded once: ro(ra(silu(x))).
pub fn silu(x: &Tensor, policy: &Policy) -> Result<Tensor> {
    map_unary(x, policy, |ar, v| ar.ra(v / (1.0 + (-v).exp())))
}

/// dx = ro(mul(dy, ra(σ(x)(1 + x(1 − σ(x)))))).
pub fn silu_backward(x: &Tensor, dy: &Tensor, policy: &Policy) -> Result<Tensor> {
    map_binary(
        x,
        dy,
        policy,
        "silu backward: x and dy shapes differ",
        |ar, v, g| {
            let s = 1.0 / (1.0 + (-v).exp());
            ar.mul(g, ar.ra(s * (1.0 + v * (1.0 - s))))
        },
    )
}

/// eᵢ = ra(exp(ra(xᵢ − m))) for each element of `row` into `out`, with eᵢ = 0 where xᵢ = −∞
/// (a masked position). Shared by softmax, online softmax and attention.
pub(crate) fn masked_exp(ar: &Arith, row: &[f64], m: f64, out: &mut [f64]) {
    for (e, &x) in out.iter_mut().zip(row) {
        *e = if x == f64::NEG_INFINITY {
            0.0
        } else {
            ar.exp(ar.sub(x, m))
        };
    }
}

/// Softmax along the last dimension, max-subtracted. Per row x (length n):
/// m = max x (exact); dᵢ = ra(xᵢ − m); eᵢ = ra(exp(dᵢ)); s = Σ eᵢ (policy order, in A);
/// pᵢ = ro(ra(eᵢ / s)). Elements equal to −∞ (masked) give eᵢ = 0.
pub fn softmax(x: &Tensor, policy: &Policy) -> Result<Tensor> {
    let mut out = softmax_each(x, &[policy])?;
    Ok(out.remove(0))
}

/// Whether two policies compute [`softmax`]'s numerators eᵢ alike: the same input format and
/// its overflow, the same accumulator and its overflow.
pub(crate) fn numerators_alike(p: &Policy, q: &Policy) -> bool {
    let key = |p: &Policy| {
        let i = p.input();
        (
            i,
            p.input_overflow(i),
            p.accumulator(),
            p.accumulation.overflow,
        )
    };
    key(p) == key(q)
}

/// [`softmax`] under each of `policies`, bit for bit, with the numerators eᵢ of a row computed
/// once for the policies that compute them alike (the same input format and its overflow, the
/// same accumulator and its overflow): what a threshold's check runs for its two sides, which
/// differ in their order or output format.
pub(crate) fn softmax_each(x: &Tensor, policies: &[&Policy]) -> Result<Vec<Tensor>> {
    let (rows, n) = last_dim(x, "softmax")?;
    let mut sides = Vec::with_capacity(policies.len());
    for (j, &p) in policies.iter().enumerate() {
        p.validate()?;
        // The first earlier policy whose numerators are this one's.
        let shares = policies[..j].iter().position(|&q| numerators_alike(q, p));
        let xi = match shares {
            Some(_) => None,
            None => Some(cast_in(x, p)),
        };
        sides.push((p, arith(p), acc_for(p, p.accumulator()), shares, xi));
    }
    let mut outs = vec![vec![0.0; x.len()]; policies.len()];
    let mut es = vec![vec![0.0; n]; policies.len()];
    for r in 0..rows {
        for (j, (_, ar, acc, shares, xi)) in sides.iter().enumerate() {
            if let Some(xi) = xi {
                let row = &xi.values()[r * n..(r + 1) * n];
                let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                masked_exp(ar, row, m, &mut es[j]);
            }
            let e = &es[shares.unwrap_or(j)];
            softmax_row_outputs(ar, acc, e, &mut outs[j][r * n..(r + 1) * n]);
        }
    }
    Ok(outs
        .into_iter()
        .zip(&sides)
        .map(|(out, (p, ..))| Tensor::from_parts_unchecked(x.shape(), out, p.output))
        .collect())
}

/// One row of [`softmax`]'s outputs from its numerators `e`: s = Σ eᵢ in the order of `acc`
/// (the policy's accumulation, on values of its accumulator), pᵢ = ro(ra(eᵢ / s)).
fn softmax_row_outputs(ar: &Arith, acc: &Accumulation, e: &[f64], out: &mut [f64]) {
    let s = sum_unchecked(e, acc);
    for (o, &ei) in out.iter_mut().zip(e) {
        *o = ar.ro(ar.div(ei, s));
    }
}

/// [`softmax`] under `policy` from its numerators `e` (rows of `n`), as [`masked_exp`] computes
/// them under a policy with the same input and accumulator formats and overflows: what a
/// threshold's check runs when it has computed the numerators for its own model. An empty
/// `n` gives no outputs.
pub(crate) fn softmax_from_numerators(e: &[f64], n: usize, policy: &Policy) -> Vec<f64> {
    let (ar, acc) = (arith(policy), acc_for(policy, policy.accumulator()));
    let mut out = vec![0.0; e.len()];
    if n > 0 {
        for (row, o) in e.chunks(n).zip(out.chunks_mut(n)) {
            softmax_row_outputs(&ar, &acc, row, o);
        }
    }
    out
}

/// Softmax computed blockwise and merged online, as flash attention and ring attention do.
/// Per row, for each block B of `block` consecutive elements:
/// m_B = max over B; eᵢ = ra(exp(ra(xᵢ − m_B))); l_B = Σ_B eᵢ (policy order, in A).
/// Merge in block order: m = max_B m_B; l = Σ_B ra(l_B · ra(exp(ra(m_B − m)))) added
/// sequentially in A. Output: pᵢ = ro(ra(ra(eᵢ · ra(exp(ra(m_B(i) − m)))) / l)).
pub fn online_softmax(x: &Tensor, block: usize, policy: &Policy) -> Result<Tensor> {
    policy.validate()?;
    if block == 0 {
        return Err(Error::InvalidParameter {
            name: "block",
            reason: "online softmax needs blocks of at least one element (got 0)".into(),
        });
    }
    let (rows, n) = last_dim(x, "online softmax")?;
    let ar = arith(policy);
    let xi = cast_in(x, policy);
    let acc = acc_for(policy, policy.accumulator());
    let v = xi.values();
    let mut out = vec![0.0; v.len()];
    let mut e = vec![0.0; n];
    let nb = n.div_ceil(block);
    let mut maxes = vec![0.0; nb];
    let mut sums = vec![0.0; nb];
    for r in 0..rows {
        let row = &v[r * n..(r + 1) * n];
        for (bi, chunk) in row.chunks(block).enumerate() {
            let mb = chunk.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let es = &mut e[bi * block..bi * block + chunk.len()];
            masked_exp(&ar, chunk, mb, es);
            maxes[bi] = mb;
            sums[bi] = sum_unchecked(es, &acc);
        }
        let m = maxes.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let factors: Vec<f64> = maxes
            .iter()
            .map(|&mb| {
                if mb == f64::NEG_INFINITY {
                    0.0
                } else {
                    ar.exp(ar.sub(mb, m))
                }
            })
            .collect();
        let mut l = ar.mul(sums[0], factors[0]);
        for b in 1..nb {
            l = ar.add(l, ar.mul(sums[b], factors[b]));
        }
        for (i, o) in out[r * n..(r + 1) * n].iter_mut().enumerate() {
            *o = ar.ro(ar.div(ar.mul(e[i], factors[i / block]), l));
        }
    }
    Ok(Tensor::from_parts_unchecked(x.shape(), out, policy.output))
}

/// Softmax backward from the forward output y: per row, c = dot(y, dy) (policy order, in A);
/// dxᵢ = ro(mul(yᵢ, sub(dyᵢ, c))).
pub fn softmax_backward(y: &Tensor, dy: &Tensor, policy: &Policy) -> Result<Tensor> {
    policy.validate()?;
    same_shape(y, dy, "softmax backward: y and dy shapes differ")?;
    let (rows, n) = last_dim(y, "softmax backward")?;
    let ar = arith(policy);
    let yi = cast_in(y, policy);
    let gi = cast_in(dy, policy);
    let acc = acc_for(policy, policy.input());
    let (yv, gv) = (yi.values(), gi.values());
    let mut out = vec![0.0; yv.len()];
    for r in 0..rows {
        let yr = &yv[r * n..(r + 1) * n];
        let gr = &gv[r * n..(r + 1) * n];
        let c = dot_unchecked(yr, gr, &acc);
        for i in 0..n {
            out[r * n + i] = ar.ro(ar.mul(yr[i], ar.sub(gr[i], c)));
        }
    }
    Ok(Tensor::from_parts_unchecked(y.shape(), out, policy.output))
}

/// Saved state of a normalization for its backward pass.
#[derive(Debug, Clone)]
pub struct NormSaved {
    /// x̂ (normalized input before the affine weights), in A.
    pub xhat: Vec<f64>,
    /// 1/σ per row, in A.
    pub rstd: Vec<f64>,
}

/// LayerNorm over the last dimension with affine weight γ and bias β (length n):
/// mean and variance as `variance` says; rstd = ra(1/√(ra(var + eps)))
/// (the reciprocal square root evaluated in `f64`, rounded once); x̂ᵢ = ra(dᵢ · rstd) with
/// dᵢ = ra(xᵢ − μ); yᵢ = ro(add(mul(x̂ᵢ, γᵢ), βᵢ)).
pub fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    variance: Variance,
    policy: &Policy,
) -> Result<(Tensor, NormSaved)> {
    norm_forward(x, weight, Some(bias), eps, Some(variance), policy)
}

/// RMSNorm over the last dimension with weight γ: ms = ra(dot(x, x) / n);
/// rstd = ra(1/√(ra(ms + eps))); x̂ᵢ = ra(xᵢ · rstd); yᵢ = ro(mul(x̂ᵢ, γᵢ)).
pub fn rms_norm(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    policy: &Policy,
) -> Result<(Tensor, NormSaved)> {
    norm_forward(x, weight, None, eps, None, policy)
}

pub(crate) fn norm_forward(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
    variance: Option<Variance>,
    policy: &Policy,
) -> Result<(Tensor, NormSaved)> {
    policy.validate()?;
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::InvalidParameter {
            name: "eps",
            reason: format!("must be finite and non-negative (got {eps})"),
        });
    }
    let (rows, n) = last_dim(x, "norm")?;
    for (t, what) in [(Some(weight), "norm weight"), (bias, "norm bias")] {
        if let Some(t) = t {
            if t.shape() != [n] {
                return Err(Error::ShapeMismatch {
                    what: format!("{what} must have the length of the normalized dimension"),
                    expected: vec![n],
                    found: t.shape().to_vec(),
                });
            }
        }
    }
    let ar = arith(policy);
    let xi = cast_in(x, policy);
    let w = cast_in(weight, policy);
    let b = bias.map(|b| cast_in(b, policy));
    let acc_in = acc_for(policy, policy.input());
    let acc_a = acc_for(policy, policy.accumulator());
    let eps_a = ar.ra(eps);
    let nf = n as f64;
    let v = xi.values();
    let mut out = vec![0.0; v.len()];
    let mut xhat = vec![0.0; v.len()];
    let mut rstds = vec![0.0; rows];
    let mut d = vec![0.0; n];
    for r in 0..rows {
        let row = &v[r * n..(r + 1) * n];
        let (var, centered) = match variance {
            None => (ar.div(dot_unchecked(row, row, &acc_in), nf), false),
            Some(Variance::TwoPass) => {
                let mu = ar.div(sum_unchecked(row, &acc_in), nf);
                for (di, &xv) in d.iter_mut().zip(row) {
                    *di = ar.sub(xv, mu);
                }
                (ar.div(dot_unchecked(&d, &d, &acc_a), nf), true)
            }
            Some(Variance::Welford) => {
                let (mut mu, mut m2) = (0.0, 0.0);
                for (k, &xv) in row.iter().enumerate() {
                    let delta = ar.sub(xv, mu);
                    mu = ar.add(mu, ar.div(delta, (k + 1) as f64));
                    m2 = ar.add(m2, ar.mul(delta, ar.sub(xv, mu)));
                }
                for (di, &xv) in d.iter_mut().zip(row) {
                    *di = ar.sub(xv, mu);
                }
                (ar.div(m2, nf), true)
            }
            Some(Variance::OnePass) => {
                let mu = ar.div(sum_unchecked(row, &acc_in), nf);
                let ms = ar.div(dot_unchecked(row, row, &acc_in), nf);
                for (di, &xv) in d.iter_mut().zip(row) {
                    *di = ar.sub(xv, mu);
                }
                (ar.sub(ms, ar.mul(mu, mu)), true)
            }
        };
        let rstd = ar.ra(1.0 / ar.add(var, eps_a).sqrt());
        rstds[r] = rstd;
        for i in 0..n {
            let src = if centered { d[i] } else { row[i] };
            let xh = ar.mul(src, rstd);
            xhat[r * n + i] = xh;
            let mut y = ar.mul(xh, w.values()[i]);
            if let Some(b) = &b {
                y = ar.add(y, b.values()[i]);
            }
            out[r * n + i] = ar.ro(y);
        }
    }
    Ok((
        Tensor::from_parts_unchecked(x.shape(), out, policy.output),
        NormSaved { xhat, rstd: rstds },
    ))
}

/// Gradients of a LayerNorm (`bias_grad` true) or RMSNorm: (dx, dγ, dβ).
///
/// Per row, with gᵢ = dyᵢ (rounded to the input format) and γ the weight:
/// hᵢ = mul(gᵢ, γᵢ); a = ra(Σ hᵢ / n) (LayerNorm only; 0 for RMSNorm); b = ra(dot(h, x̂) / n);
/// dxᵢ = ro(mul(rstd, sub(sub(hᵢ, a), mul(x̂ᵢ, b)))).
/// Over rows (tokens): dγᵢ = Σ_rows mul(gᵢ, x̂ᵢ), dβᵢ = Σ_rows gᵢ, each reduced in the policy
/// order and rounded to `param_grad_format`.
pub fn norm_backward(
    saved: &NormSaved,
    weight: &Tensor,
    dy: &Tensor,
    bias_grad: bool,
    policy: &Policy,
    param_grad_format: Format,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    policy.validate()?;
    let (rows, n) = last_dim(dy, "norm backward")?;
    if saved.xhat.len() != dy.len() || saved.rstd.len() != rows || weight.shape() != [n] {
        return Err(Error::ShapeMismatch {
            what: "norm backward: saved state, weight and dy disagree".into(),
            expected: vec![rows, n],
            found: dy.shape().to_vec(),
        });
    }
    let ar = arith(policy);
    let g = cast_in(dy, policy);
    let w = cast_in(weight, policy);
    let acc_a = acc_for(policy, policy.accumulator());
    let nf = n as f64;
    let gv = g.values();
    let mut dx = vec![0.0; gv.len()];
    let mut h = vec![0.0; n];
    let mut gx = vec![0.0; gv.len()];
    for r in 0..rows {
        let gr = &gv[r * n..(r + 1) * n];
        let xh = &saved.xhat[r * n..(r + 1) * n];
        for i in 0..n {
            h[i] = ar.mul(gr[i], w.values()[i]);
            gx[r * n + i] = ar.mul(gr[i], xh[i]);
        }
        let a = if bias_grad {
            ar.div(sum_unchecked(&h, &acc_a), nf)
        } else {
            0.0
        };
        let b = ar.div(dot_unchecked(&h, xh, &acc_a), nf);
        for i in 0..n {
            dx[r * n + i] = ar.ro(ar.mul(saved.rstd[r], ar.sub(ar.sub(h[i], a), ar.mul(xh[i], b))));
        }
    }
    let pg = Arith::new(
        policy.accumulator(),
        param_grad_format,
        policy.accumulation.overflow,
    );
    let acc_g = acc_for(policy, policy.input());
    let mut col = vec![0.0; rows];
    let mut dgamma = Vec::with_capacity(n);
    let mut dbeta = Vec::with_capacity(n);
    for i in 0..n {
        for r in 0..rows {
            col[r] = gx[r * n + i];
        }
        dgamma.push(pg.ro(sum_unchecked(&col, &acc_a)));
        if bias_grad {
            for r in 0..rows {
                col[r] = gv[r * n + i];
            }
            dbeta.push(pg.ro(sum_unchecked(&col, &acc_g)));
        }
    }
    Ok((
        Tensor::from_parts_unchecked(dy.shape(), dx, policy.output),
        Tensor::from_parts_unchecked(&[n], dgamma, param_grad_format),
        bias_grad.then(|| Tensor::from_parts_unchecked(&[n], dbeta, param_grad_format)),
    ))
}

/// Token + position embedding: for ids of shape [batch, seq], y[b, t, :] =
/// ro(add(wte[ids[b, t], :], wpe[t, :])). Ids must be integers in [0, vocab); seq must not
/// exceed the rows of wpe.
pub fn embedding(
    ids: &[usize],
    batch: usize,
    seq: usize,
    wte: &Tensor,
    wpe: &Tensor,
    policy: &Policy,
) -> Result<Tensor> {
    policy.validate()?;
    let [vocab, hidden] = two_dims(wte, "token embedding")?;
    let [max_seq, hidden2] = two_dims(wpe, "position embedding")?;
    if hidden != hidden2 || seq > max_seq || ids.len() != batch * seq {
        return Err(Error::ShapeMismatch {
            what:
                "embedding: ids must be [batch, seq] with seq <= positions and equal hidden sizes"
                    .into(),
            expected: vec![batch * seq, max_seq, hidden],
            found: vec![ids.len(), seq, hidden2],
        });
    }
    if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id >= vocab) {
        return Err(Error::InvalidParameter {
            name: "ids",
            reason: format!(
                "token id {id} at position {i} is not below the vocabulary size {vocab}"
            ),
        });
    }
    let ar = arith(policy);
    let te = cast_in(wte, policy);
    let pe = cast_in(wpe, policy);
    let mut out = Vec::with_capacity(batch * seq * hidden);
    for b in 0..batch {
        for t in 0..seq {
            let id = ids[b * seq + t];
            for h in 0..hidden {
                out.push(ar.ro(ar.add(te.values()[id * hidden + h], pe.values()[t * hidden + h])));
            }
        }
    }
    Ok(Tensor::from_parts_unchecked(
        &[batch, seq, hidden],
        out,
        policy.output,
    ))
}

/// Embedding gradients: dwte[v, :] = Σ over positions with id v of dy (in position order),
/// dwpe[t, :] = Σ_b dy[b, t, :] (in batch order); each sum reduced in the policy order and
/// rounded to `param_grad_format`. Rows of dwte never used are zero.
#[allow(clippy::too_many_arguments)] // mirrors `embedding`, plus the table sizes and formats
pub fn embedding_backward(
    ids: &[usize],
    batch: usize,
    seq: usize,
    vocab: usize,
    max_seq: usize,
    dy: &Tensor,
    policy: &Policy,
    param_grad_format: Format,
) -> Result<(Tensor, Tensor)> {
    policy.validate()?;
    let s = dy.expect_rank(3, "embedding backward dy")?;
    let hidden = s[2];
    if s[0] != batch || s[1] != seq || ids.len() != batch * seq || seq > max_seq {
        return Err(Error::ShapeMismatch {
            what: "embedding backward: dy must be [batch, seq, hidden]".into(),
            expected: vec![batch, seq, hidden],
            found: s.to_vec(),
        });
    }
    if let Some(&id) = ids.iter().find(|&&id| id >= vocab) {
        return Err(Error::InvalidParameter {
            name: "ids",
            reason: format!("token id {id} is not below the vocabulary size {vocab}"),
        });
    }
    let g = cast_in(dy, policy);
    let pg = Arith::new(
        policy.accumulator(),
        param_grad_format,
        policy.accumulation.overflow,
    );
    let acc = acc_for(policy, policy.input());
    let gv = g.values();
    let mut dte = vec![0.0; vocab * hidden];
    let mut positions: Vec<Vec<usize>> = vec![vec![]; vocab];
    for (p, &id) in ids.iter().enumerate() {
        positions[id].push(p);
    }
    let mut col = Vec::new();
    for (v, ps) in positions.iter().enumerate() {
        if ps.is_empty() {
            continue;
        }
        for h in 0..hidden {
            col.clear();
            col.extend(ps.iter().map(|&p| gv[p * hidden + h]));
            dte[v * hidden + h] = pg.ro(sum_unchecked(&col, &acc));
        }
    }
    let mut dpe = vec![0.0; max_seq * hidden];
    for t in 0..seq {
        for h in 0..hidden {
            col.clear();
            col.extend((0..batch).map(|b| gv[(b * seq + t) * hidden + h]));
            dpe[t * hidden + h] = pg.ro(sum_unchecked(&col, &acc));
        }
    }
    Ok((
        Tensor::from_parts_unchecked(&[vocab, hidden], dte, param_grad_format),
        Tensor::from_parts_unchecked(&[max_seq, hidden], dpe, param_grad_format),
    ))
}

fn two_dims(t: &Tensor, what: &str) -> Result<[usize; 2]> {
    let s = t.expect_rank(2, what)?;
    Ok([s[0], s[1]])
}

/// Mean cross-entropy of logits [rows, vocab] against integer targets. Per row:
/// m = max z; eⱼ = ra(exp(ra(zⱼ − m))); S = Σ eⱼ (policy order); lse = ra(m + ra(ln S));
/// ℓ = ra(lse − z_target). Loss = ro(ra(Σ ℓ / rows)) with Σ in the policy order.
pub fn cross_entropy(logits: &Tensor, targets: &[usize], policy: &Policy) -> Result<Tensor> {
    let (loss, _) = cross_entropy_with_lse(logits, targets, policy)?;
    Ok(loss)
}

fn cross_entropy_with_lse(
    logits: &Tensor,
    targets: &[usize],
    policy: &Policy,
) -> Result<(Tensor, Vec<f64>)> {
    policy.validate()?;
    let (rows, vocab) = last_dim(logits, "cross entropy")?;
    check_targets(targets, rows, vocab)?;
    let ar = arith(policy);
    let z = cast_in(logits, policy);
    let acc = acc_for(policy, policy.accumulator());
    let zv = z.values();
    let mut e = vec![0.0; vocab];
    let mut losses = Vec::with_capacity(rows);
    let mut lses = Vec::with_capacity(rows);
    for r in 0..rows {
        let row = &zv[r * vocab..(r + 1) * vocab];
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        for (ej, &zj) in e.iter_mut().zip(row) {
            *ej = ar.exp(ar.sub(zj, m));
        }
        let s = sum_unchecked(&e, &acc);
        let lse = ar.add(m, ar.ln(s));
        lses.push(lse);
        losses.push(ar.sub(lse, row[targets[r]]));
    }
    let total = sum_unchecked(&losses, &acc);
    let loss = ar.ro(ar.div(total, rows as f64));
    Ok((
        Tensor::from_parts_unchecked(&[], vec![loss], policy.output),
        lses,
    ))
}

fn check_targets(targets: &[usize], rows: usize, vocab: usize) -> Result<()> {
    if targets.len() != rows {
        return Err(Error::LengthMismatch {
            what: "cross entropy: one target per row",
            left: rows,
            right: targets.len(),
        });
    }
    if let Some((i, &t)) = targets.iter().enumerate().find(|(_, &t)| t >= vocab) {
        return Err(Error::InvalidParameter {
            name: "targets",
            reason: format!("target {t} at row {i} is not below the vocabulary size {vocab}"),
        });
    }
    Ok(())
}

/// Gradient of the mean cross-entropy times the upstream scalar `dloss`:
/// dzⱼ = ro(mul(sub(pⱼ, [j = target]), ra(dloss / rows))) with pⱼ = ra(exp(ra(zⱼ − lse))).
pub fn cross_entropy_backward(
    logits: &Tensor,
    targets: &[usize],
    dloss: f64,
    policy: &Policy,
) -> Result<Tensor> {
    let (_, lses) = cross_entropy_with_lse(logits, targets, policy)?;
    let (rows, vocab) = last_dim(logits, "cross entropy backward")?;
    let ar = arith(policy);
    let z = cast_in(logits, policy);
    let zv = z.values();
    let c = ar.div(ar.ra(dloss), rows as f64);
    let mut out = vec![0.0; zv.len()];
    for r in 0..rows {
        for j in 0..vocab {
            let p = ar.exp(ar.sub(zv[r * vocab + j], lses[r]));
            let onehot = if j == targets[r] { 1.0 } else { 0.0 };
            out[r * vocab + j] = ar.ro(ar.mul(ar.sub(p, onehot), c));
        }
    }
    Ok(Tensor::from_parts_unchecked(
        logits.shape(),
        out,
        policy.output,
    ))
}
