//! The native `f32` matrix-product kernel behind the FP32-accumulation fast path of
//! [`matmul`](crate::engine::matmul()): packed operands, a 6×16 register tile, and the
//! reduction cut into chunks of [`KC`] steps whose running sums are kept in `f32` between
//! chunks — so every element of C follows exactly the sequence of `f32` operations of the
//! emulated order (a product, then sequential additions, per block of the reduction; blocks
//! added to the running total in order), whatever the chunking, the packing, or the thread that
//! computes it.
//!
//! Structure (GotoBLAS: Goto & van de Geijn, "Anatomy of high-performance matrix
//! multiplication", ACM TOMS 34(3), 2008): for each chunk of the reduction, B's rows of the chunk are packed into
//! panels of 16 columns (zero-padded), each band of [`MC`] rows of A into panels of 6 rows, and
//! each 6×16 tile of C is updated by a microkernel that reads both panels contiguously (the B
//! panel stays in L1 while the band's tiles use it). Bands run on the rayon pool for large
//! products.

/// Rows of a register tile.
const MR: usize = 6;
/// Columns of a register tile (two AVX registers of 8 lanes).
const NR: usize = 16;
/// Elements of a tile.
const TILE: usize = MR * NR;
/// Steps of the reduction per chunk (a 16-column panel of B: 16 KB).
const KC: usize = 256;
/// Rows of A per band (a packed band: 72 KB per chunk).
const MC: usize = 72;

/// Shape of C = A·B and the block length of the reduction (k for a sequential sum).
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmShape {
    /// Rows of A and C.
    pub m: usize,
    /// Length of the reduction.
    pub k: usize,
    /// Columns of B and C.
    pub n: usize,
    /// Block length: each block is summed sequentially from its first product, then added to
    /// the running total (the first block is copied).
    pub block: usize,
}

/// The operations of one reduction chunk on one tile: `ap` holds the chunk of 6 rows of A
/// (step-major, 6 values per step), `bp` the chunk of 16 columns of B (16 values per step),
/// `total` the tile's running total over completed blocks and `part` its open block's partial
/// sum (empty when no block ever spans a chunk boundary).
struct Micro<'a> {
    ap: &'a [f32],
    bp: &'a [f32],
    k0: usize,
    kc: usize,
    k: usize,
    block: usize,
}

/// One band's work for a chunk: its index, its tiles' totals and open partial sums, its rows
/// of C.
type BandWork<'a> = (usize, ((&'a mut [f32], &'a mut [f32]), &'a mut [f64]));

/// A microkernel: updates a tile's `total` and `part` for one chunk.
type MicroFn = fn(&Micro, &mut [f32], &mut [f32]);

/// C (row-major f64, m×n) = A (row-major f32, m×k) · B (row-major f32, k×n), each element in the
/// order described by `s.block`, with fused multiply-adds when `fma` (valid only when the
/// products are exact, so that s + a·b rounds once either way). Uses the rayon pool when
/// `parallel` and the product is large; the result does not depend on the number of threads.
pub(crate) fn gemm_f32(a: &[f64], b: &[f64], c: &mut [f64], s: GemmShape, fma: bool) {
    gemm_with(a, b, c, s, pick_micro(fma));
}

/// [`gemm_f32`] with a given microkernel.
fn gemm_with(a: &[f64], b: &[f64], c: &mut [f64], s: GemmShape, micro: MicroFn) {
    let GemmShape { m, k, n, block } = s;
    debug_assert!(a.len() == m * k && b.len() == k * n && c.len() == m * n && block >= 1);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    let (tm, tn) = (m.div_ceil(MR), n.div_ceil(NR));
    let band_tiles = MC / MR;
    // Scratch buffers are reused from call to call (see `take`): every element is written
    // before it is read, so their previous contents do not matter.
    // (Pooled buffers may be longer than asked: only the first `tiles_len` elements are used.)
    let tiles_len = tm * tn * TILE;
    let mut total = take(tiles_len);
    // A block is open across a chunk boundary when some boundary is not a block boundary.
    let open_blocks = (KC..k).step_by(KC).any(|x| x % block != 0);
    let mut part = take(if open_blocks { tiles_len } else { 0 });
    let mut bpack = take(tn * KC * NR);
    let parallel = m * n * k >= 1 << 22 && m > MC && crate::parallel::threads() > 1;
    for k0 in (0..k).step_by(KC) {
        let kc = KC.min(k - k0);
        pack_b(b, n, k0, kc, &mut bpack);
        let last = k0 + kc == k;
        let bpack = &bpack[..tn * kc * NR];
        let band_len = band_tiles * tn * TILE;
        let mut parts: Vec<&mut [f32]> = if open_blocks {
            part[..tiles_len].chunks_mut(band_len).collect()
        } else {
            Vec::new()
        };
        parts.resize_with(tiles_len.div_ceil(band_len), || &mut []);
        let work: Vec<_> = total[..tiles_len]
            .chunks_mut(band_len)
            .zip(parts)
            .zip(c.chunks_mut(MC * n))
            .enumerate()
            .collect();
        let run = |(band, ((tot, par), cb)): BandWork| {
            let i0 = band * MC;
            let rows = cb.len() / n;
            let tiles = rows.div_ceil(MR);
            let mut apack = take(tiles * kc * MR);
            pack_a(a, k, i0, rows, k0, kc, &mut apack[..tiles * kc * MR]);
            for tj in 0..tn {
                let bp = &bpack[tj * kc * NR..(tj + 1) * kc * NR];
                for ti in 0..tiles {
                    let t = (ti * tn + tj) * TILE;
                    let p = if par.is_empty() {
                        &mut []
                    } else {
                        &mut par[t..t + TILE]
                    };
                    let args = Micro {
                        ap: &apack[ti * kc * MR..(ti + 1) * kc * MR],
                        bp,
                        k0,
                        kc,
                        k,
                        block,
                    };
                    micro(&args, &mut tot[t..t + TILE], p);
                }
            }
            if last {
                unpack_c(tot, cb, n, tn);
            }
            give_back(apack);
        };
        if parallel {
            crate::parallel::for_each_owned(work, run);
        } else {
            work.into_iter().for_each(run);
        }
    }
    give_back(total);
    give_back(part);
    give_back(bpack);
}

/// Buffers kept per thread for reuse (at most 4, of at most `RETAIN` elements each): fresh
/// large allocations cost page faults on every call (glibc returns freed memory of worker
/// threads' arenas to the system), which took longer than the products at 512³.
const RETAIN: usize = 4 << 20;

thread_local! {
    static POOL: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A buffer of at least `len` elements (contents unspecified) from this thread's pool.
fn take(len: usize) -> Vec<f32> {
    let mut v = POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default();
    if v.len() < len {
        v.resize(len, 0.0);
    }
    v
}

/// Return a buffer to this thread's pool (dropped when the pool is full or it is too large).
fn give_back(v: Vec<f32>) {
    if v.capacity() <= RETAIN {
        POOL.with(|p| {
            let mut p = p.borrow_mut();
            if p.len() < 4 {
                p.push(v);
            }
        });
    }
}

/// Panels of 16 columns of B's rows k0..k0+kc: panel p holds, step by step, B[k][16p..16p+16]
/// (zeros past column n).
fn pack_b(b: &[f64], n: usize, k0: usize, kc: usize, out: &mut [f32]) {
    let tn = n.div_ceil(NR);
    for p in 0..tn {
        let (j0, w) = (p * NR, NR.min(n - p * NR));
        let panel = &mut out[p * kc * NR..(p + 1) * kc * NR];
        for (kk, dst) in panel.chunks_exact_mut(NR).enumerate() {
            let row = (k0 + kk) * n + j0;
            for (d, &x) in dst[..w].iter_mut().zip(&b[row..row + w]) {
                *d = x as f32;
            }
            dst[w..].fill(0.0);
        }
    }
}

/// Panels of 6 rows of A's rows i0..i0+rows, columns k0..k0+kc: panel t holds, step by step,
/// A[6t..6t+6][k] (zeros past the band's last row).
fn pack_a(a: &[f64], k: usize, i0: usize, rows: usize, k0: usize, kc: usize, out: &mut [f32]) {
    for (t, panel) in out.chunks_exact_mut(kc * MR).enumerate() {
        for r in 0..MR {
            let i = t * MR + r;
            if i < rows {
                let src = &a[(i0 + i) * k + k0..(i0 + i) * k + k0 + kc];
                for (kk, &x) in src.iter().enumerate() {
                    panel[kk * MR + r] = x as f32;
                }
            } else {
                for kk in 0..kc {
                    panel[kk * MR + r] = 0.0;
                }
            }
        }
    }
}

/// A band's tiles (tile-major) into its rows of C, widened to f64.
fn unpack_c(tot: &[f32], cb: &mut [f64], n: usize, tn: usize) {
    for (i, row) in cb.chunks_exact_mut(n).enumerate() {
        let (ti, r) = (i / MR, i % MR);
        for (j, o) in row.iter_mut().enumerate() {
            let t = (ti * tn + j / NR) * TILE;
            *o = f64::from(tot[t + r * NR + j % NR]);
        }
    }
}

/// The microkernel with the widest instructions the CPU has.
fn pick_micro(fma: bool) -> MicroFn {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::arch::has(crate::arch::Isa::Avx2) {
            if fma && crate::arch::has(crate::arch::Isa::Avx2Fma) {
                return micro_avx2_fma_entry;
            }
            return micro_avx2_entry;
        }
    }
    if fma {
        micro_portable::<true>
    } else {
        micro_portable::<false>
    }
}

/// One run of steps of a chunk inside one block of the reduction.
#[derive(Clone, Copy)]
struct Segment {
    /// The run begins its block: step `from` is the block's first product.
    begin: bool,
    /// Steps from..to of the chunk (relative to its first step).
    from: usize,
    to: usize,
    /// The run ends its block: `Some(first)`, where `first` says it is the reduction's first
    /// block (copied into the total rather than added).
    close: Option<bool>,
}

/// The block structure of one chunk, shared by every microkernel: the runs of steps it cuts
/// into at block boundaries.
fn segments(g: &Micro) -> impl Iterator<Item = Segment> {
    let (k0, end, k, block) = (g.k0, g.k0 + g.kc, g.k, g.block);
    let mut kk = k0;
    std::iter::from_fn(move || {
        if kk >= end {
            return None;
        }
        let bstart = kk - kk % block;
        let bend = (bstart + block).min(k);
        let stop = bend.min(end);
        let seg = Segment {
            begin: kk == bstart,
            from: kk - k0,
            to: stop - k0,
            close: (stop == bend).then_some(bstart == 0),
        };
        kk = stop;
        Some(seg)
    })
}

/// The portable microkernel (also the reference for the AVX2 one: same operations per lane).
#[allow(clippy::needless_range_loop)]
fn micro_portable<const FMA: bool>(g: &Micro, total: &mut [f32], part: &mut [f32]) {
    let mut acc = [0.0f32; TILE];
    if g.k0 % g.block != 0 {
        acc.copy_from_slice(part);
    }
    let (ap, bp) = (g.ap, g.bp);
    let mut open = false;
    for seg in segments(g) {
        let mut from = seg.from;
        if seg.begin {
            for r in 0..MR {
                for j in 0..NR {
                    acc[r * NR + j] = ap[from * MR + r] * bp[from * NR + j];
                }
            }
            from += 1;
        }
        for x in from..seg.to {
            for r in 0..MR {
                let av = ap[x * MR + r];
                for j in 0..NR {
                    let s = &mut acc[r * NR + j];
                    *s = if FMA {
                        av.mul_add(bp[x * NR + j], *s)
                    } else {
                        *s + av * bp[x * NR + j]
                    };
                }
            }
        }
        open = seg.close.is_none();
        if let Some(first) = seg.close {
            for (t, &p) in total.iter_mut().zip(&acc) {
                *t = if first { p } else { *t + p };
            }
        }
    }
    if open {
        part.copy_from_slice(&acc);
    }
}

#[cfg(target_arch = "x86_64")]
fn micro_avx2_fma_entry(g: &Micro, total: &mut [f32], part: &mut [f32]) {
    // SAFETY: chosen by `pick_micro` only when the CPU has AVX2 and FMA.
    unsafe { micro_avx2_fma(g, total, part) }
}

#[cfg(target_arch = "x86_64")]
fn micro_avx2_entry(g: &Micro, total: &mut [f32], part: &mut [f32]) {
    // SAFETY: chosen by `pick_micro` only when the CPU has AVX2.
    unsafe { micro_avx2(g, total, part) }
}

/// s + a·b on 8 lanes: fused (`fma`) or a rounded product then a rounded sum (`separate`).
macro_rules! multiply_add {
    (fma, $a:expr, $b:expr, $s:expr) => {
        _mm256_fmadd_ps($a, $b, $s)
    };
    (separate, $a:expr, $b:expr, $s:expr) => {
        _mm256_add_ps($s, _mm256_mul_ps($a, $b))
    };
}

/// The 6×16 tile in twelve registers of 8 lanes; per lane the operations of
/// [`micro_portable`]: `_mm256_fmadd_ps` is `f32::mul_add`, mul then add is `*s + a * b`.
/// (A macro rather than a generic function, so that every intrinsic is compiled inside the
/// function that enables the target features.)
macro_rules! micro_avx2_body {
    ($name:ident, $features:literal, $fma:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::needless_range_loop)]
        fn $name(g: &Micro, total: &mut [f32], part: &mut [f32]) {
            use std::arch::x86_64::*;
            assert!(g.ap.len() >= g.kc * MR && g.bp.len() >= g.kc * NR && total.len() == TILE);
            assert!(part.len() == TILE || (part.is_empty() && g.k0 % g.block == 0));
            let (ap, bp) = (g.ap.as_ptr(), g.bp.as_ptr());
            let mut v = [_mm256_setzero_ps(); 12];
            if g.k0 % g.block != 0 {
                for (q, x) in v.iter_mut().enumerate() {
                    // SAFETY: `part` has 96 elements (asserted above).
                    *x = unsafe { _mm256_loadu_ps(part.as_ptr().add(q * 8)) };
                }
            }
            let mut open = false;
            for seg in segments(g) {
                let mut from = seg.from;
                // SAFETY (the loads below): steps are < kc, and `ap`, `bp` hold kc·6 and
                // kc·16 values (asserted above).
                if seg.begin {
                    let (b0, b1) = unsafe {
                        (
                            _mm256_loadu_ps(bp.add(from * NR)),
                            _mm256_loadu_ps(bp.add(from * NR + 8)),
                        )
                    };
                    for r in 0..MR {
                        let a = unsafe { _mm256_broadcast_ss(&*ap.add(from * MR + r)) };
                        v[2 * r] = _mm256_mul_ps(a, b0);
                        v[2 * r + 1] = _mm256_mul_ps(a, b1);
                    }
                    from += 1;
                }
                for x in from..seg.to {
                    let (b0, b1) = unsafe {
                        (
                            _mm256_loadu_ps(bp.add(x * NR)),
                            _mm256_loadu_ps(bp.add(x * NR + 8)),
                        )
                    };
                    for r in 0..MR {
                        let a = unsafe { _mm256_broadcast_ss(&*ap.add(x * MR + r)) };
                        v[2 * r] = multiply_add!($fma, a, b0, v[2 * r]);
                        v[2 * r + 1] = multiply_add!($fma, a, b1, v[2 * r + 1]);
                    }
                }
                open = seg.close.is_none();
                if let Some(first) = seg.close {
                    let t = total.as_mut_ptr();
                    for (q, &x) in v.iter().enumerate() {
                        // SAFETY: `total` has 96 elements (asserted above).
                        unsafe {
                            let s = if first {
                                x
                            } else {
                                _mm256_add_ps(_mm256_loadu_ps(t.add(q * 8)), x)
                            };
                            _mm256_storeu_ps(t.add(q * 8), s);
                        }
                    }
                }
            }
            if open {
                for (q, x) in v.iter().enumerate() {
                    // SAFETY: an open block implies a later chunk, so `part` has 96 elements
                    // (it is empty only when no block spans a chunk boundary).
                    unsafe { _mm256_storeu_ps(part.as_mut_ptr().add(q * 8), *x) };
                }
            }
        }
    };
}

micro_avx2_body!(micro_avx2_fma, "avx2,fma", fma);
micro_avx2_body!(micro_avx2, "avx2", separate);

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut g = crate::random::SplitMix64::for_name("gemm", seed);
        (0..len)
            .map(|_| {
                let x = (2.0 * g.uniform() - 1.0) as f32;
                // 8 significant bits, like BF16: products are exact in f32.
                f32::from_bits(x.to_bits() & 0xffff_0000)
            })
            .collect()
    }

    /// The reference: per element, the block structure in plain f32 arithmetic.
    fn reference(a: &[f32], b: &[f32], s: GemmShape, fma: bool) -> Vec<f64> {
        let GemmShape { m, k, n, block } = s;
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut total = 0.0f32;
                for (bi, b0) in (0..k).step_by(block).enumerate() {
                    let mut p = a[i * k + b0] * b[b0 * n + j];
                    for x in b0 + 1..(b0 + block).min(k) {
                        p = if fma {
                            a[i * k + x].mul_add(b[x * n + j], p)
                        } else {
                            p + a[i * k + x] * b[x * n + j]
                        };
                    }
                    total = if bi == 0 { p } else { total + p };
                }
                c[i * n + j] = f64::from(total);
            }
        }
        c
    }

    /// Both microkernels (portable and, on this CPU, AVX2) against the per-element reference,
    /// across chunk boundaries that cut blocks and across partial tiles.
    #[test]
    fn microkernels_follow_the_block_order() {
        let shapes = [
            (7, 600, 19, 600),
            (13, 600, 33, 100),
            (5, 513, 17, 300),
            (1, 300, 1, 7),
            (80, 260, 40, 256),
        ];
        for (m, k, n, block) in shapes {
            let a = values(m * k, 1);
            let b = values(k * n, 2);
            let s = GemmShape { m, k, n, block };
            for fma in [false, true] {
                let want = reference(&a, &b, s, fma);
                let mut got = vec![f64::NAN; m * n];
                let (a64, b64): (Vec<f64>, Vec<f64>) = (
                    a.iter().map(|&x| f64::from(x)).collect(),
                    b.iter().map(|&x| f64::from(x)).collect(),
                );
                gemm_f32(&a64, &b64, &mut got, s, fma);
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{m}x{k}x{n} block {block} fma {fma}"
                );
                let port: MicroFn = if fma {
                    micro_portable::<true>
                } else {
                    micro_portable::<false>
                };
                let mut got = vec![f64::NAN; m * n];
                gemm_with(&a64, &b64, &mut got, s, port);
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "portable {m}x{k}x{n} block {block} fma {fma}"
                );
            }
        }
    }
}
