//! The tensor-parallel plan as data: module-name patterns mapped to parallel styles, as
//! PyTorch's `parallelize_module(module, mesh, {fqn: ParallelStyle})` takes it. The simulator
//! (which layers it shards and how), the fresh-site model of the validation lab and the bug
//! catalog read the plan instead of testing module names each on its own.

use serde::Serialize;

/// How a linear layer is split over the tensor-parallel ranks (Megatron-LM's column- and
/// row-parallel linears; PyTorch's `ColwiseParallel` and `RowwiseParallel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "style")]
pub enum ParallelStyle {
    /// The weight's output features split over the ranks, in `groups` interleaved groups
    /// (3 for a fused QKV projection: each rank holds its heads' Q, K and V); the output is
    /// split along its last dimension.
    Colwise {
        /// Interleaved groups of the output features (≥ 1).
        groups: usize,
    },
    /// The weight's input features split over the ranks; each rank's output is a partial sum
    /// that an all-reduce (or a reduce-scatter under sequence parallelism) completes; the bias
    /// is replicated and added once.
    Rowwise,
}

/// A tensor-parallel plan: module-name patterns and their styles, the first match winning.
/// A pattern is a dotted module name whose `*` segments match any one segment
/// (`layers.*.attn.qkv`). A module no pattern matches is replicated.
///
/// # Examples
///
/// ```
/// use ttrace_lab::shard::{ParallelStyle, ShardingPlan};
/// let plan = ShardingPlan::megatron_gpt();
/// assert_eq!(plan.style("layers.3.attn.qkv"), Some(ParallelStyle::Colwise { groups: 3 }));
/// assert_eq!(plan.style("layers.0.mlp.fc2"), Some(ParallelStyle::Rowwise));
/// assert_eq!(plan.style("layers.0.ln1"), None);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShardingPlan {
    rules: Vec<(String, ParallelStyle)>,
}

impl ShardingPlan {
    /// No module parallelized.
    pub fn empty() -> ShardingPlan {
        ShardingPlan { rules: vec![] }
    }

    /// The plan of Megatron-LM's GPT, which the simulator's tiny GPT follows: the fused QKV
    /// projection and the MLP's first linear column-parallel, the attention's output
    /// projection and the MLP's second linear row-parallel, the LM head column-parallel over
    /// the vocabulary.
    pub fn megatron_gpt() -> ShardingPlan {
        ShardingPlan::empty()
            .with("layers.*.attn.qkv", ParallelStyle::Colwise { groups: 3 })
            .with("layers.*.attn.proj", ParallelStyle::Rowwise)
            .with("layers.*.mlp.fc1", ParallelStyle::Colwise { groups: 1 })
            .with("layers.*.mlp.fc2", ParallelStyle::Rowwise)
            .with("lm_head", ParallelStyle::Colwise { groups: 1 })
    }

    /// The plan with one more rule, after the existing ones.
    pub fn with(mut self, pattern: &str, style: ParallelStyle) -> ShardingPlan {
        self.rules.push((pattern.to_string(), style));
        self
    }

    /// The style of `module` (its full dotted name), if a pattern matches it.
    pub fn style(&self, module: &str) -> Option<ParallelStyle> {
        self.rules
            .iter()
            .find(|(p, _)| matches(p, module))
            .map(|(_, s)| *s)
    }

    /// The style of a *linear* `module` as the simulator runs it: the plan's, and
    /// column-parallel for a linear the plan does not name (the simulator splits every
    /// linear of its model).
    pub fn linear_style(&self, module: &str) -> ParallelStyle {
        self.style(module)
            .unwrap_or(ParallelStyle::Colwise { groups: 1 })
    }

    /// The style of the module that owns the parameter `parameter` (`….weight`, `….bias`).
    pub fn style_of_param(&self, parameter: &str) -> Option<ParallelStyle> {
        let module = parameter
            .strip_suffix(".weight")
            .or_else(|| parameter.strip_suffix(".bias"))?;
        self.style(module)
    }
}

/// Whether a dotted `pattern` (with `*` for any one segment) matches `name`.
fn matches(pattern: &str, name: &str) -> bool {
    let (mut p, mut n) = (pattern.split('.'), name.split('.'));
    loop {
        match (p.next(), n.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == "*" || a == b => {}
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_whole_segments() {
        assert!(matches("layers.*.attn.qkv", "layers.12.attn.qkv"));
        assert!(!matches("layers.*.attn.qkv", "layers.1.2.attn.qkv"));
        assert!(!matches("layers.*.attn.qkv", "layers.1.attn.qkv_bias"));
        assert!(!matches("lm_head", "lm_head.x"));
        assert!(matches("lm_head", "lm_head"));
        let plan = ShardingPlan::megatron_gpt();
        assert_eq!(
            plan.style_of_param("layers.0.attn.proj.bias"),
            Some(ParallelStyle::Rowwise)
        );
        assert_eq!(plan.style_of_param("layers.0.ln1.weight"), None);
        assert_eq!(plan.style_of_param("embedding.wte"), None);
    }
}
