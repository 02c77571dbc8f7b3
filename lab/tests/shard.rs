//! Sharded simulation: layouts, collectives, and the sharded GPT against the reference.

use proptest::prelude::*;
use ttrace::engine::{AttentionImpl, Gpt, GptConfig};
use ttrace::trace::{merge, shard, Axis, Layout, Mesh, Placement};
use ttrace::{exact_sum, Error, Format};
use ttrace::{Recipe, Tensor};
use ttrace_lab::shard::{all_gather, all_reduce, reduce_scatter, Algorithm, ShardedGpt};

fn config() -> GptConfig {
    GptConfig {
        layers: 2,
        hidden: 32,
        heads: 4,
        seq: 16,
        batch: 2,
        vocab: 64,
        attention: AttentionImpl::Online { block: 4 },
        ..GptConfig::default()
    }
}

fn run_pair(recipe: &str, mesh: Mesh) -> (ttrace::trace::Trace, ttrace::trace::Trace) {
    let r = Recipe::by_name(recipe).unwrap();
    let steps = if recipe.starts_with("fp8") { 2 } else { 1 };
    let mut reference = Gpt::new(config(), r.clone()).unwrap();
    let mut sharded =
        ShardedGpt::new(Gpt::new(config(), r).unwrap(), mesh, Algorithm::Ring).unwrap();
    let mut rt = None;
    let mut st = None;
    for _ in 0..steps {
        rt = Some(reference.step().unwrap().trace);
        st = Some(sharded.step().unwrap());
    }
    let rt = rt.unwrap();
    let merged = st.unwrap().merge(Some(&rt)).unwrap();
    (rt, merged)
}

#[test]
fn single_device_mesh_is_bit_identical_to_the_reference() {
    for recipe in ["fp32", "bf16", "fp8-delayed", "fp8-current"] {
        let (rt, merged) = run_pair(recipe, Mesh::single());
        assert_eq!(rt.len(), merged.len());
        for e in rt.entries() {
            let m = merged.require(&e.id).unwrap();
            assert_eq!(m.shape(), e.tensor.shape(), "{recipe} {}", e.id);
            let same = m
                .values()
                .iter()
                .zip(e.tensor.values())
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{recipe}: {} differs", e.id);
        }
    }
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d: f64 = a
        .values()
        .iter()
        .zip(b.values())
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt();
    let n: f64 = b.values().iter().map(|y| y * y).sum::<f64>().sqrt();
    if d == 0.0 {
        0.0
    } else {
        d / n
    }
}

#[test]
fn sharded_runs_merge_to_the_reference_within_round_off() {
    for (tp, sp, cp, dp) in [
        (2, false, 1, 1),
        (2, true, 1, 1),
        (1, false, 2, 1),
        (1, false, 1, 2),
        (2, true, 2, 2),
        (4, true, 1, 1),
    ] {
        let mesh = Mesh::megatron(tp, cp, dp, sp).unwrap();
        let (rt, merged) = run_pair("fp32", mesh.clone());
        let mut differs = 0;
        for e in rt.entries() {
            let r = rel(merged.require(&e.id).unwrap(), &e.tensor);
            assert!(r < 1e-4, "{}: {} rel {r}", mesh.label(), e.id);
            if r > 0.0 {
                differs += 1;
            }
        }
        // Sharding changes reduction orders: some tensors must differ.
        assert!(differs > 0, "{}: no tensor differs", mesh.label());
    }
}

#[test]
fn a_wrong_layout_is_an_error_not_a_silent_merge() {
    let mesh = Mesh::megatron(2, 1, 1, false).unwrap();
    let t = Tensor::from_vec(&[2, 4], (0..8).map(f64::from).collect(), Format::F32).unwrap();
    let split = Layout::replicated().with(Axis::TP, Placement::split(1));
    let shards = shard(&t, &split, &mesh, "x").unwrap();
    // Declared replicated although the shards differ.
    let err = merge(&shards, &Layout::replicated(), &mesh, "x", Some(&[2, 4])).unwrap_err();
    assert!(
        matches!(err, Error::ReplicaMismatch { rank: 1, .. }),
        "{err}"
    );
    // Split along the wrong dimension: the shape does not come back.
    let wrong = Layout::replicated().with(Axis::TP, Placement::split(0));
    let err = merge(&shards, &wrong, &mesh, "x", Some(&[2, 4])).unwrap_err();
    assert!(matches!(err, Error::Layout { .. }), "{err}");
    // Wrong number of shards.
    let err = merge(&shards[..1], &split, &mesh, "x", None).unwrap_err();
    assert!(err.to_string().contains("1 shards"), "{err}");
    // A split that does not divide.
    let odd = Tensor::from_vec(&[3], vec![1.0, 2.0, 3.0], Format::F32).unwrap();
    let l0 = Layout::replicated().with(Axis::TP, Placement::split(0));
    assert!(matches!(
        shard(&odd, &l0, &mesh, "odd").unwrap_err(),
        Error::Layout { .. }
    ));
}

#[test]
fn cp_load_balanced_order_is_inverted() {
    // Positions 0..16 on cp = 2 (chunks of 4): rank 0 holds 0-3 and 12-15, rank 1 holds 4-11.
    let mesh = Mesh::megatron(1, 2, 1, false).unwrap();
    let t = Tensor::from_vec(&[1, 16], (0..16).map(f64::from).collect(), Format::F32).unwrap();
    let l = Layout::replicated().with(Axis::CP, Placement::CpChunks { dim: 1 });
    let s = shard(&t, &l, &mesh, "pos").unwrap();
    assert_eq!(s[0].values(), &[0., 1., 2., 3., 12., 13., 14., 15.]);
    assert_eq!(s[1].values(), &[4., 5., 6., 7., 8., 9., 10., 11.]);
    assert_eq!(merge(&s, &l, &mesh, "pos", Some(&[1, 16])).unwrap(), t);
    // Merging the same shards as a contiguous split gives another order: not the identity.
    let contiguous = Layout::replicated().with(Axis::CP, Placement::split(1));
    assert_ne!(merge(&s, &contiguous, &mesh, "pos", None).unwrap(), t);
}

fn placements() -> impl Strategy<Value = Placement> {
    prop_oneof![
        Just(Placement::Replicate),
        Just(Placement::Partial),
        (0usize..3).prop_map(Placement::split),
        (0usize..3).prop_map(|dim| Placement::Split { dim, groups: 3 }),
        (0usize..3).prop_map(|dim| Placement::CpChunks { dim }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// Shard-then-merge is the identity for every layout on every mesh where it divides.
    #[test]
    fn shard_then_merge_is_the_identity(
        tp in 1usize..4, cp in 1usize..3, dp in 1usize..3,
        l in (placements(), placements(), placements()),
        seed in any::<u64>(),
    ) {
        let mesh = Mesh::megatron(tp, cp, dp, false).unwrap();
        let layout = Layout::replicated().with(Axis::DP, l.0).with(Axis::CP, l.1).with(Axis::TP, l.2);
        // Dimensions divisible by every split: 2·3·2·... = 24 per dim is enough for all.
        let shape = [24usize, 12, 36];
        let n: usize = shape.iter().product();
        let vals: Vec<f64> = (0..n).map(|i| Format::BF16.round(((i as u64).wrapping_mul(seed | 1) % 1000) as f64 / 7.0 - 50.0, ttrace::Overflow::NonSaturating)).collect();
        let t = Tensor::from_vec(&shape, vals, Format::BF16).unwrap();
        // Nested splits of one dim must still divide: skip combinations that do not.
        match shard(&t, &layout, &mesh, "t") {
            Ok(shards) => {
                let m = merge(&shards, &layout, &mesh, "t", Some(&shape)).unwrap();
                prop_assert_eq!(m, t);
            }
            Err(e) => prop_assert!(matches!(e, Error::Layout { .. }), "{}", e),
        }
    }

    /// Ring and tree all-reduce and reduce-scatter: within the summation bound of the exact
    /// sum, identical on every rank, and all-gather inverts reduce-scatter's split.
    #[test]
    fn collectives_are_correct_reductions(p in 1usize..6, vals in prop::collection::vec(-100.0f64..100.0, 1..40)) {
        let n = vals.len();
        let inputs: Vec<Tensor> = (0..p)
            .map(|r| {
                let v: Vec<f64> = vals.iter().enumerate().map(|(i, x)| Format::BF16.round(x * (1.0 + r as f64 + i as f64 / 3.0), ttrace::Overflow::NonSaturating)).collect();
                Tensor::from_vec(&[n], v, Format::BF16).unwrap()
            })
            .collect();
        for alg in [Algorithm::Ring, Algorithm::Tree] {
            let out = all_reduce(&inputs, alg, Format::BF16).unwrap();
            for i in 0..n {
                let col: Vec<f64> = inputs.iter().map(|t| t.values()[i]).collect();
                let exact = exact_sum(&col);
                let abs: f64 = col.iter().map(|x| x.abs()).sum();
                let u = Format::BF16.unit_roundoff();
                let bound = ((1.0 + u).powi(p as i32) - 1.0) * abs;
                prop_assert!((out.values()[i] - exact).abs() <= bound, "{:?} {} {}", alg, out.values()[i], exact);
            }
        }
        let padded: Vec<Tensor> = inputs.iter().map(|t| {
            let mut v = t.values().to_vec();
            v.resize(p * n, 0.0);
            Tensor::from_vec(&[p * n], v, Format::BF16).unwrap()
        }).collect();
        let rs = reduce_scatter(&padded, 0, Format::F32).unwrap();
        let gathered = all_gather(&rs, 0, "rs").unwrap();
        let ar = all_reduce(&padded, Algorithm::Ring, Format::F32).unwrap();
        // Ring all-reduce chunks coincide with reduce-scatter slices: identical results.
        prop_assert_eq!(gathered.values(), ar.values());
    }
}

mod ring {
    use ttrace::engine::{attention, attention_backward, AttentionImpl};
    use ttrace::trace::{shard, Axis, Layout, Mesh, Placement};
    use ttrace::{Format, Overflow};
    use ttrace::{Policy, Tensor};
    use ttrace_lab::shard::{ring_attention, ring_attention_backward};

    fn qkv(batch: usize, seq: usize, hidden: usize, fmt: Format) -> Tensor {
        let n = batch * seq * 3 * hidden;
        let v = ttrace::engine::normal_values("qkv", n, 0.0, 1.0, 7);
        Tensor::rounded(&[batch, seq, 3 * hidden], v, fmt, Overflow::Saturating).unwrap()
    }

    fn cp_shards(t: &Tensor, cp: usize) -> (Vec<Tensor>, Layout, Mesh) {
        let mesh = Mesh::megatron(1, cp, 1, false).unwrap();
        let layout = Layout::replicated().with(Axis::CP, Placement::CpChunks { dim: 1 });
        (shard(t, &layout, &mesh, "qkv").unwrap(), layout, mesh)
    }

    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let d: f64 = a
            .values()
            .iter()
            .zip(b.values())
            .map(|(x, y)| (x - y).powi(2))
            .sum();
        let n: f64 = b.values().iter().map(|y| y * y).sum();
        (d / n).sqrt()
    }

    #[test]
    fn one_rank_ring_forward_is_the_engines_online_attention_bit_for_bit() {
        let p = Policy::new(Format::BF16, Format::F32, Format::BF16);
        let x = qkv(2, 16, 16, Format::BF16);
        let (r, _) = attention(&x, 2, true, AttentionImpl::Online { block: 4 }, &p).unwrap();
        let (outs, _) = ring_attention(&[x], 2, 4, &p).unwrap();
        assert_eq!(outs[0], r);
    }

    #[test]
    fn ring_attention_merges_to_the_reference_forward_and_backward() {
        // In F64 the orders differ only at 1e-16; in FP32 within a few u.
        for (fmt, tol) in [(Format::F64, 1e-13), (Format::F32, 2e-6)] {
            let p = Policy::uniform(fmt);
            let x = qkv(2, 16, 16, fmt);
            let imp = AttentionImpl::Online { block: 4 };
            let (r, saved) = attention(&x, 2, true, imp, &p).unwrap();
            let dout_v = ttrace::engine::normal_values("dout", r.len(), 0.0, 1.0, 9);
            let dout = Tensor::rounded(r.shape(), dout_v, fmt, Overflow::Saturating).unwrap();
            let dref = attention_backward(&saved, &dout, &p).unwrap();
            for cp in [2, 4] {
                let (xs, layout, mesh) = cp_shards(&x, cp);
                let (outs, rs) = ring_attention(&xs, 2, 16 / (2 * cp), &p).unwrap();
                let merged =
                    ttrace::trace::merge(&outs, &layout, &mesh, "out", Some(r.shape())).unwrap();
                assert!(
                    rel(&merged, &r) < tol,
                    "{fmt} cp {cp} forward {}",
                    rel(&merged, &r)
                );
                let (ds, _, _) = cp_shards(&dout, cp);
                let g = ring_attention_backward(&rs, &ds, &p).unwrap();
                let gm =
                    ttrace::trace::merge(&g, &layout, &mesh, "dqkv", Some(dref.shape())).unwrap();
                assert!(
                    rel(&gm, &dref) < tol,
                    "{fmt} cp {cp} backward {}",
                    rel(&gm, &dref)
                );
            }
        }
    }

    #[test]
    fn ring_attention_rejects_mismatched_ranks() {
        let p = Policy::uniform(Format::F32);
        let a = qkv(1, 8, 8, Format::F32);
        let b = qkv(1, 4, 8, Format::F32);
        assert!(matches!(
            ring_attention(&[a.clone(), b], 1, 2, &p),
            Err(ttrace::Error::ShapeMismatch { .. })
        ));
        assert!(matches!(
            ring_attention(&[], 1, 2, &p),
            Err(ttrace::Error::InvalidParameter { .. })
        ));
        assert!(matches!(
            ring_attention(&[a], 1, 0, &p),
            Err(ttrace::Error::InvalidParameter { .. })
        ));
    }
}

mod validation {
    use ttrace::trace::Mesh;
    use ttrace_lab::shard::Algorithm;
    use ttrace_lab::validate::{run_config, RunConfig, SweepOptions};

    /// Zero false alarms on correct sharded runs; tensors with no differing arithmetic upstream
    /// are bit-identical; the model's typical difference tracks the observed one.
    #[test]
    fn composed_thresholds_hold_on_correct_sharded_runs() {
        let opts = SweepOptions::default_sweep(1);
        for (recipe, tp, sp, cp, dp, alg) in [
            ("bf16", 2, true, 2, 2, Algorithm::Ring),
            ("fp32", 4, false, 2, 1, Algorithm::Tree),
            ("fp8-delayed", 2, false, 1, 2, Algorithm::Ring),
            ("fp32", 1, false, 1, 2, Algorithm::Ring),
        ] {
            let run = RunConfig {
                mesh: Mesh::megatron(tp, cp, dp, sp).unwrap(),
                recipe: recipe.into(),
                seed: 77,
                algorithm: alg,
            };
            let r = run_config(&opts, &run).unwrap();
            for t in &r.tensors {
                assert!(
                    !t.false_alarm(),
                    "{recipe} {}: {} obs {} > thr {}",
                    run.mesh.label(),
                    t.id,
                    t.observed,
                    t.threshold
                );
                if t.threshold == 0.0 {
                    assert_eq!(t.observed, 0.0, "{}", t.id);
                }
            }
            assert!(r.tensors.iter().any(|t| t.observed > 0.0));
            // Embeddings are computed identically on every mesh.
            let e = r
                .tensors
                .iter()
                .find(|t| t.id == "embedding|fwd.output.0")
                .unwrap();
            assert_eq!((e.observed, e.threshold), (0.0, 0.0));
            if recipe == "fp32" {
                // FP32 differences are continuous: the model's typical size is close to the
                // observed one for large tensors.
                for t in r
                    .tensors
                    .iter()
                    .filter(|t| t.elements >= 1024 && t.observed > 0.0)
                {
                    let ratio = t.observed / t.expected;
                    assert!(
                        (0.3..2.0).contains(&ratio),
                        "{}: observed/expected {ratio}",
                        t.id
                    );
                }
            }
        }
    }

    /// With data parallelism only, every forward activation is bit-identical and only the
    /// reductions over tokens (parameter gradients, loss) may differ.
    #[test]
    fn data_parallel_changes_only_token_reductions() {
        let opts = SweepOptions::default_sweep(1);
        let run = RunConfig {
            mesh: Mesh::megatron(1, 1, 2, false).unwrap(),
            recipe: "bf16".into(),
            seed: 5,
            algorithm: Algorithm::Ring,
        };
        let r = run_config(&opts, &run).unwrap();
        for t in &r.tensors {
            if !t.id.ends_with("param_grad") && t.id != "loss|fwd.output.0" {
                assert_eq!(t.observed, 0.0, "{}", t.id);
                assert_eq!(t.threshold, 0.0, "{}", t.id);
            }
        }
    }
}

/// The validation sweep gives the same report (every run's per-tensor numbers, the tables, the
/// bug runs) on 1 and on 3 threads: runs are independent and merged in order.
#[test]
fn sweep_results_do_not_depend_on_the_thread_count() {
    use ttrace_lab::validate::{run_sweep, SweepOptions};
    let mut o = SweepOptions::default_sweep(1);
    o.runs = o
        .runs
        .iter()
        .filter(|r| r.mesh.world() <= 4)
        .take(4)
        .cloned()
        .collect();
    o.simulation.samples = 4;
    o.perturbation_samples = 1;
    o.sensitivity_mesh = None;
    let sweep = |threads: usize| {
        let mut r = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| run_sweep(&o, &|| {}).unwrap());
        r.seconds = 0.0;
        serde_json::to_string(&r).unwrap()
    };
    let (one, three) = (sweep(1), sweep(3));
    if one != three {
        let at = one
            .bytes()
            .zip(three.bytes())
            .position(|(a, b)| a != b)
            .unwrap_or(one.len().min(three.len()));
        let from = at.saturating_sub(300);
        panic!(
            "reports differ at byte {at}:\n1 thread: …{}…\n3 threads: …{}…",
            &one[from..(at + 100).min(one.len())],
            &three[from..(at + 100).min(three.len())]
        );
    }
}

/// The localizer's replays (each module of the sharded model re-run on the reference's own
/// inputs) cover every tensor a module produces; where no fresh site makes the sharded
/// arithmetic differ they equal the single-device reference bit for bit, and the fresh sites
/// do differ (the sensitivity study's localizer column rests on both).
#[test]
fn replays_cover_every_produced_tensor_and_are_exact_off_the_fresh_sites() {
    use ttrace::trace::TensorId;
    use ttrace_lab::validate::fresh_sites;
    use ttrace_lab::validate::replayed_outputs;
    let mesh = Mesh::megatron(2, 2, 2, true).unwrap();
    for recipe in ["fp32", "bf16"] {
        let r = Recipe::by_name(recipe).unwrap();
        let mut reference = Gpt::new(config(), r.clone()).unwrap();
        let before = reference.clone();
        let mut sharded = ShardedGpt::new(
            Gpt::new(config(), r).unwrap(),
            mesh.clone(),
            Algorithm::Ring,
        )
        .unwrap();
        let rt = reference.step().unwrap().trace;
        let step = sharded.step().unwrap();
        let replayed = replayed_outputs(&mut sharded, &step, &rt).unwrap();
        let sites = fresh_sites(&before, &rt, &mesh, sharded.plan(), Algorithm::Ring).unwrap();
        let (mut exact, mut fresh_differing) = (0, 0);
        for e in rt.entries() {
            if !TensorId::parse(&e.id).is_some_and(|t| t.produced()) {
                continue;
            }
            let out = replayed
                .get(&e.id)
                .unwrap_or_else(|| panic!("{recipe}: no replay of {}", e.id));
            if sites.contains_key(&e.id) {
                fresh_differing += usize::from(out != &e.tensor);
            } else {
                assert_eq!(out, &e.tensor, "{recipe}: {}", e.id);
                exact += 1;
            }
        }
        assert!(
            exact > 20 && fresh_differing > 5,
            "{exact} {fresh_differing}"
        );
    }
}
