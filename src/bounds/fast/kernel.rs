//! The lane kernel: a [`Program`] executed on 16 output columns at a time in `f32`, with the
//! statistics of the all-random rounding model gathered at every rounding it performs.
//!
//! Per rounding of a value x (result x̂, spacing U = ulp(x̂), which is at least the spacing
//! at the exact x: rounding to nearest is monotonic and powers of two are representable):
//! * exact when both operands lie on the grid U (then x is a value of that binade's grid);
//!   the operands' grids are bounded below by their lowest set bit (a product: the product
//!   of its factors' lowest bits) or, for a computed value, its own spacing;
//! * otherwise, under the uniform-phase model, E(η²) = U²/12 + g²/6 with g the operands'
//!   common grid, g ≤ U/2 (papers/bounds-reductions.md §2); g is bounded above by the
//!   product's lowest bit and by U/2.
//!
//! Both tests use upper bounds of E(η²) where the grid is not known exactly, so the variance
//! gathered is at least the model's. The values are scaled by powers of two per row of A and
//! per column of B (exact), so that products stay normal `f32` numbers and the squares of the
//! spacings neither overflow nor underflow `f32` for the values that matter.

use super::program::{Program, Step};

/// Output columns per tile.
pub(super) const W: usize = 16;
/// Rows of A per band (a B panel is reused across them).
const BAND: usize = 16;
/// Floats per tile in the output: the values, the variance and the guaranteed sum.
pub(super) const OUT: usize = 3 * W;

/// The exponent field of an `f32`: masking a value's bits with it gives 2^e (0 for zero and
/// subnormals), the value's spacing times 2^23.
const EXP: u32 = 0x7f80_0000;

/// A and B as the kernel reads them (`f32`, scaled, with their lowest bits).
pub(super) struct Packed {
    pub m: usize,
    pub k: usize,
    /// 16-column blocks of B.
    pub blocks: usize,
    /// A row-major, each row scaled.
    pub a: Vec<f32>,
    /// The lowest set bit of each scaled A value times 2^23 (∞ for 0).
    pub la: Vec<f32>,
    /// |a|·w_p of each scaled A value (the guaranteed bound's weight of its term).
    pub aw: Vec<f32>,
    /// B in blocks of 16 columns, each block step-major (16 values per term), columns scaled
    /// (zero columns past n).
    pub b: Vec<f32>,
    /// The lowest set bit of each scaled B value (∞ for 0).
    pub lb: Vec<f32>,
}

/// Run `program` on every tile: for each row of A and block of 16 columns, `OUT` floats —
/// the results, the variance gathered (in units of 2^-46·scale²) and, with `guaranteed`,
/// Σ |a|·w·|b|. Rows × blocks × `OUT`, row-major.
pub(super) fn run(program: &Program, p: &Packed, guaranteed: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; p.m * p.blocks * OUT];
    let band_len = BAND * p.blocks * OUT;
    let tile_fn = pick(guaranteed);
    crate::parallel::for_each_chunk_mut(&mut out, band_len, |(band, chunk)| {
        let rows = chunk.len() / (p.blocks * OUT);
        let mut slots = vec![[0.0f32; W]; program.slots.max(1)];
        for jb in 0..p.blocks {
            for r in 0..rows {
                let i = band * BAND + r;
                let o = (r * p.blocks + jb) * OUT;
                tile_fn(program, p, i, jb, &mut slots, &mut chunk[o..o + OUT]);
            }
        }
    });
    out
}

type TileFn = fn(&Program, &Packed, usize, usize, &mut [[f32; W]], &mut [f32]);

fn pick(guaranteed: bool) -> TileFn {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return if guaranteed {
                tile_avx2::<true>
            } else {
                tile_avx2::<false>
            };
        }
    }
    if guaranteed {
        tile::<true>
    } else {
        tile::<false>
    }
}

#[cfg(target_arch = "x86_64")]
fn tile_avx2<const G: bool>(
    program: &Program,
    p: &Packed,
    i: usize,
    jb: usize,
    slots: &mut [[f32; W]],
    out: &mut [f32],
) {
    #[target_feature(enable = "avx2,fma")]
    unsafe fn inner<const G: bool>(
        program: &Program,
        p: &Packed,
        i: usize,
        jb: usize,
        slots: &mut [[f32; W]],
        out: &mut [f32],
    ) {
        tile::<G>(program, p, i, jb, slots, out)
    }
    // SAFETY: chosen by `pick` only when the CPU has AVX2 and FMA.
    unsafe { inner::<G>(program, p, i, jb, slots, out) }
}

/// The smaller of two values that are not NaN (one instruction, unlike `f32::min`).
#[inline(always)]
fn min(x: f32, y: f32) -> f32 {
    if x < y {
        x
    } else {
        y
    }
}

/// One tile (row `i`, column block `jb`): the portable code, vectorized over the 16 lanes
/// (compiled with AVX2 and FMA by [`tile_avx2`]; `mul_add` is a correctly rounded fused
/// multiply-add either way).
#[inline(always)]
fn tile<const G: bool>(
    program: &Program,
    p: &Packed,
    i: usize,
    jb: usize,
    slots: &mut [[f32; W]],
    out: &mut [f32],
) {
    let k = p.k;
    let arow = &p.a[i * k..(i + 1) * k];
    let larow = &p.la[i * k..(i + 1) * k];
    let awrow = &p.aw[i * k..(i + 1) * k];
    let bpan = &p.b[jb * k * W..(jb + 1) * k * W];
    let lbpan = &p.lb[jb * k * W..(jb + 1) * k * W];
    let mut var = [0.0f32; W];
    let mut g = [0.0f32; W];
    for step in &program.steps {
        match step {
            Step::Start { slot, term } => {
                let t = *term;
                let a = arow[t];
                let b: &[f32; W] = bpan[t * W..(t + 1) * W].try_into().unwrap();
                let s = &mut slots[*slot];
                for l in 0..W {
                    s[l] = a * b[l];
                }
                if G {
                    let aw = awrow[t];
                    for l in 0..W {
                        g[l] = aw.mul_add(b[l].abs(), g[l]);
                    }
                }
            }
            Step::Chain { slot, terms } => {
                // The chain's values in registers (a copy), written back at its end.
                let mut sv = slots[*slot];
                // The spacing (·2^23) of each lane's current value, carried from step to step.
                let mut mv = [0.0f32; W];
                for l in 0..W {
                    mv[l] = f32::from_bits(sv[l].to_bits() & EXP);
                }
                for t in terms.clone() {
                    let (a, la, aw) = (arow[t], larow[t], awrow[t]);
                    let b: &[f32; W] = bpan[t * W..(t + 1) * W].try_into().unwrap();
                    let lb: &[f32; W] = lbpan[t * W..(t + 1) * W].try_into().unwrap();
                    for l in 0..W {
                        let x = sv[l];
                        let nx = a.mul_add(b[l], x);
                        let m = f32::from_bits(nx.to_bits() & EXP);
                        let mp = mv[l];
                        mv[l] = m;
                        let lbt = la * lb[l];
                        // 2g bounded above by twice the product's lowest bit and by U:
                        // E(η²)·24 = 2U² + (2g)².
                        let g2 = min(lbt + lbt, m);
                        let term = g2.mul_add(g2, 2.0 * m * m);
                        var[l] += if min(lbt, mp) < m { term } else { 0.0 };
                        sv[l] = nx;
                        if G {
                            g[l] = aw.mul_add(b[l].abs(), g[l]);
                        }
                    }
                }
                slots[*slot] = sv;
            }
            Step::Add { into, from } => {
                let y = slots[*from];
                let s = &mut slots[*into];
                for l in 0..W {
                    let x = s[l];
                    let nx = x + y[l];
                    let m = f32::from_bits(nx.to_bits() & EXP);
                    let mx = f32::from_bits(x.to_bits() & EXP);
                    let my = f32::from_bits(y[l].to_bits() & EXP);
                    // g ≤ U/2 when inexact: (U²/12 + U²/24)·24 = 3U².
                    var[l] += if min(mx, my) < m { 3.0 * m * m } else { 0.0 };
                    s[l] = nx;
                }
            }
        }
    }
    out[..W].copy_from_slice(&slots[program.result]);
    for (o, v) in out[W..2 * W].iter_mut().zip(&var) {
        *o = v / 24.0;
    }
    out[2 * W..].copy_from_slice(&g);
}
