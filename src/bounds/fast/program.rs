//! The rounding sites of one reduction order as a program for the lane kernel: chains of
//! products added one at a time into a slot (sequential runs), and additions of two computed
//! values (block totals, pairwise trees, split-K combines). Built once per order from
//! [`for_each_rounding`], the description the walk and the engine share.

use std::collections::HashMap;
use std::ops::Range;

use crate::format::Format;
use crate::order::{for_each_rounding, Operand, Order, RoundingSite};

/// One step of a [`Program`], on slots of lane values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// `slot` = a·b of term `term` (exact: no rounding).
    Start { slot: usize, term: usize },
    /// `slot` = fl(slot + a·b) for the terms `terms`, one at a time.
    Chain { slot: usize, terms: Range<usize> },
    /// `into` = fl(into + from); `from` is free afterwards.
    Add { into: usize, from: usize },
}

/// The steps of one order over k terms, every rounding in `f32`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Program {
    /// The steps, in the order the execution performs them.
    pub steps: Vec<Step>,
    /// Slots the steps use (live values at once).
    pub slots: usize,
    /// The slot holding the result.
    pub result: usize,
    /// Every term is used exactly once (checked when built).
    pub terms: usize,
}

/// The program of `order` over `k` exact products accumulated in FP32 with every rounding in
/// FP32 and no rounding of the first product (exact in `f32`). `None` for what the lane
/// kernel does not execute: other formats, fused blocks, orders priced as a whole (tensor
/// cores, families, Kahan), k = 0.
pub(super) fn program(order: &Order, k: usize) -> Option<Program> {
    if k == 0 || order.has_family() || order.has_tensor_core() || *order == Order::Kahan {
        return None;
    }
    let mut sites = Vec::new();
    // Exact products of inputs of at most 12 significant bits are exact in f32: the first
    // product of a run is loaded without a rounding (no load site).
    for_each_rounding(order, k, Format::F32, false, &mut |s| sites.push(s));
    build(&sites, k)
}

type Key = (Range<usize>, Range<usize>);

fn key(op: &Operand) -> Option<Key> {
    match op {
        Operand::Value { first, second, .. } => Some((first.clone(), second.clone())),
        _ => None,
    }
}

fn build(sites: &[RoundingSite], k: usize) -> Option<Program> {
    let mut steps: Vec<Step> = Vec::new();
    let mut live: HashMap<Key, usize> = HashMap::new();
    let mut free: Vec<usize> = Vec::new();
    let mut slots = 0usize;
    let mut used = vec![false; k];
    let take_term = |i: usize, used: &mut Vec<bool>| -> Option<()> {
        if i >= k || used[i] {
            return None;
        }
        used[i] = true;
        Some(())
    };
    let mut alloc = |free: &mut Vec<usize>| {
        free.pop().unwrap_or_else(|| {
            slots += 1;
            slots - 1
        })
    };
    let mut last = None;
    for s in sites {
        if s.format != Format::F32 || !s.fused.is_empty() {
            return None;
        }
        let result_key = (s.first.clone(), s.second.clone());
        let slot = match (&s.ops[0], &s.ops[1]) {
            (Operand::Term(i), Operand::Term(j)) => {
                take_term(*i, &mut used)?;
                take_term(*j, &mut used)?;
                let slot = alloc(&mut free);
                steps.push(Step::Start { slot, term: *i });
                push_chain(&mut steps, slot, *j);
                slot
            }
            (v @ Operand::Value { .. }, Operand::Term(j))
            | (Operand::Term(j), v @ Operand::Value { .. }) => {
                take_term(*j, &mut used)?;
                let slot = live.remove(&key(v)?)?;
                push_chain(&mut steps, slot, *j);
                slot
            }
            (x @ Operand::Value { .. }, y @ Operand::Value { .. }) => {
                let into = live.remove(&key(x)?)?;
                let from = live.remove(&key(y)?)?;
                steps.push(Step::Add { into, from });
                free.push(from);
                into
            }
            // An empty part (fewer terms than parts) added to a value: the value itself (an
            // F32 value rounded to F32, or an exact product).
            (v @ Operand::Value { .. }, Operand::None)
            | (Operand::None, v @ Operand::Value { .. }) => live.remove(&key(v)?)?,
            (Operand::Term(i), Operand::None) | (Operand::None, Operand::Term(i)) => {
                take_term(*i, &mut used)?;
                let slot = alloc(&mut free);
                steps.push(Step::Start { slot, term: *i });
                slot
            }
            // Sums of nothing: not in this program's arithmetic.
            _ => return None,
        };
        if live.insert(result_key.clone(), slot).is_some() {
            return None;
        }
        last = Some(result_key);
    }
    // A single term has no rounding: the result is the product itself.
    if sites.is_empty() {
        if k != 1 {
            return None;
        }
        return Some(Program {
            steps: vec![Step::Start { slot: 0, term: 0 }],
            slots: 1,
            result: 0,
            terms: 1,
        });
    }
    let result = live.remove(&last?)?;
    if !live.is_empty() || used.iter().any(|u| !u) {
        return None;
    }
    Some(Program {
        steps,
        slots,
        result,
        terms: k,
    })
}

/// Append term `j` to the chain into `slot`, extending the previous step when it is the same
/// chain's previous term.
fn push_chain(steps: &mut Vec<Step>, slot: usize, j: usize) {
    if let Some(Step::Chain { slot: s, terms }) = steps.last_mut() {
        if *s == slot && terms.end == j {
            terms.end = j + 1;
            return;
        }
    }
    steps.push(Step::Chain {
        slot,
        terms: j..j + 1,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::order::Combine;

    #[test]
    fn sequential_is_one_chain() {
        let p = program(&Order::Sequential, 5).unwrap();
        assert_eq!(
            p.steps,
            vec![
                Step::Start { slot: 0, term: 0 },
                Step::Chain {
                    slot: 0,
                    terms: 1..5
                }
            ]
        );
        assert_eq!((p.slots, p.result), (1, 0));
    }

    #[test]
    fn blocks_add_into_the_total() {
        let p = program(&Order::blocked(2), 5).unwrap();
        assert_eq!(
            p.steps,
            vec![
                Step::Start { slot: 0, term: 0 },
                Step::Chain {
                    slot: 0,
                    terms: 1..2
                },
                Step::Start { slot: 1, term: 2 },
                Step::Chain {
                    slot: 1,
                    terms: 3..4
                },
                Step::Add { into: 0, from: 1 },
                // A block of one term is added as a term.
                Step::Chain {
                    slot: 0,
                    terms: 4..5
                },
            ]
        );
    }

    #[test]
    fn unsupported_orders_have_no_program() {
        assert!(program(&Order::Kahan, 8).is_none());
        assert!(program(&Order::AnyOf(vec![Order::Sequential]), 8).is_none());
        // Partial results rounded to BF16: a rounding to another format.
        let bf16 = Order::SplitK {
            parts: 2,
            inner: Box::new(Order::Sequential),
            partial: Format::BF16,
            combine: Combine::Tree,
        };
        assert!(program(&bf16, 8).is_none());
        assert!(program(&Order::Sequential, 0).is_none());
    }

    #[test]
    fn every_term_once_for_split_and_pairwise_orders() {
        for k in [1usize, 2, 3, 7, 8, 9, 31, 100, 1000] {
            for order in [
                Order::pairwise(8),
                Order::pairwise(1),
                Order::split_k(8, Format::F32, Combine::Tree),
                Order::split_k(3, Format::F32, Combine::Sequential),
                Order::split_k(4, Format::F32, Combine::Ring { start: 2 }),
            ] {
                // Split-K over more parts than terms adds sums of nothing: left to the walk.
                let Some(p) = program(&order, k) else {
                    assert!(k < 8, "{order} k={k}");
                    continue;
                };
                let mut seen = vec![0; k];
                for s in &p.steps {
                    match s {
                        Step::Start { term, .. } => seen[*term] += 1,
                        Step::Chain { terms, .. } => terms.clone().for_each(|t| seen[t] += 1),
                        Step::Add { .. } => {}
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "{order} k={k}");
                assert!(p.slots <= 2 + k.ilog2() as usize + 8, "{order} k={k}");
            }
        }
    }
}
