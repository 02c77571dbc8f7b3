//! The engine's tiny GPT executed the Megatron-LM way on a simulated device mesh, one training
//! step forward and backward, producing every rank's traced tensors with their layouts.
//!
//! Per rank (coordinates (d, c, t) on a [`Mesh`]):
//! * **Data**: batch rows d·B/dp … (DP), sequence chunks c and 2·cp − 1 − c of 2·cp (CP, the
//!   load-balanced order); under sequence parallelism the rank's sequence is further cut into
//!   tp contiguous pieces for the regions outside tensor-parallel layers (embedding, norms,
//!   residuals).
//! * **Column-parallel** `attn.qkv` (heads split, [Q | K | V] interleaved: `Split{groups: 3}`),
//!   `mlp.fc1` and `lm_head` (vocabulary split): the input is all-gathered along the sequence
//!   under SP; forward needs no reduction; backward reduces dx over TP (ring all-reduce, or
//!   reduce-scatter along the sequence under SP) in the activation format.
//! * **Row-parallel** `attn.proj`, `mlp.fc2`: each rank's partial output (rounded to the
//!   activation format) is all-reduced (or reduce-scattered under SP) in the activation
//!   format, then the bias is added once: y = ro(ra(ŷ + b)).
//! * **Attention** on the rank's heads; with cp > 1 ring attention
//!   ([`ring_attention`](crate::shard::ring_attention)).
//! * **Loss**: logits all-gathered over TP, per-rank mean cross-entropy over local tokens, the
//!   means all-reduced over DP×CP and divided by dp·cp; backward starts from 1/(dp·cp), which
//!   makes every logit gradient equal the reference's.
//! * **Parameter gradients**: all-reduced (sum) over the DP×CP group in the gradient format;
//!   gradients of replicated parameters (norms, row-parallel biases, embeddings) are also
//!   all-reduced over TP under sequence parallelism.
//! * **FP8**: per-tensor scales (current or delayed) from the amax all-reduced (max) over every
//!   rank that holds a piece of the tensor — the whole mesh — so that every rank quantizes with
//!   the reference's scale.
//!
//! With tp = cp = dp = 1 every op runs on the whole tensor exactly as the reference does, so
//! the run is bit-identical to [`Gpt::step`].

use std::collections::HashMap;

use crate::bugs::Bug;
use crate::shard::collective::{all_gather, all_reduce, reduce_scatter, Algorithm};
use crate::shard::plan::{ParallelStyle, ShardingPlan};
use crate::shard::ring::{ring_attention_backward, ring_attention_with, RingOptions, RingSaved};
use ttrace::__lab::attention_with_scale;
use ttrace::__lab::Arith;
use ttrace::engine::{
    self as nn, cross_entropy, cross_entropy_backward, embedding, embedding_backward, gelu,
    gelu_backward, layer_norm, norm_backward, rms_norm, silu, silu_backward, NormSaved,
};
use ttrace::engine::{attention_backward, AttentionSaved};
use ttrace::engine::{column_sums, transpose};
use ttrace::engine::{delayed_scale, per_tensor_scale, AttentionImpl, OpClass, Pass};
use ttrace::engine::{linear_scaled, matmul_scaled};
use ttrace::engine::{Activation, Gpt, Module, NormKind};
use ttrace::trace::merge;
use ttrace::trace::ModuleKind;
use ttrace::trace::TensorId;
use ttrace::trace::Trace;
use ttrace::trace::{shard, Axis, Layout, Mesh, Placement};
use ttrace::Tensor;
use ttrace::{Error, Result};
use ttrace::{Format, Overflow};
use ttrace::{Policy, Scaling};

mod passes;

/// One traced tensor of a sharded step: every rank's shard and the layout that merges them.
#[derive(Debug, Clone)]
pub struct ShardedEntry {
    /// Canonical id (the reference trace's id).
    pub id: String,
    /// How the shards merge into the logical tensor.
    pub layout: Layout,
    /// One tensor per global rank.
    pub shards: Vec<Tensor>,
}

/// The result of one sharded training step.
#[derive(Debug, Clone)]
pub struct ShardedStep {
    /// The mesh it ran on.
    pub mesh: Mesh,
    /// The loss (replicated on every rank).
    pub loss: f64,
    /// Every traced tensor, in the reference's execution order.
    pub entries: Vec<ShardedEntry>,
}

impl ShardedStep {
    /// Merge every entry into its logical tensor (canonical mapping). With a reference trace,
    /// each merged shape must equal the reference tensor's shape and every reference id must be
    /// present; errors name the tensor.
    pub fn merge(&self, reference: Option<&Trace>) -> Result<Trace> {
        let mut out = Trace::new();
        for e in &self.entries {
            let expected = match reference {
                Some(r) => Some(r.require(&e.id)?.shape().to_vec()),
                None => None,
            };
            out.push(
                e.id.clone(),
                merge(&e.shards, &e.layout, &self.mesh, &e.id, expected.as_deref())?,
            )?;
        }
        if let Some(r) = reference {
            if let Some(id) = r.ids().find(|id| out.get(id).is_none()) {
                return Err(Error::UnknownName {
                    kind: "traced tensor missing from the sharded run",
                    name: id.to_string(),
                });
            }
        }
        Ok(out)
    }

    /// Merge every entry on its own: the merged tensors that succeed, and for the others the
    /// error (a replica mismatch names the rank) — a checker reports both instead of stopping
    /// at the first.
    pub fn merge_each(&self, reference: &Trace) -> (Trace, Vec<(String, Error)>) {
        let mut out = Trace::new();
        let mut errors = vec![];
        for e in &self.entries {
            let expected = reference.get(&e.id).map(|t| t.shape().to_vec());
            match merge(&e.shards, &e.layout, &self.mesh, &e.id, expected.as_deref()) {
                Ok(t) => {
                    if let Err(err) = out.push(e.id.clone(), t) {
                        errors.push((e.id.clone(), err));
                    }
                }
                Err(err) => errors.push((e.id.clone(), err)),
            }
        }
        (out, errors)
    }

    /// The entry with this id.
    pub fn entry(&self, id: &str) -> Option<&ShardedEntry> {
        self.entries.iter().find(|e| e.id == id)
    }
}

/// A tensor held by every rank, with its layout.
#[derive(Debug, Clone)]
struct Dist {
    shards: Vec<Tensor>,
    layout: Layout,
}

/// A rank's coordinates on the simulator's mesh, Megatron's `[dp, cp, tp]`.
#[derive(Debug, Clone, Copy)]
struct Coords {
    dp: usize,
    cp: usize,
    tp: usize,
}

impl Coords {
    fn of(mesh: &Mesh, r: usize) -> Coords {
        Coords {
            dp: mesh.coord(r, &Axis::DP),
            cp: mesh.coord(r, &Axis::CP),
            tp: mesh.coord(r, &Axis::TP),
        }
    }

    fn rank(self, mesh: &Mesh) -> usize {
        mesh.rank_at(&[
            (&Axis::DP, self.dp),
            (&Axis::CP, self.cp),
            (&Axis::TP, self.tp),
        ])
    }
}

impl Dist {
    /// New shards with the layout of `other`.
    fn like(shards: Vec<Tensor>, other: &Dist) -> Dist {
        Dist {
            shards,
            layout: other.layout.clone(),
        }
    }
}

enum Saved {
    None,
    Norm(Vec<NormSaved>),
    Attention(Vec<AttentionSaved>),
    Ring(Vec<(Vec<usize>, RingSaved)>),
    /// Linear: the (gathered) 2-D input of every rank.
    Linear(Vec<Tensor>),
    /// Loss: every rank's full-vocabulary logits [rows, vocab].
    Loss(Vec<Tensor>),
}

/// A module's backward on every rank: one gradient per input, and (parameter, per-rank
/// gradient) pairs before the data-parallel reduction.
type Backward = (Vec<Dist>, Vec<(String, Vec<Tensor>)>);

/// The tiny GPT on a device mesh. Holds the reference model (parameters, data, recipe) and the
/// sharded run's own FP8 amax histories.
#[derive(Debug, Clone)]
pub struct ShardedGpt {
    model: Gpt,
    mesh: Mesh,
    algorithm: Algorithm,
    amax_history: HashMap<String, Vec<f64>>,
    scales_used: HashMap<String, f64>,
    /// Every rank's scale per operand (equal across ranks unless a bug makes them differ).
    rank_scales: HashMap<String, Vec<f64>>,
    bug: Option<Bug>,
    /// Which linears are split over the tensor-parallel ranks, and how.
    plan: ShardingPlan,
    /// Replaying single modules: reuse the last step's FP8 scales, record nothing.
    replay: bool,
}

impl ShardedGpt {
    /// Shard `model` (a freshly built reference, whose parameters and data are the logical
    /// tensors every rank slices) over `mesh`. Checks that every split divides: batch by dp,
    /// sequence by 2·cp (and by 2·cp·tp under SP), heads, the MLP width and the vocabulary by
    /// tp.
    pub fn new(model: Gpt, mesh: Mesh, algorithm: Algorithm) -> Result<ShardedGpt> {
        let c = model.config();
        let mut checks = vec![
            ("batch", c.batch, mesh.size(&Axis::DP), "dp"),
            ("seq", c.seq, 2 * mesh.size(&Axis::CP), "2·cp"),
            ("heads", c.heads, mesh.size(&Axis::TP), "tp"),
            ("ffn", c.ffn_mult * c.hidden, mesh.size(&Axis::TP), "tp"),
            ("vocab", c.vocab, mesh.size(&Axis::TP), "tp"),
        ];
        if mesh.sequence_parallel() {
            checks.push((
                "seq",
                c.seq,
                2 * mesh.size(&Axis::CP) * mesh.size(&Axis::TP),
                "2·cp·tp (sequence parallel)",
            ));
        }
        for (what, n, by, by_name) in checks {
            if n % by != 0 {
                return Err(Error::InvalidParameter {
                    name: "mesh",
                    reason: format!(
                        "{what} = {n} is not divisible by {by_name} = {by} on mesh {}",
                        mesh.label()
                    ),
                });
            }
        }
        if matches!(
            model
                .recipe()
                .policy(OpClass::Matmul, Pass::Forward)
                .scaling,
            Scaling::Block { .. }
        ) && mesh.world() > 1
        {
            return Err(Error::InvalidParameter {
                name: "recipe",
                reason: "block-scaled (MX) FP8 is not simulated on a mesh: its blocks would have \
                         to align with every shard boundary"
                    .into(),
            });
        }
        Ok(ShardedGpt {
            model,
            mesh,
            algorithm,
            amax_history: HashMap::new(),
            scales_used: HashMap::new(),
            rank_scales: HashMap::new(),
            bug: None,
            plan: ShardingPlan::megatron_gpt(),
            replay: false,
        })
    }

    /// The tensor-parallel plan the model is sharded by (Megatron-LM's GPT plan, which the
    /// attention's head split and the vocabulary-parallel loss assume).
    pub fn plan(&self) -> &ShardingPlan {
        &self.plan
    }

    /// The style of the linear `module` ([`ShardingPlan::linear_style`]).
    fn style(&self, module: &str) -> ParallelStyle {
        self.plan.linear_style(module)
    }

    /// The per-tensor FP8 scales of the last step (rank 0's; identical on every rank unless a
    /// bug makes them differ), by operand key as [`Gpt::scales`] names them.
    pub fn scales(&self) -> &HashMap<String, f64> {
        &self.scales_used
    }

    /// Every rank's FP8 scale of each operand in the last step.
    pub fn rank_scales(&self) -> &HashMap<String, Vec<f64>> {
        &self.rank_scales
    }

    /// The same model with a bug from the catalog injected.
    pub fn with_bug(mut self, bug: Bug) -> ShardedGpt {
        self.bug = Some(bug);
        self
    }

    /// The injected bug, if any.
    pub fn bug(&self) -> Option<Bug> {
        self.bug
    }

    /// The mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The reference model whose parameters and data are sharded.
    pub fn model(&self) -> &Gpt {
        &self.model
    }

    fn policy(&self, class: OpClass, pass: Pass) -> Policy {
        self.model.recipe().policy(class, pass).clone()
    }

    fn coords(&self, r: usize) -> Coords {
        Coords::of(&self.mesh, r)
    }

    /// The activation layout: batch over DP, CP chunks of the sequence, TP as given.
    fn act(&self, tp: Placement) -> Layout {
        Layout::replicated()
            .with(Axis::DP, Placement::split(0))
            .with(Axis::CP, Placement::CpChunks { dim: 1 })
            .with(Axis::TP, tp)
    }

    /// Layout of the regions outside tensor-parallel layers.
    fn region(&self) -> Layout {
        if self.mesh.sequence_parallel() {
            self.act(Placement::split(1))
        } else {
            self.act(Placement::Replicate)
        }
    }

    fn param_layout(&self, name: &str) -> Layout {
        let tp = if let Some(module) = name
            .strip_suffix(".weight")
            .or_else(|| name.strip_suffix(".bias"))
        {
            match (self.plan.style(module), name.ends_with(".weight")) {
                (None, _) => Placement::Replicate,
                (Some(ParallelStyle::Colwise { groups }), _) => Placement::Split { dim: 0, groups },
                (Some(ParallelStyle::Rowwise), true) => Placement::split(1),
                (Some(ParallelStyle::Rowwise), false) => Placement::Replicate,
            }
        } else {
            Placement::Replicate
        };
        Layout::replicated().with(Axis::TP, tp)
    }

    /// Every rank's shard of a parameter.
    fn param_shards(&self, name: &str) -> Result<Vec<Tensor>> {
        let mut layout = self.param_layout(name);
        let grouped = matches!(
            self.plan.style_of_param(name),
            Some(ParallelStyle::Colwise { groups }) if groups > 1
        );
        if self.bug == Some(Bug::QkvWrongInterleave) && grouped {
            // The bug: a contiguous split of a grouped weight, [Q | K | V] (the declared
            // layout stays grouped).
            layout.set(Axis::TP, Placement::split(0));
        }
        shard(self.model.param(name)?, &layout, &self.mesh, name)
    }

    /// Token ids, targets (each [b_local·s_local]) and positions of a rank's tokens.
    fn local_tokens(&self, r: usize, sp: bool) -> (Vec<usize>, Vec<usize>, Vec<usize>, usize) {
        let cfg = self.model.config();
        let Coords { dp, cp, tp } = self.coords(r);
        let bl = cfg.batch / self.mesh.size(&Axis::DP);
        let c = cfg.seq / (2 * self.mesh.size(&Axis::CP));
        let mut pos: Vec<usize> = (cp * c..(cp + 1) * c)
            .chain(
                (2 * self.mesh.size(&Axis::CP) - 1 - cp) * c
                    ..(2 * self.mesh.size(&Axis::CP) - cp) * c,
            )
            .collect();
        if sp && self.mesh.sequence_parallel() {
            let piece = pos.len() / self.mesh.size(&Axis::TP);
            pos = pos[tp * piece..(tp + 1) * piece].to_vec();
        }
        let mut ids = vec![];
        let mut tg = vec![];
        for b in dp * bl..(dp + 1) * bl {
            for &p in &pos {
                ids.push(self.model.tokens()[b * cfg.seq + p]);
                tg.push(self.model.targets()[b * cfg.seq + p]);
            }
        }
        (ids, tg, pos, bl)
    }

    /// Ranks of each TP group (same dp, cp), in tp order.
    fn tp_groups(&self) -> Vec<Vec<usize>> {
        let m = &self.mesh;
        let mut out = vec![];
        for dp in 0..m.size(&Axis::DP) {
            for cp in 0..m.size(&Axis::CP) {
                out.push(
                    (0..m.size(&Axis::TP))
                        .map(|tp| Coords { dp, cp, tp }.rank(m))
                        .collect(),
                );
            }
        }
        out
    }

    /// Ranks of each DP×CP group (same tp), in (dp, cp) order.
    fn dpcp_groups(&self) -> Vec<Vec<usize>> {
        let m = &self.mesh;
        (0..m.size(&Axis::TP))
            .map(|tp| {
                let mut g = vec![];
                for dp in 0..m.size(&Axis::DP) {
                    for cp in 0..m.size(&Axis::CP) {
                        g.push(Coords { dp, cp, tp }.rank(m));
                    }
                }
                g
            })
            .collect()
    }

    /// Ranks of each CP group (same dp, tp), in cp order.
    fn cp_groups(&self) -> Vec<Vec<usize>> {
        let m = &self.mesh;
        let mut out = vec![];
        for dp in 0..m.size(&Axis::DP) {
            for tp in 0..m.size(&Axis::TP) {
                out.push(
                    (0..m.size(&Axis::CP))
                        .map(|cp| Coords { dp, cp, tp }.rank(m))
                        .collect(),
                );
            }
        }
        out
    }

    /// All-reduce within each group (no-op for groups of one rank).
    fn all_reduce_groups(
        &self,
        shards: &mut [Tensor],
        groups: &[Vec<usize>],
        fmt: Format,
    ) -> Result<()> {
        for g in groups {
            if g.len() < 2 {
                continue;
            }
            let parts: Vec<Tensor> = g.iter().map(|&r| shards[r].clone()).collect();
            let red = all_reduce(&parts, self.algorithm, fmt)?;
            for &r in g {
                shards[r] = red.clone();
            }
        }
        Ok(())
    }

    /// All-gather along `dim` within each TP group.
    fn gather_tp(&self, shards: &[Tensor], dim: usize, what: &str) -> Result<Vec<Tensor>> {
        let mut out = shards.to_vec();
        for g in self.tp_groups() {
            let parts: Vec<Tensor> = g.iter().map(|&r| shards[r].clone()).collect();
            let full = all_gather(&parts, dim, what)?;
            for &r in &g {
                out[r] = full.clone();
            }
        }
        Ok(out)
    }

    /// Reduce partial sums over TP: ring all-reduce, or reduce-scatter along the sequence under
    /// sequence parallelism.
    fn reduce_tp(&self, shards: &mut [Tensor], fmt: Format) -> Result<()> {
        if self.mesh.size(&Axis::TP) == 1 {
            return Ok(());
        }
        if self.mesh.sequence_parallel() {
            for g in self.tp_groups() {
                let parts: Vec<Tensor> = g.iter().map(|&r| shards[r].clone()).collect();
                let out = reduce_scatter(&parts, 1, fmt)?;
                for (&r, t) in g.iter().zip(out) {
                    shards[r] = t;
                }
            }
            Ok(())
        } else {
            self.all_reduce_groups(shards, &self.tp_groups(), fmt)
        }
    }

    /// The reduce-scatter bug: scatter along the batch dimension, then view the result as the
    /// sequence shard it should have been ([b/tp, s, h] read as [b, s/tp, h]).
    fn reduce_scatter_batch_dim(&self, shards: &mut [Tensor], fmt: Format) -> Result<()> {
        for g in self.tp_groups() {
            let parts: Vec<Tensor> = g.iter().map(|&r| shards[r].clone()).collect();
            let shape = parts[0].shape().to_vec();
            let out = reduce_scatter(&parts, 0, fmt)?;
            let mut want = shape.clone();
            want[1] /= self.mesh.size(&Axis::TP);
            for (&r, t) in g.iter().zip(out) {
                shards[r] = t.reshape(&want)?;
            }
        }
        Ok(())
    }

    /// Slice every rank's tensor along `dim` to its TP part (the backward of an all-gather).
    fn slice_tp(&self, shards: &[Tensor], dim: usize, what: &str) -> Result<Vec<Tensor>> {
        let tp_only = Mesh::new([(Axis::TP, self.mesh.size(&Axis::TP))])?;
        let layout = Layout::replicated().with(Axis::TP, Placement::split(dim));
        shards
            .iter()
            .enumerate()
            .map(|(r, t)| {
                let parts = shard(t, &layout, &tp_only, what)?;
                Ok(parts[self.coords(r).tp].clone())
            })
            .collect()
    }

    /// The per-tensor FP8 scale of an operand, from the amax reduced over every rank.
    /// Per-rank FP8 scales of one operand (`None` when it is not quantized with a per-tensor
    /// scale). The amax is all-reduced (max) over every rank, so all ranks get the reference's
    /// scale — except under [`Bug::Fp8AmaxNotReduced`], where each rank uses its own shard's
    /// amax (and its own history). Forward and backward of a replay (`record = false`, or
    /// `self.replay`) reuse the scales of the last step.
    fn scale_for(
        &mut self,
        key: String,
        locals: &[Tensor],
        policy: &Policy,
        fmt: Format,
        record: bool,
    ) -> Vec<Option<f64>> {
        let world = self.mesh.world();
        if !matches!(fmt, Format::E4M3 | Format::E5M2) {
            return vec![None; world];
        }
        let per_rank = self.bug == Some(Bug::Fp8AmaxNotReduced);
        let record = record && !self.replay;
        let global = locals.iter().map(|t| t.amax()).fold(0.0, f64::max);
        let amax_of = |r: usize| {
            if per_rank {
                locals.get(r).map(|t| t.amax()).unwrap_or(0.0)
            } else {
                global
            }
        };
        let scales: Vec<f64> = match policy.scaling {
            Scaling::PerTensorCurrent { margin } => {
                if self.replay {
                    if let Some(v) = self.rank_scales.get(&key) {
                        return v.iter().map(|&x| Some(x)).collect();
                    }
                }
                (0..world)
                    .map(|r| per_tensor_scale(amax_of(r), fmt, margin))
                    .collect()
            }
            Scaling::PerTensorDelayed { margin } => {
                if !record {
                    return match self.rank_scales.get(&key) {
                        Some(v) => v.iter().map(|&x| Some(x)).collect(),
                        None => vec![Some(1.0); world],
                    };
                }
                let keep = self.model.recipe().amax_history_len.max(1);
                let hkeys: Vec<String> = if per_rank {
                    (0..world).map(|r| format!("{key}@{r}")).collect()
                } else {
                    vec![key.clone()]
                };
                // Every rank's scale from the history as it was before this step...
                let scales: Vec<f64> = (0..world)
                    .map(|r| {
                        let hkey = &hkeys[if per_rank { r } else { 0 }];
                        let hist = self.amax_history.get(hkey).cloned().unwrap_or_default();
                        delayed_scale(&hist, fmt, margin)
                    })
                    .collect();
                // ...then this step's amax joins the history.
                for (i, hkey) in hkeys.into_iter().enumerate() {
                    let entry = self.amax_history.entry(hkey).or_default();
                    entry.push(amax_of(i));
                    if entry.len() > keep {
                        let drop = entry.len() - keep;
                        entry.drain(..drop);
                    }
                }
                scales
            }
            _ => return vec![None; world],
        };
        if record {
            self.scales_used.insert(key.clone(), scales[0]);
            self.rank_scales.insert(key, scales.clone());
        }
        scales.into_iter().map(Some).collect()
    }

    fn flatten(t: &Tensor) -> Result<Tensor> {
        let last = *t.shape().last().unwrap_or(&1);
        t.reshape(&[t.len().checked_div(last).unwrap_or(0), last])
    }

    fn dists(&self, inputs: &[(&Tensor, Layout)], what: &str) -> Result<Vec<Dist>> {
        inputs
            .iter()
            .map(|(t, layout)| {
                Ok(Dist {
                    shards: shard(t, layout, &self.mesh, what)?,
                    layout: layout.clone(),
                })
            })
            .collect()
    }

    /// Replay one module forward on logical inputs, each sharded by the layout given (the
    /// layouts of the step's trace), with the FP8 scales of the last step: every rank's output
    /// and its layout. The localizer feeds the reference's own inputs this way.
    pub fn replay_forward(
        &mut self,
        name: &str,
        inputs: &[(&Tensor, Layout)],
    ) -> Result<ShardedEntry> {
        let m = self.model.module(name)?.clone();
        let d = self.dists(inputs, name)?;
        self.replay = true;
        let out = self.forward(&m, &d);
        self.replay = false;
        let (out, _) = out?;
        Ok(ShardedEntry {
            id: TensorId::fwd_output(name, 0).to_string(),
            layout: out.layout,
            shards: out.shards,
        })
    }

    /// Replay one module backward on logical forward inputs and output gradient (sharded by
    /// the layouts given): the input gradients (`{name}|grad.input.{i}`) and the reduced
    /// parameter gradients (`{param}|param_grad`) of every rank.
    pub fn replay_backward(
        &mut self,
        name: &str,
        inputs: &[(&Tensor, Layout)],
        grad_output: (&Tensor, Layout),
    ) -> Result<Vec<ShardedEntry>> {
        let m = self.model.module(name)?.clone();
        let d = self.dists(inputs, name)?;
        let g = self.dists(&[grad_output], name)?.remove(0);
        self.replay = true;
        let result = (|| {
            let (_, saved) = self.forward(&m, &d)?;
            let (gin, pg) = self.backward(&m, &d, &saved, &g)?;
            let mut out = vec![];
            for (i, gi) in gin.into_iter().enumerate() {
                out.push(ShardedEntry {
                    id: TensorId::grad_input(name, i).to_string(),
                    layout: gi.layout,
                    shards: gi.shards,
                });
            }
            for (p, mut shards) in pg {
                let layout = self.reduce_param_grad(&p, &mut shards)?;
                out.push(ShardedEntry {
                    id: TensorId::param_grad(&p).to_string(),
                    layout,
                    shards,
                });
            }
            Ok(out)
        })();
        self.replay = false;
        result
    }

    /// One training step on the mesh, with the trace of every rank.
    pub fn step(&mut self) -> Result<ShardedStep> {
        let modules = self.model.modules().to_vec();
        let mut entries = vec![];
        let nvalues = modules.iter().map(|m| m.output).max().unwrap_or(0) + 1;
        let mut values: Vec<Option<Dist>> = vec![None; nvalues];
        let mut saved = Vec::with_capacity(modules.len());
        let push = |entries: &mut Vec<ShardedEntry>, id: String, d: &Dist| {
            entries.push(ShardedEntry {
                id,
                layout: d.layout.clone(),
                shards: d.shards.clone(),
            })
        };
        for m in &modules {
            let inputs: Vec<Dist> = m
                .inputs
                .iter()
                .map(|&v| {
                    values[v].clone().ok_or_else(|| Error::UnknownName {
                        kind: "value",
                        name: v.to_string(),
                    })
                })
                .collect::<Result<_>>()?;
            for (i, d) in inputs.iter().enumerate() {
                push(&mut entries, TensorId::fwd_input(&m.name, i).to_string(), d);
            }
            let (out, s) = self.forward(m, &inputs)?;
            push(
                &mut entries,
                TensorId::fwd_output(&m.name, 0).to_string(),
                &out,
            );
            values[m.output] = Some(out);
            saved.push((inputs, s));
        }
        let last = modules.len() - 1;
        let loss = values[modules[last].output]
            .as_ref()
            .and_then(|d| d.shards.first())
            .and_then(|t| t.values().first().copied())
            .unwrap_or(f64::NAN);
        let mut grads: Vec<Option<Dist>> = vec![None; nvalues];
        let seed = Tensor::from_vec(&[], vec![1.0], Format::F32)?;
        grads[modules[last].output] = Some(Dist {
            shards: vec![seed; self.mesh.world()],
            layout: Layout::replicated(),
        });
        let acc_policy = self.policy(OpClass::Elementwise, Pass::Backward);
        let mut param_grads = vec![];
        for (idx, m) in modules.iter().enumerate().rev() {
            let g = grads[m.output].take().ok_or_else(|| Error::UnknownName {
                kind: "gradient of value",
                name: m.output.to_string(),
            })?;
            push(
                &mut entries,
                TensorId::grad_output(&m.name, 0).to_string(),
                &g,
            );
            let (inputs, s) = &saved[idx];
            let (gin, pg) = self.backward(m, inputs, s, &g)?;
            for (i, (gi, &v)) in gin.into_iter().zip(&m.inputs).enumerate() {
                push(
                    &mut entries,
                    TensorId::grad_input(&m.name, i).to_string(),
                    &gi,
                );
                grads[v] = Some(match grads[v].take() {
                    None => gi,
                    Some(prev) => Dist {
                        shards: prev
                            .shards
                            .iter()
                            .zip(&gi.shards)
                            .map(|(a, b)| nn::add(a, b, &acc_policy))
                            .collect::<Result<_>>()?,
                        layout: prev.layout,
                    },
                });
            }
            param_grads.extend(pg);
        }
        for (name, mut shards) in param_grads {
            let layout = self.reduce_param_grad(&name, &mut shards)?;
            entries.push(ShardedEntry {
                id: TensorId::param_grad(&name).to_string(),
                layout,
                shards,
            });
        }
        Ok(ShardedStep {
            mesh: self.mesh.clone(),
            loss,
            entries,
        })
    }
}
