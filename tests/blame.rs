//! A failing tensor whose difference lies in one rank's shard names that rank. Oracle: the
//! candidate's shards are cut from the reference (`ttrace::trace::shard`) and one chosen
//! shard is corrupted by hand.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ttrace::check::{check_dir_paths, PricingMode};
use ttrace::io::write_trace_dir;
use ttrace::trace::{Axis, Layout, Mesh, Placement};
use ttrace::{Format, Tensor};

const ID: &str = "m|fwd.output.0";

fn reference() -> Tensor {
    let mut g = ttrace::engine::SplitMix64::for_name("blame", 7);
    let v = (0..8 * 16)
        .map(|_| Format::F32.round(2.0 * g.uniform() - 1.0, ttrace::Overflow::Saturating))
        .collect();
    Tensor::from_vec(&[8, 16], v, Format::F32).unwrap()
}

/// Check a candidate on `mesh` (the tensor split along dim 1 over tp, replicated elsewhere)
/// whose shards on the ranks in `bad` are scaled by `factor`; returns the localization's
/// rank and whether the check failed.
fn check(dir: &Path, mesh: &Mesh, bad: &[usize], factor: f64) -> (Option<usize>, bool) {
    let x = reference();
    let layout = Layout::replicated().with(Axis::TP, Placement::split(1));
    let mut shards = ttrace::trace::shard(&x, &layout, mesh, ID).unwrap();
    for &r in bad {
        let v = shards[r]
            .values()
            .iter()
            .map(|v| Format::F32.round(v * factor, ttrace::Overflow::Saturating))
            .collect();
        shards[r] = Tensor::from_vec(shards[r].shape(), v, Format::F32).unwrap();
    }
    let (rd, cd): (PathBuf, PathBuf) = (dir.join("r"), dir.join("c"));
    let none = HashMap::new();
    write_trace_dir(
        &rd,
        &Mesh::single(),
        None,
        &[(ID.into(), Layout::replicated(), vec![x])],
        &HashMap::new(),
        &none,
    )
    .unwrap();
    write_trace_dir(
        &cd,
        mesh,
        None,
        &[(ID.into(), layout, shards)],
        &HashMap::new(),
        &none,
    )
    .unwrap();
    let out = check_dir_paths(&rd, &cd, PricingMode::Auto, &|| {}).unwrap();
    let failed = out.report.failures > 0;
    (out.localization.and_then(|l| l.rank), failed)
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-blame-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_difference_in_one_shard_names_its_rank() {
    let d = temp("one");
    let tp4 = Mesh::megatron(4, 1, 1, false).unwrap();
    for bad in 0..4 {
        assert_eq!(
            check(&d, &tp4, &[bad], 1.25),
            (Some(bad), true),
            "rank {bad}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_shard_replicated_over_dp_names_the_lowest_rank_holding_it() {
    // tp 2 × dp 2: global rank = dp·2 + tp. The tp-1 shard is held by ranks 1 and 3.
    let d = temp("dp");
    let mesh = Mesh::megatron(2, 1, 2, false).unwrap();
    assert_eq!(check(&d, &mesh, &[1, 3], 1.25), (Some(1), true));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_difference_over_every_shard_names_none() {
    let d = temp("all");
    let tp2 = Mesh::megatron(2, 1, 1, false).unwrap();
    assert_eq!(check(&d, &tp2, &[0, 1], 1.25), (None, true));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn unreduced_parameter_gradients_say_when_they_must_be_read() {
    // A parameter gradient replicated over tp whose rank-1 copy is its own partial (read
    // before Megatron's finalize_model_grads all-reduced it): the replicas differ, the rank is
    // named, and the message gives the other cause than a missing reduction. An activation
    // that differs the same way gets the plain message.
    let d = temp("param");
    let tp2 = Mesh::megatron(2, 1, 1, false).unwrap();
    let x = reference();
    let half = Tensor::from_vec(
        x.shape(),
        x.values().iter().map(|v| v * 0.5).collect(),
        Format::F32,
    )
    .unwrap();
    let none = HashMap::new();
    for (id, said) in [("m.weight|param_grad", true), (ID, false)] {
        let (rd, cd) = (d.join(format!("r{said}")), d.join(format!("c{said}")));
        let whole = [(id.to_string(), Layout::replicated(), vec![x.clone()])];
        write_trace_dir(&rd, &Mesh::single(), None, &whole, &HashMap::new(), &none).unwrap();
        let shards = vec![x.clone(), half.clone()];
        let part = [(id.to_string(), Layout::replicated(), shards)];
        write_trace_dir(&cd, &tp2, None, &part, &HashMap::new(), &none).unwrap();
        let out = check_dir_paths(&rd, &cd, PricingMode::Auto, &|| {}).unwrap();
        let loc = out.localization.expect("fails");
        assert_eq!(loc.rank, Some(1));
        assert!(
            loc.detail.contains("rank 1's copy differs"),
            "{}",
            loc.detail
        );
        assert_eq!(
            loc.detail.contains("finalize_model_grads"),
            said,
            "{}",
            loc.detail
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}
