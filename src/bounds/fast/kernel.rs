//! The lane kernel: a [`Program`] executed on 16 output columns at a time in `f32`, with the
//! statistics of the rounding model gathered at every rounding it performs.
//!
//! Per rounding of a value x (result x̂, spacing U = ulp(x̂), which is at least the spacing
//! at the exact x: rounding to nearest is monotonic and powers of two are representable), with
//! g the operands' common grid (a product's grid is the product of its factors' lowest bits;
//! a computed value's as below):
//! * exact when g ≥ U (x is then a value of the result's grid);
//! * determined (for products exact in `f32`; η computed by TwoSum and summed apart, with the
//!   sum of |η| that bounds that sum's own rounding error), as the walk determines it: the
//!   operands exact (every rounding behind them exact: a function of the terms); or a product
//!   added to a running value on the result's grid (η = RN_U(t) − t whatever the value), a
//!   tie included when the value's bit at U is known; or a running value on U/2 whose bit
//!   there is known, but for a tie;
//! * otherwise random: a certain tie (one operand on the grid U, the other's lowest bit U/2)
//!   E(η²) = U²/4; else, under the uniform-phase model, E(η²) = U²/12 + g²/6, g ≤ U/2
//!   (papers/bounds-reductions.md §2 and §5.1).
//!
//! Grids are tracked as the walk tracks them: a rounded value's is its spacing U, an exact
//! sum's its operands' common grid, a value computed from exact operands its lowest set bit;
//! and with them whether the value's bit at its grid (its parity) is known ([`Lanes`]). The
//! values are scaled by powers of two per row of A and per column of B (exact), so that
//! products stay normal `f32` numbers and the squares of the spacings neither overflow nor
//! underflow `f32` for the values that matter.

use super::program::{Program, Step};

/// Output columns per tile: two AVX2 vectors, whose independent chains hide each other's
/// latency (a sequential order's running values depend step on step; 8 columns ran a
/// fast-priced sum 1.2× and small products 1.2–1.7× slower, 32 no faster than 16).
pub(super) const W: usize = 16;
/// Rows of A per band (a B panel is reused across them).
const BAND: usize = 16;
/// Floats per tile in the output: the values, the variance, the guaranteed sum, the
/// determined errors' sum and the sum of their magnitudes.
pub(super) const OUT: usize = 5 * W;

/// The exponent field of an `f32`: masking a value's bits with it gives 2^e (0 for zero and
/// subnormals), the value's spacing times 2^23.
const EXP: u32 = 0x7f80_0000;
/// An f32 spacing over its [`EXP`]-masked value: 2^-23.
const ULP: f32 = 1.0 / 8_388_608.0;

/// A and B as the kernel reads them (`f32`, scaled, with their lowest bits).
#[derive(Clone)]
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
/// Σ |a|·w·|b|, and as `det` says the sum of the determined roundings' errors and (tracking)
/// the sum of their magnitudes, what bounds the first sum's own rounding error. Rows × blocks
/// × `OUT`, row-major.
pub(super) fn run(program: &Program, p: &Packed, guaranteed: bool, det: Determine) -> Vec<f32> {
    run_tiles(program, p, pick(guaranteed, det), p.blocks)
}

/// The tiles of `p`'s first `blocks` column blocks through `tile_fn` (rows × `blocks` ×
/// `OUT`).
fn run_tiles(program: &Program, p: &Packed, tile_fn: TileFn, blocks: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; p.m * blocks * OUT];
    let band_len = BAND * blocks * OUT;
    crate::parallel::for_each_chunk_mut(&mut out, band_len, |(band, chunk)| {
        let rows = chunk.len() / (blocks * OUT);
        let mut lanes = Lanes::new(program.slots.max(1));
        for jb in 0..blocks {
            for r in 0..rows {
                let i = band * BAND + r;
                let o = (r * blocks + jb) * OUT;
                tile_fn(program, p, i, jb, &mut lanes, &mut chunk[o..o + OUT]);
            }
        }
    });
    out
}

/// Both sides' programs on every tile ([`run`]), the reference's with its guaranteed sum.
///
/// With `det` tracking and `shortcut`, a first pass of each program only executes it and
/// checks by TwoSum whether each of its roundings was exact ([`EXACT`], about a tenth of
/// the tracking pass's work). Where every rounding of an output is exact on both sides, the
/// tracking pass computes that output's value and guaranteed sum by the same operations and
/// finds every rounding determined with error 0 — a variance, determined errors and their
/// magnitudes of 0 — so the first pass's output is the tracking pass's, bit for bit; only
/// the columns with an inexact rounding somewhere are moved together (in `p`, left so) and
/// tracked, and their number is returned where the first pass ran. (Sums of BF16 values in
/// FP32 are mostly exact: 52 of the bench's 64 rows of 1,024.)
pub(super) fn run_pair(
    (pr, pc): (&Program, &Program),
    p: &mut Packed,
    det: Determine,
    shortcut: bool,
) -> (Vec<f32>, Vec<f32>, Option<usize>) {
    if det != Determine::Track || !shortcut {
        return (run(pr, p, true, det), run(pc, p, false, det), None);
    }
    // The first block as a sample: with fewer than half its outputs exact, the first pass
    // would cost more than it saves (FP16 sums: about a quarter exact).
    if p.blocks > 1 {
        let (_, sr) = run_exact(pr, p, true, 1);
        let (_, sc) = run_exact(pc, p, false, 1);
        let exact = sr.iter().zip(&sc).filter(|(r, c)| **r && **c).count();
        if 2 * exact < sr.len() {
            return (run(pr, p, true, det), run(pc, p, false, det), None);
        }
    }
    let (mut out_r, exact_r) = run_exact(pr, p, true, p.blocks);
    let (mut out_c, exact_c) = run_exact(pc, p, false, p.blocks);
    let blocks = p.blocks;
    let columns = blocks * W;
    let mut inexact = vec![false; columns];
    for (i, (er, ec)) in exact_r.iter().zip(&exact_c).enumerate() {
        inexact[i % columns] |= !(*er && *ec);
    }
    let tracked: Vec<usize> = (0..columns).filter(|&j| inexact[j]).collect();
    if tracked.is_empty() {
        return (out_r, out_c, Some(0));
    }
    compact(p, &tracked);
    let (sr, sc) = (run(pr, p, true, det), run(pc, p, false, det));
    for (out, from) in [(&mut out_r, &sr), (&mut out_c, &sc)] {
        for i in 0..p.m {
            for (c, &j) in tracked.iter().enumerate() {
                let o = (i * blocks + j / W) * OUT + j % W;
                let f = (i * p.blocks + c / W) * OUT + c % W;
                for part in 0..OUT / W {
                    out[o + part * W] = from[f + part * W];
                }
            }
        }
    }
    (out_r, out_c, Some(tracked.len()))
}

/// [`run`] in [`EXACT`] mode on the first `blocks` column blocks: the tiles' outputs, with
/// the off-magnitude slot zero (as the tracking pass leaves it where every rounding is
/// exact), and per row of A and column (`blocks · W` of them, the padding included) whether
/// every rounding was exact.
pub(super) fn run_exact(
    program: &Program,
    p: &Packed,
    guaranteed: bool,
    blocks: usize,
) -> (Vec<f32>, Vec<bool>) {
    let mut out = run_tiles(program, p, pick_mode(guaranteed, EXACT), blocks);
    let mut exact = Vec::with_capacity(p.m * blocks * W);
    for tile in out.chunks_exact_mut(OUT) {
        exact.extend(tile[4 * W..].iter().map(|&f| f == 1.0));
        tile[4 * W..].fill(0.0);
    }
    (out, exact)
}

/// `p` reduced in place to B's columns `columns` (ascending; packed `W` to a block in that
/// order, the lanes past them zero columns), A as it is. Column `columns[c]` moves to `c ≤`
/// it, so every column is read before a later one is written over it.
fn compact(p: &mut Packed, columns: &[usize]) {
    let k = p.k;
    let blocks = columns.len().div_ceil(W);
    let lane = |c: usize| (c / W) * k * W + c % W;
    let moves: Vec<(usize, usize)> = columns
        .iter()
        .enumerate()
        .filter(|&(c, &j)| c != j)
        .map(|(c, &j)| (lane(c), lane(j)))
        .collect();
    let pad: Vec<usize> = (columns.len()..blocks * W).map(lane).collect();
    // Step by step, so that each step's lines are read and written together.
    for t in 0..k {
        let at = t * W;
        for &(to, from) in &moves {
            p.b[to + at] = p.b[from + at];
            p.lb[to + at] = p.lb[from + at];
        }
        for &to in &pad {
            p.b[to + at] = 0.0;
            p.lb[to + at] = f32::INFINITY;
        }
    }
    p.blocks = blocks;
    p.b.truncate(blocks * k * W);
    p.lb.truncate(blocks * k * W);
}

/// What the model knows of each slot's computed value x̂, per lane: the value; its grid (a
/// power of two x̂ is a multiple of, ·2^23); whether it is exact (every rounding behind it
/// exact, x̂ = x: 1.0, else 0.0); and whether its bit at its grid — the parity that decides a
/// tie on that grid — is known to the model (1.0) or not (0.0), as the walk's parity chain.
pub(super) struct Lanes {
    value: Vec<[f32; W]>,
    grid: Vec<[f32; W]>,
    exact: Vec<[f32; W]>,
    parity: Vec<[f32; W]>,
}

impl Lanes {
    fn new(slots: usize) -> Lanes {
        let zero = vec![[0.0f32; W]; slots];
        Lanes {
            value: zero.clone(),
            grid: zero.clone(),
            exact: zero.clone(),
            parity: zero,
        }
    }
}

/// Which roundings the kernel determines (the rest it prices as random).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Determine {
    /// None: products that may round (inputs of more than 12 significant bits).
    Nothing,
    /// Products added to a running value on the result's grid (not ties).
    Grid,
    /// Those, and as the walk: roundings of exact operands, ties and half-grid positions on
    /// a known parity. About twice the work per rounding; what short sums of narrow values
    /// need (almost all of their roundings are determined).
    Track,
}

const NOTHING: u8 = 0;
const GRID: u8 = 1;
const TRACK: u8 = 2;
/// Only the executed values, the guaranteed sum, and per lane whether every rounding of the
/// program was exact (TwoSum), in the off-magnitude slot ([`run_exact`]).
const EXACT: u8 = 3;

type TileFn = fn(&Program, &Packed, usize, usize, &mut Lanes, &mut [f32]);

fn pick(guaranteed: bool, det: Determine) -> TileFn {
    pick_mode(
        guaranteed,
        match det {
            Determine::Nothing => NOTHING,
            Determine::Grid => GRID,
            Determine::Track => TRACK,
        },
    )
}

fn pick_mode(guaranteed: bool, mode: u8) -> TileFn {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::arch::has(crate::arch::Isa::Avx2Fma) {
            return match (guaranteed, mode) {
                (true, NOTHING) => tile_avx2::<true, NOTHING>,
                (true, GRID) => tile_avx2::<true, GRID>,
                (true, TRACK) => tile_avx2::<true, TRACK>,
                (true, _) => tile_avx2::<true, EXACT>,
                (false, NOTHING) => tile_avx2::<false, NOTHING>,
                (false, GRID) => tile_avx2::<false, GRID>,
                (false, TRACK) => tile_avx2::<false, TRACK>,
                (false, _) => tile_avx2::<false, EXACT>,
            };
        }
    }
    match (guaranteed, mode) {
        (true, NOTHING) => tile::<true, NOTHING>,
        (true, GRID) => tile::<true, GRID>,
        (true, TRACK) => tile::<true, TRACK>,
        (true, _) => tile::<true, EXACT>,
        (false, NOTHING) => tile::<false, NOTHING>,
        (false, GRID) => tile::<false, GRID>,
        (false, TRACK) => tile::<false, TRACK>,
        (false, _) => tile::<false, EXACT>,
    }
}

#[cfg(target_arch = "x86_64")]
fn tile_avx2<const G: bool, const MODE: u8>(
    program: &Program,
    p: &Packed,
    i: usize,
    jb: usize,
    lanes: &mut Lanes,
    out: &mut [f32],
) {
    #[target_feature(enable = "avx2,fma")]
    unsafe fn inner<const G: bool, const MODE: u8>(
        program: &Program,
        p: &Packed,
        i: usize,
        jb: usize,
        lanes: &mut Lanes,
        out: &mut [f32],
    ) {
        tile::<G, MODE>(program, p, i, jb, lanes, out)
    }
    // SAFETY: chosen by `pick` only when the CPU has AVX2 and FMA.
    unsafe { inner::<G, MODE>(program, p, i, jb, lanes, out) }
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

/// The lowest set bit of `x` (·2^23, as the grids are kept): the grid of a value the model
/// knows (∞ for zero, which lies on every grid).
#[inline(always)]
fn lowest_grid(x: f32) -> f32 {
    let bits = x.to_bits();
    let mant = (bits & 0x007f_ffff) | 0x0080_0000;
    let lsb = mant & mant.wrapping_neg();
    let g = f32::from_bits(bits & EXP) * (lsb as i32 as f32);
    if x == 0.0 {
        f32::INFINITY
    } else {
        g
    }
}

/// The exact error of s = fl(x + y) (Knuth's TwoSum: x + y = s + e).
#[inline(always)]
fn two_sum_err(x: f32, y: f32, s: f32) -> f32 {
    let by = s - x;
    (x - (s - by)) + (y - by)
}

/// 0.0 or 1.0 for a condition (weights rather than branches, which keep the lanes
/// vectorized without masked stores).
#[inline(always)]
fn w(c: bool) -> f32 {
    c as u32 as f32
}

/// One tile (row `i`, column block `jb`): the portable code, vectorized over the `W` lanes
/// (compiled with AVX2 and FMA by [`tile_avx2`]; `mul_add` is a correctly rounded fused
/// multiply-add either way).
#[inline(always)]
fn tile<const G: bool, const MODE: u8>(
    program: &Program,
    p: &Packed,
    i: usize,
    jb: usize,
    lanes: &mut Lanes,
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
    let mut off_abs = [0.0f32; W];
    // EXACT: 1.0 while every rounding of the lane has been exact.
    let mut all_exact = [1.0f32; W];
    for step in &program.steps {
        match step {
            Step::Start { slot, term, .. } if MODE == EXACT => {
                let t = *term;
                let a = arow[t];
                let b = &bpan[t * W..(t + 1) * W];
                let s = &mut lanes.value[*slot];
                for l in 0..W {
                    let p = a * b[l];
                    all_exact[l] *= w(a.mul_add(b[l], -p) == 0.0);
                    s[l] = p;
                }
                if G {
                    let aw = awrow[t];
                    for l in 0..W {
                        gsum[l] = aw.mul_add(b[l].abs(), gsum[l]);
                    }
                }
            }
            Step::Chain { slot, terms, .. } if MODE == EXACT => {
                let mut sv = lanes.value[*slot];
                for t in terms.clone() {
                    let (a, aw) = (arow[t], awrow[t]);
                    let b = &bpan[t * W..(t + 1) * W];
                    for l in 0..W {
                        let x = sv[l];
                        let nx = a.mul_add(b[l], x);
                        all_exact[l] *= w(two_sum_err(x, a * b[l], nx) == 0.0);
                        sv[l] = nx;
                        if G {
                            gsum[l] = aw.mul_add(b[l].abs(), gsum[l]);
                        }
                    }
                }
                lanes.value[*slot] = sv;
            }
            Step::Add { into, from, .. } if MODE == EXACT => {
                let y = lanes.value[*from];
                let s = &mut lanes.value[*into];
                for l in 0..W {
                    let nx = s[l] + y[l];
                    all_exact[l] *= w(two_sum_err(s[l], y[l], nx) == 0.0);
                    s[l] = nx;
                }
            }
            Step::Start { slot, term, count } => {
                // The prefix both orders share makes the same errors on both sides.
                let cf = w(*count);
                let t = *term;
                let a = arow[t];
                let la = larow[t];
                let b = &bpan[t * W..(t + 1) * W];
                let lb = &lbpan[t * W..(t + 1) * W];
                // With exact products (tracked) the value is exact, and its grid is its lowest
                // set bit: its bit there is 1, known.
                lanes.exact[*slot] = [w(MODE == TRACK); W];
                lanes.parity[*slot] = [w(MODE == TRACK); W];
                let (s, gr) = (&mut lanes.value[*slot], &mut lanes.grid[*slot]);
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
                let cf = w(*count);
                // The chain's values in registers (a copy), written back at its end.
                let mut sv = lanes.value[*slot];
                let mut lv = lanes.grid[*slot];
                let mut xv = lanes.exact[*slot];
                let mut pv = lanes.parity[*slot];
                for t in terms.clone() {
                    let (a, la, aw) = (arow[t], larow[t], awrow[t]);
                    let b = &bpan[t * W..(t + 1) * W];
                    let lb = &lbpan[t * W..(t + 1) * W];
                    for l in 0..W {
                        let x = sv[l];
                        let nx = a.mul_add(b[l], x);
                        let m = f32::from_bits(nx.to_bits() & EXP);
                        // The product's grid is its factors' lowest bits multiplied.
                        let gt = la * lb[l];
                        let (v, g) = site(gt, lv[l], m);
                        if MODE == NOTHING {
                            var[l] += v * cf;
                            lv[l] = g;
                        } else {
                            // The rounding's error (x + p = x̂ + e), by TwoSum from the exact
                            // product p. It is determined (papers/bounds-reductions.md §2)
                            // * when x lies on the result's grid U: RN_U(p) − p, whatever x,
                            //   but for a tie;
                            // and when tracking, as the walk,
                            // * for a tie too when x's bit at U is known (x on a coarser
                            //   grid: 0);
                            // * when x is exact: a function of the terms;
                            // * when x lies on U/2 with its bit there known (x = mU + ρ, ρ
                            //   known), but for a tie (its direction is x's unknown bit at U).
                            // Otherwise it is random, as is a tie on x's unknown parity.
                            let e = two_sum_err(x, a * b[l], nx);
                            let g0 = lv[l];
                            let tie = e.abs() == 0.5 * ULP * m;
                            let det = if MODE == TRACK {
                                let k0 = pv[l] != 0.0;
                                let bit_at_u = (g0 > m) | ((g0 == m) & k0);
                                let on_grid = (g0 > m) | ((g0 == m) & (!tie | k0));
                                let on_half = (g0 == 0.5 * m) & k0 & !tie;
                                let det = w(on_grid | on_half).max(xv[l]);
                                // Afterwards: exact after an exact rounding only. The bit at
                                // the new grid: for an exact sum, x's (when x's grid is the
                                // finer) or p's (its lowest bit, 1); after a rounding, known
                                // when its result is (x's bit at U known and the rounding
                                // determined), and for a tie the model recognizes as one
                                // (x's position on U known: the result is even). A rounding of
                                // exact operands gives a value the model knows whole (the
                                // walk's lattice: its lowest set bit).
                                let inexact = gt.min(g0) < m;
                                let seen_tie = tie & ((g0 >= m) | ((g0 == 0.5 * m) & k0));
                                let whole = xv[l] != 0.0;
                                let rounded_known = seen_tie | ((det != 0.0) & bit_at_u);
                                let exact_known = k0 | (g0 > gt);
                                let known = (inexact & rounded_known) | (!inexact & exact_known);
                                pv[l] = w(known | whole);
                                lv[l] = if whole { lowest_grid(nx) } else { g };
                                xv[l] *= w(e == 0.0);
                                det
                            } else {
                                lv[l] = g;
                                w((g0 >= m) & !tie)
                            };
                            // Weights 0 or 1 rather than conditional updates, which compile
                            // to masked stores.
                            let wd = det * cf;
                            off[l] -= e * wd;
                            if MODE == TRACK {
                                off_abs[l] += e.abs() * wd;
                            }
                            var[l] += v * (cf - wd);
                        }
                        sv[l] = nx;
                        if G {
                            gsum[l] = aw.mul_add(b[l].abs(), gsum[l]);
                        }
                    }
                }
                lanes.grid[*slot] = lv;
                lanes.value[*slot] = sv;
                lanes.exact[*slot] = xv;
                lanes.parity[*slot] = pv;
            }
            Step::Add { into, from, count } => {
                let cf = w(*count);
                let (y, gy, xy, py) = (
                    lanes.value[*from],
                    lanes.grid[*from],
                    lanes.exact[*from],
                    lanes.parity[*from],
                );
                let (s, gx, xx, px) = (
                    &mut lanes.value[*into],
                    &mut lanes.grid[*into],
                    &mut lanes.exact[*into],
                    &mut lanes.parity[*into],
                );
                for l in 0..W {
                    let nx = s[l] + y[l];
                    let m = f32::from_bits(nx.to_bits() & EXP);
                    let (v, g) = site(gx[l], gy[l], m);
                    if MODE == TRACK {
                        // Two exact values: the rounding is a function of the terms, its
                        // error by TwoSum. Otherwise random (ties included).
                        let e = two_sum_err(s[l], y[l], nx);
                        let both = xx[l] * xy[l];
                        let wd = both * cf;
                        off[l] -= e * wd;
                        off_abs[l] += e.abs() * wd;
                        var[l] += v * (cf - wd);
                        // The bit at the new grid: an exact sum's is known when each operand's
                        // bit there is (0 on a coarser grid); a rounding's when it was
                        // determined by exact values.
                        let lo = gx[l].min(gy[l]);
                        let exact_known =
                            ((gx[l] > lo) | (px[l] != 0.0)) & ((gy[l] > lo) | (py[l] != 0.0));
                        let known = ((lo < m) & (both != 0.0)) | ((lo >= m) & exact_known);
                        px[l] = w(known);
                        gx[l] = if both != 0.0 { lowest_grid(nx) } else { g };
                        xx[l] = both * w(e == 0.0);
                    } else {
                        var[l] += v * cf;
                        gx[l] = g;
                    }
                    s[l] = nx;
                }
            }
        }
    }
    out[..W].copy_from_slice(&lanes.value[program.result]);
    for (o, v) in out[W..2 * W].iter_mut().zip(&var) {
        *o = v / 24.0;
    }
    out[2 * W..3 * W].copy_from_slice(&gsum);
    out[3 * W..4 * W].copy_from_slice(&off);
    if MODE == EXACT {
        out[4 * W..].copy_from_slice(&all_exact);
    } else {
        out[4 * W..].copy_from_slice(&off_abs);
    }
}
