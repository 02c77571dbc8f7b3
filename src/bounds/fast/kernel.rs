//! The lane kernel: a [`Program`] executed on 8 output columns at a time in `f32`, with the
//! statistics of the rounding model gathered at every rounding it performs.
//!
//! Per rounding of a value x (result x̂, spacing U = ulp(x̂), which is at least the spacing
//! at the exact x: rounding to nearest is monotonic and powers of two are representable), with
//! g the operands' common grid (a product's grid is the product of its factors' lowest bits;
//! a computed value's as below):
//! * exact when g ≥ U (x is then a value of the result's grid);
//! * a product added to a running value that lies on the result's grid: determined, η =
//!   RN_U(t) − t whatever the value (for products exact in `f32`), computed by TwoSum and summed
//!   apart — unless it is a tie, whose direction follows the value's parity;
//! * otherwise random: a certain tie (one operand on the grid U, the other's lowest bit U/2)
//!   E(η²) = U²/4; else, under the uniform-phase model, E(η²) = U²/12 + g²/6, g ≤ U/2
//!   (papers/bounds-reductions.md §2 and §5.1).
//!
//! Grids are tracked as the walk tracks them: a rounded value's is its spacing U, an exact
//! sum's its operands' common grid. The values are scaled by powers of two per row of A and
//! per column of B (exact), so that products stay normal `f32` numbers and the squares of the
//! spacings neither overflow nor underflow `f32` for the values that matter.

use super::program::{Program, Step};

/// Output columns per tile.
pub(super) const W: usize = 8;
/// Rows of A per band (a B panel is reused across them).
const BAND: usize = 16;
/// Floats per tile in the output: the values, the variance, the guaranteed sum and the
/// determined errors' sum.
pub(super) const OUT: usize = 4 * W;

/// The exponent field of an `f32`: masking a value's bits with it gives 2^e (0 for zero and
/// subnormals), the value's spacing times 2^23.
const EXP: u32 = 0x7f80_0000;
/// An f32 spacing over its [`EXP`]-masked value: 2^-23.
const ULP: f32 = 1.0 / 8_388_608.0;

/// A and B as the kernel reads them (`f32`, scaled, with their lowest bits).
pub(super) struct Packed {
    pub m: usize,
    pub k: usize,
    /// `W`-column blocks of B.
    pub blocks: usize,
    /// A row-major, each row scaled.
    pub a: Vec<f32>,
    /// The lowest set bit of each scaled A value times 2^23 (∞ for 0).
    pub la: Vec<f32>,
    /// |a|·w_p of each scaled A value (the guaranteed bound's weight of its term).
    pub aw: Vec<f32>,
    /// B in blocks of `W` columns, each block step-major (`W` values per term), columns scaled
    /// (zero columns past n).
    pub b: Vec<f32>,
    /// The lowest set bit of each scaled B value (∞ for 0).
    pub lb: Vec<f32>,
}

/// Run `program` on every tile: for each row of A and block of `W` columns, `OUT` floats —
/// the results, the variance gathered (in units of 2^-46·scale²), with `guaranteed`
/// Σ |a|·w·|b|, and with `det` (exact products only) the sum of the determined roundings'
/// errors. Rows × blocks × `OUT`, row-major.
pub(super) fn run(program: &Program, p: &Packed, guaranteed: bool, det: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; p.m * p.blocks * OUT];
    let band_len = BAND * p.blocks * OUT;
    let tile_fn = pick(guaranteed, det);
    crate::parallel::for_each_chunk_mut(&mut out, band_len, |(band, chunk)| {
        let rows = chunk.len() / (p.blocks * OUT);
        let mut slots = vec![[0.0f32; W]; program.slots.max(1)];
        let mut grids = vec![[0.0f32; W]; program.slots.max(1)];
        for jb in 0..p.blocks {
            for r in 0..rows {
                let i = band * BAND + r;
                let o = (r * p.blocks + jb) * OUT;
                tile_fn(
                    program,
                    p,
                    i,
                    jb,
                    &mut slots,
                    &mut grids,
                    &mut chunk[o..o + OUT],
                );
            }
        }
    });
    out
}

type TileFn = fn(&Program, &Packed, usize, usize, &mut [[f32; W]], &mut [[f32; W]], &mut [f32]);

fn pick(guaranteed: bool, det: bool) -> TileFn {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return match (guaranteed, det) {
                (true, true) => tile_avx2::<true, true>,
                (true, false) => tile_avx2::<true, false>,
                (false, true) => tile_avx2::<false, true>,
                (false, false) => tile_avx2::<false, false>,
            };
        }
    }
    match (guaranteed, det) {
        (true, true) => tile::<true, true>,
        (true, false) => tile::<true, false>,
        (false, true) => tile::<false, true>,
        (false, false) => tile::<false, false>,
    }
}

#[cfg(target_arch = "x86_64")]
fn tile_avx2<const G: bool, const DET: bool>(
    program: &Program,
    p: &Packed,
    i: usize,
    jb: usize,
    slots: &mut [[f32; W]],
    grids: &mut [[f32; W]],
    out: &mut [f32],
) {
    #[target_feature(enable = "avx2,fma")]
    unsafe fn inner<const G: bool, const DET: bool>(
        program: &Program,
        p: &Packed,
        i: usize,
        jb: usize,
        slots: &mut [[f32; W]],
        grids: &mut [[f32; W]],
        out: &mut [f32],
    ) {
        tile::<G, DET>(program, p, i, jb, slots, grids, out)
    }
    // SAFETY: chosen by `pick` only when the CPU has AVX2 and FMA.
    unsafe { inner::<G, DET>(program, p, i, jb, slots, grids, out) }
}

/// One rounding of the sum of two operands on grids g1, g2 (lowest bits, ·2^23) to a result
/// of spacing U = m·2^-23: its E(η²)·24·2^46 under the model and the result's grid.
/// * min(g1, g2) ≥ U: exact, and the result keeps the operands' common grid;
/// * one operand on the grid U and the other's lowest bit U/2: the sum lies halfway, a tie
///   (|η| = U/2, E(η²) = U²/4), whatever the rest of its bits;
/// * otherwise uniform phase: U²/12 + g²/6 with g = min(g1, g2) ≤ U/2.
///
/// An inexact result's grid is U (the values a rounding returns).
#[inline(always)]
fn site(g1: f32, g2: f32, m: f32) -> (f32, f32) {
    // Selects and 0/1 weights only, so that the lanes vectorize without masked stores.
    let lo = if g1 < g2 { g1 } else { g2 };
    let hi = if g1 < g2 { g2 } else { g1 };
    let inexact = (lo < m) as u32 as f32;
    let tie = ((lo == 0.5 * m) & (hi >= m)) as u32 as f32;
    // g ≤ U/2 where it counts; capped so that an infinite grid (a zero operand) stays
    // finite.
    let capped = if lo < m { lo } else { m };
    let g = capped + capped;
    let m2 = m * m;
    let uniform = g.mul_add(g, 2.0 * m2);
    let v = inexact * (uniform + tie * (6.0 * m2 - uniform));
    (v, if lo < m { m } else { lo })
}

/// One tile (row `i`, column block `jb`): the portable code, vectorized over the `W` lanes
/// (compiled with AVX2 and FMA by [`tile_avx2`]; `mul_add` is a correctly rounded fused
/// multiply-add either way).
#[inline(always)]
fn tile<const G: bool, const DET: bool>(
    program: &Program,
    p: &Packed,
    i: usize,
    jb: usize,
    slots: &mut [[f32; W]],
    grids: &mut [[f32; W]],
    out: &mut [f32],
) {
    let k = p.k;
    let arow = &p.a[i * k..(i + 1) * k];
    let larow = &p.la[i * k..(i + 1) * k];
    let awrow = &p.aw[i * k..(i + 1) * k];
    let bpan = &p.b[jb * k * W..(jb + 1) * k * W];
    let lbpan = &p.lb[jb * k * W..(jb + 1) * k * W];
    let mut var = [0.0f32; W];
    let mut gsum = [0.0f32; W];
    let mut off = [0.0f32; W];
    for step in &program.steps {
        match step {
            Step::Start { slot, term, count } => {
                // The prefix both orders share makes the same errors on both sides.
                let cf = if *count { 1.0f32 } else { 0.0 };
                let t = *term;
                let a = arow[t];
                let la = larow[t];
                let b = &bpan[t * W..(t + 1) * W];
                let lb = &lbpan[t * W..(t + 1) * W];
                let (s, gr) = (&mut slots[*slot], &mut grids[*slot]);
                for l in 0..W {
                    // The product rounded into FP32: exact unless its lowest bit lies below
                    // the result's spacing (inputs of more than 12 significant bits).
                    let p = a * b[l];
                    let m = f32::from_bits(p.to_bits() & EXP);
                    let (v, g) = site(la * lb[l], f32::INFINITY, m);
                    var[l] += v * cf;
                    gr[l] = g;
                    s[l] = p;
                }
                if G {
                    let aw = awrow[t];
                    for l in 0..W {
                        gsum[l] = aw.mul_add(b[l].abs(), gsum[l]);
                    }
                }
            }
            Step::Chain { slot, terms, count } => {
                let cf = if *count { 1.0f32 } else { 0.0 };
                // The chain's values in registers (a copy), written back at its end.
                let mut sv = slots[*slot];
                let mut lv = grids[*slot];
                for t in terms.clone() {
                    let (a, la, aw) = (arow[t], larow[t], awrow[t]);
                    let b = &bpan[t * W..(t + 1) * W];
                    let lb = &lbpan[t * W..(t + 1) * W];
                    for l in 0..W {
                        let x = sv[l];
                        let nx = a.mul_add(b[l], x);
                        let m = f32::from_bits(nx.to_bits() & EXP);
                        // The product's grid is its factors' lowest bits multiplied.
                        let (v, g) = site(la * lb[l], lv[l], m);
                        if DET {
                            // x on the result's grid: η = RN_U(t) − t, whatever x is
                            // (papers/bounds-reductions.md §2), computed by TwoSum from the
                            // exact product p. A tie's direction follows x's parity: random.
                            let p = a * b[l];
                            let bp = nx - x;
                            let e = (x - (nx - bp)) + (p - bp);
                            let det = (lv[l] >= m) & (e.abs() != 0.5 * ULP * m);
                            // Weights 0 or 1 rather than conditional updates, which compile
                            // to masked stores.
                            let wd = (det as u32 as f32) * cf;
                            off[l] -= e * wd;
                            var[l] += v * (cf - wd);
                        } else {
                            var[l] += v * cf;
                        }
                        lv[l] = g;
                        sv[l] = nx;
                        if G {
                            gsum[l] = aw.mul_add(b[l].abs(), gsum[l]);
                        }
                    }
                }
                grids[*slot] = lv;
                slots[*slot] = sv;
            }
            Step::Add { into, from, count } => {
                let cf = if *count { 1.0f32 } else { 0.0 };
                let (y, gy) = (slots[*from], grids[*from]);
                let (s, gx) = (&mut slots[*into], &mut grids[*into]);
                for l in 0..W {
                    let nx = s[l] + y[l];
                    let m = f32::from_bits(nx.to_bits() & EXP);
                    let (v, g) = site(gx[l], gy[l], m);
                    var[l] += v * cf;
                    gx[l] = g;
                    s[l] = nx;
                }
            }
        }
    }
    out[..W].copy_from_slice(&slots[program.result]);
    for (o, v) in out[W..2 * W].iter_mut().zip(&var) {
        *o = v / 24.0;
    }
    out[2 * W..3 * W].copy_from_slice(&gsum);
    out[3 * W..].copy_from_slice(&off);
}
