//! What the first pass keeps per row and per column: the rows' systematic sums under the key
//! of their reference values, the cluster sums of one linear statistic, the sparse test's row
//! records and the column pools.

/// One row's systematic sums and the key of its reference values.
///
/// Rows equal in the reference (a token repeated in a batch, before attention mixes positions;
/// a constant tensor) were computed from equal inputs, so their round-off is equal too: one
/// cluster, not independent ones. Counted apart, k equal rows make the variance k times too
/// small for their part; the row clusters are therefore the classes of equal reference rows
/// (by a 64-bit key: a collision merges two classes, which only makes the test more cautious).
#[derive(Debug, Clone, Copy)]
pub(super) struct RowSumsKeyed {
    pub(super) key: u64,
    /// Σ wD for the scale (w = m) and the bias (w = 1), Σ m², the finite pairs, Σ D², and
    /// Σ m, Σ (Dm)², Σ m⁴, Σ m²D, Σ m³, Σ m³D.
    pub(super) x: f64,
    pub(super) y: f64,
    pub(super) mm: f64,
    pub(super) n: f64,
    pub(super) dd: f64,
    pub(super) ms: f64,
    pub(super) dada: f64,
    pub(super) a4: f64,
    pub(super) m2d: f64,
    pub(super) m3: f64,
    pub(super) m3d: f64,
}

impl RowSumsKeyed {
    /// The row's own structure: D fitted by least squares as a·m + b — a relative factor and
    /// an offset shared by the row, as a normalizer's or a denominator's rounding moves a
    /// whole row. `None` for a row too short or degenerate to fit.
    pub(super) fn fit(&self) -> Option<(f64, f64)> {
        let n = self.n;
        let det = n * self.mm - self.ms * self.ms;
        (n >= 3.0 && det > 1e-9 * n * self.mm).then(|| {
            let a = (n * self.x - self.ms * self.y) / det;
            let b = (self.mm * self.y - self.ms * self.x) / det;
            (a, b)
        })
    }

    /// The variance the elements' own noise gives the row's sums Σ mD and Σ D: the sandwich
    /// (heteroscedasticity-consistent) estimates Σ m²e² and Σ e² of the residuals
    /// e = D − a·m − b, times n/(n − 2). Zero for a row the fit explains — whose sum is one
    /// event, not many.
    pub(super) fn noise(&self) -> (f64, f64) {
        let Some((a, b)) = self.fit() else {
            return (0.0, 0.0);
        };
        let k = self.n / (self.n - 2.0);
        // Σ m²(D − am − b)² and Σ (D − am − b)², expanded in the row's sums.
        let scale = self.dada - 2.0 * a * self.m3d - 2.0 * b * self.m2d
            + a * a * self.a4
            + 2.0 * a * b * self.m3
            + b * b * self.mm;
        let bias = self.dd - 2.0 * a * self.x - 2.0 * b * self.y
            + a * a * self.mm
            + 2.0 * a * b * self.ms
            + b * b * self.n;
        (scale.max(0.0) * k, bias.max(0.0) * k)
    }
}

/// The deterministic part the row clusters may give L = Σ s_c: κ·σ_f·ΣM_c, where s_c = f_c·M_c
/// (M_c the cluster's weight Σw·m — Σm² for the scale, its pairs for the bias — and f_c its
/// own factor) and σ_f the spread of the factors beyond what the elements' own noise v_c
/// makes: σ_f² = (Σ(f_c − f̄)² − Σv_c/M_c² − 3·√(2Σ(v_c/M_c²)²))⁺/(n − 1). A pure scale has
/// equal factors (σ_f = 0); a normalizer's rounding, one factor per row, spreads them.
pub(super) fn factor_slack(s: &[f64], weight: &[f64], noise: &[f64]) -> f64 {
    let (mut f, mut vf) = (Vec::with_capacity(s.len()), Vec::with_capacity(s.len()));
    for ((&sc, &m), &v) in s.iter().zip(weight).zip(noise) {
        if m > 0.0 {
            f.push(sc / m);
            vf.push(v / (m * m));
        }
    }
    let n = f.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let mean = f.iter().sum::<f64>() / n;
    let ss = f.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>();
    let v = vf.iter().sum::<f64>();
    let sd = (2.0 * vf.iter().map(|x| x * x).sum::<f64>()).sqrt();
    let var = (ss - v - 3.0 * sd).max(0.0) / (n - 1.0);
    SYSTEMATIC_SLACK * var.sqrt() * weight.iter().sum::<f64>()
}

/// The key of a row's reference values (their bits, in four interleaved streams).
pub(super) fn row_key(r: &[f64]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = [1u64, 2, 3, 4];
    let chunks = r.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..4 {
            h[l] = (h[l] ^ c[l].to_bits()).wrapping_mul(K).rotate_left(29);
        }
    }
    for (l, x) in tail.iter().enumerate() {
        h[l] = (h[l] ^ x.to_bits()).wrapping_mul(K).rotate_left(29);
    }
    h.iter().fold(r.len() as u64, |a, &b| {
        (a ^ b).wrapping_mul(K).rotate_left(31)
    })
}

/// κ: the deterministic part round-off may give the systematic tests' statistic, as a mean
/// row factor of up to κ times the factors' spread ([`factor_slack`]; module docs,
/// "Deterministic round-off").
pub const SYSTEMATIC_SLACK: f64 = 2.0;

/// Sums of one linear statistic L = Σ wᵢDᵢ by clusters.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Clustered {
    /// L.
    pub(super) sum: f64,
    /// Σ over rows of the row's sum, squared.
    pub(super) rows: f64,
    /// The deterministic part its row clusters may hold ([`factor_slack`]).
    pub(super) slack: f64,
    /// Σ over elements of (wᵢDᵢ)².
    pub(super) elements: f64,
}

impl Clustered {
    /// The two-way cluster-robust variance given Σ over columns of the column's sum squared:
    /// V̂ = rows + columns − elements, floored at the larger of the first two.
    pub(super) fn variance(&self, cols: f64) -> f64 {
        (self.rows + cols - self.elements).max(self.rows.max(cols))
    }
}

/// A reader of a pair's values `start..end` again, in pieces: `again(start, end, f)`.
pub(crate) type ReadAgain<'a> = dyn FnMut(usize, usize, &mut dyn FnMut(&[f64], &[f64])) + 'a;

/// Per-row record of the first pass, for the sparse test's second.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RowRecord {
    /// Σ (Dⱼ/sⱼ)² over the row (raw Σ Dⱼ² for a row whose reference is all zero).
    pub(super) q: f64,
    /// Largest single term of `q`.
    pub(super) qmax: f64,
    /// Largest eⱼ with the finest allowance (an upper bound of the exact one).
    pub(super) emax: f64,
    /// Finite pairs.
    pub(super) n: usize,
    /// The reference is zero on the whole row (sⱼ is then the tensor's root mean square).
    pub(super) zero: bool,
}

/// The per-column sums a row of a matrix adds to (see [`Detect`](super::Detect)).
pub(super) struct Columns<'a> {
    pub(super) dr: &'a mut [f64],
    pub(super) d: &'a mut [f64],
    pub(super) r2: &'a mut [f64],
    pub(super) m2: &'a mut [f64],
    pub(super) n: &'a mut [usize],
    pub(super) q: &'a mut [f64],
}

impl Columns<'_> {
    /// Adds element `j` (reference `a`, terms `e`) to its column; its squared term only where
    /// `with_q` (a row whose reference is not zero).
    pub(super) fn add(&mut self, j: usize, a: f64, e: &Element, with_q: bool) {
        self.dr[j] += e.da;
        self.d[j] += e.d;
        self.r2[j] += a * a;
        self.m2[j] += e.mm;
        self.n[j] += 1;
        if with_q {
            self.q[j] += e.q;
        }
    }
}

/// One row's sums of the first pass (see [`Detect::row_pass_plain`](super::Detect::row_pass_plain)).
pub(super) struct RowSums {
    pub(super) rr: f64,
    pub(super) mm: f64,
    pub(super) zero: bool,
    pub(super) x: f64,
    pub(super) y: f64,
    pub(super) dada: f64,
    pub(super) dd: f64,
    pub(super) a4: f64,
    pub(super) q: f64,
    pub(super) qmax: f64,
    pub(super) emax: f64,
    /// Σ (D/|r|)² and their count over the elements at least their row's root mean square
    /// (those measured against their own magnitude).
    pub(super) lq: f64,
    pub(super) ln: f64,
    /// Σ m, Σ m²D, Σ m³, Σ m³D (the rows' residual noise, [`RowSumsKeyed`]).
    pub(super) ms: f64,
    pub(super) m2d: f64,
    pub(super) m3: f64,
    pub(super) m3d: f64,
}

/// One element's terms that its column adds.
pub(super) struct Element {
    pub(super) d: f64,
    /// D·m, m = (r + c)/2.
    pub(super) da: f64,
    /// m².
    pub(super) mm: f64,
    pub(super) q: f64,
}
