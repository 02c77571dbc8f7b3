//! Sharded simulation: layouts, collectives, and the sharded GPT against the reference.

use proptest::prelude::*;
use ttrace::engine::{AttentionImpl, Gpt, GptConfig, Recipe, Tensor};
use ttrace::shard::{
    all_gather, all_reduce, merge, reduce_scatter, shard, Algorithm, Layout, Mesh, Placement,
    ShardedGpt,
};
use ttrace::{exact_sum, Error, Format};

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

fn run_pair(recipe: &str, mesh: Mesh) -> (ttrace::engine::Trace, ttrace::engine::Trace) {
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
        let mesh = Mesh::new(tp, cp, dp, sp).unwrap();
        let (rt, merged) = run_pair("fp32", mesh);
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
    let mesh = Mesh::new(2, 1, 1, false).unwrap();
    let t = Tensor::from_vec(&[2, 4], (0..8).map(f64::from).collect(), Format::F32).unwrap();
    let split = Layout {
        tp: Placement::split(1),
        ..Layout::replicated()
    };
    let shards = shard(&t, &split, &mesh, "x").unwrap();
    // Declared replicated although the shards differ.
    let err = merge(&shards, &Layout::replicated(), &mesh, "x", Some(&[2, 4])).unwrap_err();
    assert!(
        matches!(err, Error::ReplicaMismatch { rank: 1, .. }),
        "{err}"
    );
    // Split along the wrong dimension: the shape does not come back.
    let wrong = Layout {
        tp: Placement::split(0),
        ..Layout::replicated()
    };
    let err = merge(&shards, &wrong, &mesh, "x", Some(&[2, 4])).unwrap_err();
    assert!(matches!(err, Error::Layout { .. }), "{err}");
    // Wrong number of shards.
    let err = merge(&shards[..1], &split, &mesh, "x", None).unwrap_err();
    assert!(err.to_string().contains("1 shards"), "{err}");
    // A split that does not divide.
    let odd = Tensor::from_vec(&[3], vec![1.0, 2.0, 3.0], Format::F32).unwrap();
    let l0 = Layout {
        tp: Placement::split(0),
        ..Layout::replicated()
    };
    assert!(matches!(
        shard(&odd, &l0, &mesh, "odd").unwrap_err(),
        Error::Layout { .. }
    ));
}

#[test]
fn cp_load_balanced_order_is_inverted() {
    // Positions 0..16 on cp = 2 (chunks of 4): rank 0 holds 0-3 and 12-15, rank 1 holds 4-11.
    let mesh = Mesh::new(1, 2, 1, false).unwrap();
    let t = Tensor::from_vec(&[1, 16], (0..16).map(f64::from).collect(), Format::F32).unwrap();
    let l = Layout {
        cp: Placement::CpChunks { dim: 1 },
        ..Layout::replicated()
    };
    let s = shard(&t, &l, &mesh, "pos").unwrap();
    assert_eq!(s[0].values(), &[0., 1., 2., 3., 12., 13., 14., 15.]);
    assert_eq!(s[1].values(), &[4., 5., 6., 7., 8., 9., 10., 11.]);
    assert_eq!(merge(&s, &l, &mesh, "pos", Some(&[1, 16])).unwrap(), t);
    // Merging the same shards as a contiguous split gives another order: not the identity.
    let contiguous = Layout {
        cp: Placement::split(1),
        ..Layout::replicated()
    };
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
        let mesh = Mesh::new(tp, cp, dp, false).unwrap();
        let layout = Layout { dp: l.0, cp: l.1, tp: l.2 };
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
