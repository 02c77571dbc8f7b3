//! Simulated sharded execution: a device mesh with TP/SP/CP/DP, tensor layouts and the
//! canonical merge, collectives with explicit order and format, ring attention, and the tiny
//! GPT executed the Megatron-LM way (see `papers/sharding.md`).

pub(crate) mod collective;
pub(crate) mod model;
pub(crate) mod plan;
pub(crate) mod ring;

pub use collective::{all_gather, all_reduce, all_reduce_max, reduce_scatter, Algorithm};
pub use model::{ShardedEntry, ShardedGpt, ShardedStep};
pub use plan::{ParallelStyle, ShardingPlan};
pub use ring::{
    ring_attention, ring_attention_backward, ring_attention_with, RingOptions, RingSaved,
};
