//! The rounding sites of one reduction order as a program for the lane kernel: chains of
//! products added one at a time into a slot (sequential runs), and additions of two computed
//! values (block totals, pairwise trees, split-K combines). Built once per order from
//! [`for_each_rounding`], the description the walk and the engine share.

use crate::bounds::keyed::DataMap;
use std::ops::Range;

use crate::format::Format;
use crate::order::{for_each_rounding, Operand, Order, RoundingSite};

/// One step of a [`Program`], on slots of lane values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// `slot` = fl(a·b) of term `term`: the product loaded into FP32 (exact for inputs of at
    /// most 12 significant bits).
    Start {
        slot: usize,
        term: usize,
        /// Whether its rounding counts (false inside the prefix both orders share).
        count: bool,
    },
    /// `slot` = fl(slot + a·b) for the terms `terms`, one at a time.
    Chain {
        slot: usize,
        terms: Range<usize>,
        /// As for `Start`.
        count: bool,
    },
    /// `into` = fl(into + from); `from` is free afterwards.
    Add {
        into: usize,
        from: usize,
        /// As for `Start`.
        count: bool,
    },
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

/// The programs of two orders over `k` exact products accumulated in FP32 with every rounding
/// in FP32 (each run's first product loaded with a rounding: its [`Step::Start`]), with the
/// roundings of the prefix both perform alike marked as not counting: the same operations on
/// identically computed operands make the same errors, which cancel in the difference. `None`
/// for what the lane kernel does not execute: other formats, fused blocks, orders priced as a
/// whole (tensor cores, families, Kahan), k = 0.
pub(super) fn programs(
    reference: &Order,
    candidate: &Order,
    k: usize,
) -> Option<(Program, Program)> {
    let (r, c) = (sites(reference, k)?, sites(candidate, k)?);
    let shared = r.iter().zip(&c).take_while(|(x, y)| x == y).count();
    Some((build(&r, k, shared)?, build(&c, k, shared)?))
}

/// The program of one order, every rounding counting.
#[cfg(test)]
pub(super) fn program(order: &Order, k: usize) -> Option<Program> {
    build(&sites(order, k)?, k, 0)
}

fn sites(order: &Order, k: usize) -> Option<Vec<RoundingSite>> {
    if k == 0 || order.has_family() || order.has_tensor_core() || *order == Order::Kahan {
        return None;
    }
    let mut sites = Vec::new();
    // The load of a run's first product is its Start step (no separate site).
    for_each_rounding(order, k, Format::F32, false, &mut |s| sites.push(s));
    Some(sites)
}

type Key = (Range<usize>, Range<usize>);

fn key(op: &Operand) -> Option<Key> {
    match op {
        Operand::Value { first, second, .. } => Some((first.clone(), second.clone())),
        _ => None,
    }
}

fn build(sites: &[RoundingSite], k: usize, shared: usize) -> Option<Program> {
    let mut steps: Vec<Step> = Vec::new();
    let mut live: DataMap<Key, usize> = DataMap::default();
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
    for (index, s) in sites.iter().enumerate() {
        let count = index >= shared;
        if s.format != Format::F32 || !s.fused.is_empty() {
            return None;
        }
        let result_key = (s.first.clone(), s.second.clone());
        let slot = match (&s.ops[0], &s.ops[1]) {
            (Operand::Term(i), Operand::Term(j)) => {
                take_term(*i, &mut used)?;
                take_term(*j, &mut used)?;
                let slot = alloc(&mut free);
                steps.push(Step::Start {
                    slot,
                    term: *i,
                    count,
                });
                push_chain(&mut steps, slot, *j, count);
                slot
            }
            (v @ Operand::Value { .. }, Operand::Term(j))
            | (Operand::Term(j), v @ Operand::Value { .. }) => {
                take_term(*j, &mut used)?;
                let slot = live.remove(&key(v)?)?;
                push_chain(&mut steps, slot, *j, count);
                slot
            }
            (x @ Operand::Value { .. }, y @ Operand::Value { .. }) => {
                let into = live.remove(&key(x)?)?;
                let from = live.remove(&key(y)?)?;
                steps.push(Step::Add { into, from, count });
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
                steps.push(Step::Start {
                    slot,
                    term: *i,
                    count,
                });
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
            steps: vec![Step::Start {
                slot: 0,
                term: 0,
                count: shared == 0,
            }],
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
/// chain's previous term and counts alike.
fn push_chain(steps: &mut Vec<Step>, slot: usize, j: usize, count: bool) {
    if let Some(Step::Chain {
        slot: s,
        terms,
        count: c,
    }) = steps.last_mut()
    {
        if *s == slot && terms.end == j && *c == count {
            terms.end = j + 1;
            return;
        }
    }
    steps.push(Step::Chain {
        slot,
        terms: j..j + 1,
        count,
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
                Step::Start {
                    slot: 0,
                    term: 0,
                    count: true
                },
                Step::Chain {
                    slot: 0,
                    terms: 1..5,
                    count: true
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
                Step::Start {
                    slot: 0,
                    term: 0,
                    count: true
                },
                Step::Chain {
                    slot: 0,
                    terms: 1..2,
                    count: true
                },
                Step::Start {
                    slot: 1,
                    term: 2,
                    count: true
                },
                Step::Chain {
                    slot: 1,
                    terms: 3..4,
                    count: true
                },
                Step::Add {
                    into: 0,
                    from: 1,
                    count: true
                },
                // A block of one term is added as a term.
                Step::Chain {
                    slot: 0,
                    terms: 4..5,
                    count: true
                },
            ]
        );
    }

    /// Sequential vs split-K over 2: the first half is the same chain on both sides (its
    /// roundings do not count); everything after differs.
    #[test]
    fn the_shared_prefix_does_not_count() {
        let split = Order::split_k(2, Format::F32, Combine::Tree);
        let (r, c) = programs(&Order::Sequential, &split, 6).unwrap();
        let chain = |terms, count| Step::Chain {
            slot: 0,
            terms,
            count,
        };
        let start = Step::Start {
            slot: 0,
            term: 0,
            count: false,
        };
        assert_eq!(
            r.steps,
            vec![start.clone(), chain(1..3, false), chain(3..6, true)]
        );
        assert_eq!(c.steps[..2], [start, chain(1..3, false)]);
        assert!(c.steps[2..].iter().all(|s| matches!(
            s,
            Step::Start { count: true, .. }
                | Step::Chain { count: true, .. }
                | Step::Add { count: true, .. }
        )));
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
