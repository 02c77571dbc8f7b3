//! The sweep: every cell (op × family × policy pair × size), its statistics and its row of
//! the report.

use super::*;

/// Statistics of one cell.
#[derive(Debug, Clone, Default)]
pub struct Cell {
    pub trials: usize,
    pub guaranteed_violations: usize,
    pub probabilistic_violations: usize,
    pub oracle_violations: usize,
    pub refused: usize,
    /// Refusals although both results were finite.
    pub refused_finite: usize,
    pub unflagged_non_finite: usize,
    pub exact: usize,
    /// Probabilistic requests answered with the guaranteed threshold because the engine's
    /// executions contradicted the model (not violations: the model admitting it does not fit).
    pub model_fallbacks: usize,
    pub ratios: Vec<f64>,
}

impl Cell {
    pub fn add(&mut self, o: Outcome) {
        self.trials += 1;
        match o {
            Outcome::Priced {
                observed,
                guaranteed,
                probabilistic,
                oracle_ok,
                per_element: (max_diff, per_g, per_p),
                model_fallback,
            } => {
                if model_fallback {
                    self.model_fallbacks += 1;
                }
                // The tensor bound and the per-element one (max |cand − ref|).
                if observed > guaranteed || max_diff > per_g {
                    self.guaranteed_violations += 1;
                }
                if observed > probabilistic || max_diff > per_p {
                    self.probabilistic_violations += 1;
                }
                if !oracle_ok {
                    self.oracle_violations += 1;
                }
                if observed == 0.0 {
                    self.exact += 1;
                } else {
                    self.ratios.push(probabilistic / observed);
                }
            }
            Outcome::Refused { results_finite } => {
                self.refused += 1;
                if results_finite {
                    self.refused_finite += 1;
                }
            }
            Outcome::UnflaggedNonFinite => self.unflagged_non_finite += 1,
        }
    }

    pub fn closest(&self) -> f64 {
        self.ratios.iter().copied().fold(f64::INFINITY, f64::min)
    }

    pub fn median(&self) -> f64 {
        let mut r = self.ratios.clone();
        if r.is_empty() {
            return f64::NAN;
        }
        r.sort_by(|a, b| a.total_cmp(b));
        r[r.len() / 2]
    }

    /// Violations, and model fallbacks: with the executions checking the model, a defect of
    /// the model shows as a fallback to the guaranteed threshold, not as a violation.
    pub fn failures(&self) -> usize {
        self.guaranteed_violations
            + self.probabilistic_violations
            + self.oracle_violations
            + self.unflagged_non_finite
            + self.model_fallbacks
    }
}

/// One row of a sweep.
#[derive(Debug, Clone)]
pub struct Row {
    pub op: Op,
    pub family: Family,
    pub pair: String,
    pub k: usize,
    pub rows: usize,
    pub cell: Cell,
}

/// The ops of the sweep.
pub fn ops() -> Vec<Op> {
    vec![
        Op::Sum,
        Op::Mean,
        Op::SumFast,
        Op::MeanFast,
        Op::AllReduce,
        Op::Elementwise(Elementwise::Add),
        Op::Elementwise(Elementwise::Scale { c: 0.1 }),
        Op::Elementwise(Elementwise::Gelu),
        Op::Elementwise(Elementwise::Silu),
        Op::Matmul,
        Op::MatmulFast,
        Op::Softmax(AttentionImpl::Standard),
        Op::LayerNorm(Variance::TwoPass),
        Op::RmsNorm,
        Op::LayerNormFast(Variance::TwoPass),
        Op::RmsNormFast,
        Op::CrossEntropy,
        Op::CrossEntropyGrad,
        Op::Attention(AttentionImpl::Standard),
    ]
}

/// Run trials of every (op, family, pair) at each (k, rows, trials); `keep` filters cells.
/// Cells run in parallel (rayon); the rows come back in a fixed order.
pub fn sweep(
    ops: &[Op],
    shapes: &[(usize, usize, usize)],
    keep: &(dyn Fn(Op, Family, &str) -> bool + Sync),
) -> ttrace::Result<Vec<Row>> {
    use rayon::prelude::*;
    let mut jobs = vec![];
    for &op in ops {
        for pair in pairs(op) {
            for family in FAMILIES {
                if !keep(op, family, &pair.name) {
                    continue;
                }
                for &(k, rows, trials) in shapes {
                    jobs.push((op, family, pair.clone(), k, rows, trials));
                }
            }
        }
    }
    jobs.into_par_iter()
        .map(|(op, family, pair, k, rows, trials)| {
            let mut cell = Cell::default();
            for t in 0..trials {
                cell.add(trial(op, family, &pair, k, rows, t as u64)?);
            }
            Ok(Row {
                op,
                family,
                pair: pair.name.clone(),
                k,
                rows,
                cell,
            })
        })
        .collect()
}
