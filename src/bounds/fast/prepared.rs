//! What the fast path prepares from the two sides' arithmetic and k alone, before it looks at
//! any data: the two programs and the guaranteed bound's weights. It is a pure function of
//! (reference accumulation, candidate accumulation, k), and a trace prices the same layer
//! shapes again and again, so the last few are kept (building them walks every rounding site
//! of both orders: a fifth of a fast-priced sum of 64 rows of 1,024).

use std::sync::{Arc, Mutex};

use super::program::{programs, Program};
use crate::bounds::reduction::dot_guaranteed_weights;
use crate::error::Result;
use crate::order::Accumulation;

/// The programs and weights of one pair of sides over k terms.
pub(super) struct Prepared {
    /// The reference's and the candidate's programs.
    pub programs: (Program, Program),
    /// Per term, the sum of the two sides' guaranteed weights.
    pub weights: Vec<f64>,
    /// The two sides' constant (underflow) terms.
    pub constants: (f64, f64),
}

/// Entries kept, most recent last.
const KEEP: usize = 8;
/// Longer reductions are not kept (their weights alone are 8 bytes a term).
const KEEP_TERMS: usize = 1 << 16;

type Key = (Accumulation, Accumulation, usize);

static CACHE: Mutex<Vec<(Key, Arc<Prepared>)>> = Mutex::new(Vec::new());

/// The programs and weights of `r` and `c` over `k` terms; `Ok(None)` when the lane kernel
/// does not execute one of the orders.
pub(super) fn prepared(
    r: &Accumulation,
    c: &Accumulation,
    k: usize,
) -> Result<Option<Arc<Prepared>>> {
    let find = |cache: &Vec<(Key, Arc<Prepared>)>| {
        cache
            .iter()
            .position(|((a, b, n), _)| *n == k && a == r && b == c)
    };
    if k <= KEEP_TERMS {
        // A poisoned lock only means another thread panicked while holding it; the entries
        // are whole values, pushed and removed under the lock.
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = find(&cache) {
            let entry = cache.remove(i);
            let found = Arc::clone(&entry.1);
            cache.push(entry);
            return Ok(Some(found));
        }
    }
    let Some(programs) = programs(&r.order, &c.order, k) else {
        return Ok(None);
    };
    let (wr, cr) = dot_guaranteed_weights(r, k)?;
    let (wc, cc) = dot_guaranteed_weights(c, k)?;
    let built = Arc::new(Prepared {
        programs,
        weights: wr.iter().zip(&wc).map(|(x, y)| x + y).collect(),
        constants: (cr, cc),
    });
    if k <= KEEP_TERMS {
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if find(&cache).is_none() {
            if cache.len() == KEEP {
                cache.remove(0);
            }
            cache.push(((r.clone(), c.clone(), k), Arc::clone(&built)));
        }
    }
    Ok(Some(built))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Format;
    use crate::order::{Combine, Order};

    /// Kept entries are the entries built for the same key: more keys than are kept, each
    /// asked for twice in an interleaved order, against a fresh build each time.
    #[test]
    fn kept_entries_are_those_of_their_own_key() {
        let acc = |order| Accumulation::new(Format::BF16, Format::F32, order);
        let orders = [
            Order::Sequential,
            Order::Pairwise { base: 8 },
            Order::split_k(4, Format::F32, Combine::Tree),
            Order::split_k(8, Format::F32, Combine::Sequential),
        ];
        let mut keys = vec![];
        for r in &orders {
            for c in &orders {
                for k in [7, 64, 1000] {
                    keys.push((acc(r.clone()), acc(c.clone()), k));
                }
            }
        }
        assert!(keys.len() > KEEP);
        for round in 0..2 {
            for i in 0..keys.len() {
                // Revisit a recent key now and then, so both kept and evicted entries are read.
                let revisit = round == 1 && i % 3 == 0 && i > 0;
                let (r, c, k) = &keys[if revisit { i - 1 } else { i }];
                let got = prepared(r, c, *k).unwrap().unwrap();
                let want = programs(&r.order, &c.order, *k).unwrap();
                let (wr, cr) = dot_guaranteed_weights(r, *k).unwrap();
                let (wc, cc) = dot_guaranteed_weights(c, *k).unwrap();
                assert_eq!(got.programs, want, "{r:?} {c:?} {k}");
                let w: Vec<f64> = wr.iter().zip(&wc).map(|(x, y)| x + y).collect();
                assert_eq!(got.weights, w);
                assert_eq!(got.constants, (cr, cc));
            }
        }
        assert!(CACHE.lock().unwrap().len() <= KEEP);
    }
}
