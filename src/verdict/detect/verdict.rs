//! The findings of a pair's tests once the first pass is done: the systematic tests' verdicts
//! and the sparse test, which reads back only the rows its first pass could not settle.

use super::*;

impl Detect {
    /// The findings: `again(start, end, f)` hands `f` the pairs `start..end` again — the
    /// sparse test reads back only the rows whose bound its first pass could not settle.
    /// `eps` is the unit of the estimates.
    pub(crate) fn finish(mut self, eps: f64, again: &mut ReadAgain<'_>) -> Vec<Finding> {
        if !self.cfg.enabled {
            return Vec::new();
        }
        self.flush();
        let mut out = Vec::new();
        if self.n == 0 || self.rr <= 0.0 {
            return out;
        }
        let n = self.n as f64;
        let sq = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>();
        // Every row's keyed sums are needed to merge equal rows: a tensor of more rows than
        // the records hold has no systematic test.
        if self.systematic()
            && self.keyed.len() == self.row_count
            && !self.structured()
            && !self.nearly_repeated()
        {
            self.cluster_rows();
            let t = symmetric_critical(self.cfg.each());
            // Scale (weights m = (r + c)/2): the pure signal D = m has L = Σm², rows
            // Σ(Σ_row m²)², columns Σ(Σ_col m²)², elements Σm⁴; bias: D = 1 has rows
            // Σ(row length)², columns Σ(column length)², elements n.
            let pure = Clustered {
                sum: self.mm,
                rows: self.pure_rows,
                slack: 0.0,
                elements: self.pure_elements,
            };
            let ones = Clustered {
                sum: n,
                rows: self.ones_rows,
                slack: 0.0,
                elements: n,
            };
            let col_n: Vec<f64> = self.col_n.iter().map(|&k| k as f64).collect();
            let unit = n * (self.rr / n).sqrt();
            for (det, stat, cols, signal, signal_cols, per) in [
                (
                    Detector::Scale,
                    self.scale,
                    sq(&self.col_dr),
                    pure,
                    sq(&self.col_m2),
                    self.mm,
                ),
                (
                    Detector::Bias,
                    self.bias,
                    sq(&self.col_d),
                    ones,
                    sq(&col_n),
                    unit,
                ),
            ] {
                // Sums of squares of squares leave the f64 range for extreme magnitudes (an F64
                // tensor beyond about 1e±75, or differences far below its values): then a sum
                // is infinite or has lost its smallest terms to underflow, and the test is not
                // applicable rather than judged on a broken variance.
                let sound = |c: &Clustered, cols: f64| {
                    let v = c.variance(cols);
                    [c.sum, c.rows, c.elements, cols, v]
                        .iter()
                        .all(|x| x.is_finite())
                        && v >= MIN_SOUND_VARIANCE
                };
                if !sound(&signal, signal_cols) || !sound(&stat, cols) || !per.is_finite() {
                    continue;
                }
                if signal.sum / signal.variance(signal_cols).sqrt() <= t {
                    continue;
                }
                let est = stat.sum / per / eps;
                let th = (t * stat.variance(cols).sqrt() + stat.slack) / per / eps;
                let ratio = if est == 0.0 {
                    0.0
                } else if th > 0.0 {
                    est.abs() / th
                } else {
                    f64::INFINITY
                };
                out.push(Finding {
                    detector: det,
                    estimate: est,
                    threshold: th,
                    ratio,
                    fired: ratio > 1.0,
                    at: None,
                    count: 0,
                });
            }
        }
        if let Some(f) = self.sparse(eps, again) {
            out.push(f);
        }
        out
    }

    pub(super) fn sparse(&self, eps: f64, again: &mut ReadAgain<'_>) -> Option<Finding> {
        if self.n < 3 || !self.cfg.sparse || self.row_count > self.rows.len() {
            return None;
        }
        let n = self.n as f64;
        let rms_all = (self.rr / n).sqrt();
        if !rms_all.is_finite() {
            // Σr² beyond the f64 range (an F64 tensor of values beyond about 1e154): the
            // rows' scales are infinite, and the test would see nothing. Not applicable.
            return None;
        }
        // Rows whose reference is zero measure against the tensor's root mean square.
        let scaled = |u: &RowRecord| {
            if u.zero {
                let s2 = rms_all * rms_all;
                (u.q / s2, u.qmax / s2, u.emax / rms_all)
            } else {
                (u.q, u.qmax, u.emax)
            }
        };
        let total: f64 = self.rows.iter().map(|u| scaled(u).0).sum();
        let grid = self.grid();
        let floor = grid.unit_roundoff() / 3f64.sqrt();
        let crit = sparse_critical(n, self.cfg.each());
        let pool = |sum: f64, own: f64, m: usize| {
            if m > 1 {
                ((sum - own).max(0.0) / (m as f64 - 1.0)).sqrt()
            } else {
                0.0
            }
        };
        // The scale of element i (its own term qᵢ left out of every pool; columns only in the
        // second pass, where they can only raise it).
        let sigma = |row_q: f64, qi: f64, m: usize| {
            pool(total, qi, self.n).max(pool(row_q, qi, m)).max(floor)
        };
        // Upper bounds of each row's largest z: its largest e over the smallest leave-one-out
        // scale (every term left out is at most the row's largest).
        let mut order: Vec<(f64, usize)> = self
            .rows
            .iter()
            .enumerate()
            .filter_map(|(k, u)| {
                let (q, qmax, emax) = scaled(u);
                (emax > 0.0).then(|| (emax / sigma(q, qmax, u.n), k))
            })
            .collect();
        order.sort_by(|a, b| b.0.total_cmp(&a.0));
        // (z, e, σ̂, flat index)
        let mut worst: Option<(f64, f64, f64, usize)> = None;
        let mut count = 0;
        for (ub, k) in order {
            if ub <= crit && worst.is_some_and(|w| ub <= w.0) {
                break;
            }
            let u = self.rows[k];
            let (row_q, _, _) = scaled(&u);
            let start = k * self.row;
            let len = self.row.min(self.done - start);
            let (mut r, mut c) = (Vec::with_capacity(len), Vec::with_capacity(len));
            again(start, start + len, &mut |a, b| {
                r.extend_from_slice(a);
                c.extend_from_slice(b);
            });
            let finite = |a: f64, b: f64| a.is_finite() && b.is_finite();
            let (mut rr, mut m) = (0.0f64, 0usize);
            for (&a, &b) in r.iter().zip(&c) {
                if finite(a, b) {
                    rr += a * a;
                    m += 1;
                }
            }
            let rms = if u.zero {
                rms_all
            } else {
                (rr / m.max(1) as f64).sqrt()
            };
            // The row's shared relative factor: the median of its elements' relative
            // differences (a softmax's denominator moves every element of its row by one
            // factor; a few corrupted elements do not move the median).
            let factor = row_factor(&r, &c);
            let full = self.cols > 0 && r.len() == self.cols;
            for (j, (&a, &b)) in r.iter().zip(&c).enumerate() {
                if !finite(a, b) || a == b {
                    continue;
                }
                let d = b - a;
                let s = a.abs().max(rms);
                // The column's magnitude too, where the row says little (a masked attention
                // row with one finite score, whose terms are the size of its column's):
                // measured against the larger scale the element is quieter, and its pool
                // (below, from the first pass's smaller scale) is not: conservative both ways.
                let wide = if full && self.col_n[j] > 0 {
                    s.max((self.col_r2[j] / self.col_n[j] as f64).sqrt())
                } else {
                    s
                };
                let allowance = grid.ulp(a.abs().max(b.abs())).unwrap_or(0.0);
                // An element may carry its row's factor (a softmax row of heavy-tailed
                // logits: every element moves by the denominator's relative difference,
                // 25 ε where the rows' pool is 1 ε — such rows summed in another order fired
                // at 1.2× without it). Taken only where it makes the difference smaller: the
                // excess is never raised.
                let moved = if !u.zero {
                    d.abs().min((d - factor * a).abs())
                } else {
                    d.abs()
                };
                let e = (moved - allowance).max(0.0) / wide;
                if e == 0.0 {
                    continue;
                }
                let qi = (d / s) * (d / s);
                let mut sg = sigma(row_q, qi, u.n);
                if full && !u.zero {
                    sg = sg.max(pool(self.col_q[j], qi, self.col_n[j]));
                }
                // An element measured against its own magnitude is compared with the others
                // that are: where a row's error is one relative factor (a softmax's
                // denominator), its small elements say little of its large ones'.
                if !u.zero && a.abs() >= rms {
                    sg = sg.max(pool(self.large_q, qi, self.large_n as usize));
                }
                let z = e / sg;
                if z > crit {
                    count += 1;
                }
                if worst.is_none_or(|w| z > w.0) {
                    worst = Some((z, e, sg, start + j));
                }
            }
        }
        Some(match worst {
            Some((z, e, sg, at)) => Finding {
                detector: Detector::Sparse,
                estimate: e / eps,
                threshold: crit * sg / eps,
                ratio: z / crit,
                fired: z > crit,
                at: Some(at),
                count,
            },
            None => Finding {
                detector: Detector::Sparse,
                estimate: 0.0,
                threshold: crit * floor / eps,
                ratio: 0.0,
                fired: false,
                at: None,
                count: 0,
            },
        })
    }
}

/// The median of a row's relative differences (c − r)/r over its finite pairs with r ≠ 0 (0
/// when there are none).
fn row_factor(r: &[f64], c: &[f64]) -> f64 {
    let mut q: Vec<f64> = r
        .iter()
        .zip(c)
        .filter(|(a, b)| a.is_finite() && b.is_finite() && **a != 0.0)
        .map(|(a, b)| (b - a) / a)
        .filter(|x| x.is_finite())
        .collect();
    if q.is_empty() {
        return 0.0;
    }
    let mid = q.len() / 2;
    let (_, m, _) = q.select_nth_unstable_by(mid, f64::total_cmp);
    *m
}
