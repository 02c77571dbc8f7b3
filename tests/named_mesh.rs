//! Traces on meshes of named axes (trace format version 2), and version 1 still read.
//!
//! Oracle: every shard is cut by hand from the logical tensor with index arithmetic written
//! here (row-major rank coordinates over the mesh's axes, outermost first; a contiguous split
//! takes block i of n; a partial sum hands out integer addends, so the exact sum is the
//! tensor) — never with `ttrace::trace::shard`. The merged logical tensor must equal the
//! original bit for bit; a check against a single-device reference must pass, and a shard
//! corrupted by hand must fail and be blamed on its rank.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ttrace::check::{check_dir_paths, PricingMode};
use ttrace::io::{write_trace_dir, TraceDir};
use ttrace::trace::{Axis, Layout, Mesh, Placement};
use ttrace::{Error, Format, Tensor};

const ID: &str = "m|fwd.output.0";

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-named-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn axis(name: &str) -> Axis {
    Axis::new(name).unwrap()
}

/// Integers in [-64, 64): every sum of them is exact in F32.
fn logical(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n)
        .map(|i| ((i * 37 + 11) % 128) as f64 - 64.0)
        .collect();
    Tensor::from_vec(shape, v, Format::F32).unwrap()
}

/// Row-major coordinates of `rank` over `sizes`, outermost first (written here, not taken
/// from the library).
fn coords(rank: usize, sizes: &[usize]) -> Vec<usize> {
    let mut c = vec![0; sizes.len()];
    let mut r = rank;
    for k in (0..sizes.len()).rev() {
        c[k] = r % sizes[k];
        r /= sizes[k];
    }
    c
}

/// The elements of `t` (shape [a, b, c]) with index ranges per dimension.
fn block(t: &Tensor, ranges: [std::ops::Range<usize>; 3]) -> Tensor {
    let s = t.shape();
    let mut v = vec![];
    for i in ranges[0].clone() {
        for j in ranges[1].clone() {
            for k in ranges[2].clone() {
                v.push(t.values()[(i * s[1] + j) * s[2] + k]);
            }
        }
    }
    let shape = [ranges[0].len(), ranges[1].len(), ranges[2].len()];
    Tensor::from_vec(&shape, v, Format::F32).unwrap()
}

/// The mesh `[dp_replicate 2, dp_shard 3, tp 2]` (12 ranks) and the shards of `x` (shape
/// [6, 12, 4]) with dim 0 split over dp_shard, dim 1 split over tp, replicated over
/// dp_replicate — cut by hand.
fn fsdp_tp(x: &Tensor) -> (Mesh, Layout, Vec<Tensor>) {
    let mesh = Mesh::new([
        (axis("dp_replicate"), 2),
        (axis("dp_shard"), 3),
        (Axis::TP, 2),
    ])
    .unwrap();
    let layout = Layout::replicated()
        .with(axis("dp_shard"), Placement::split(0))
        .with(Axis::TP, Placement::split(1));
    let shards = (0..12)
        .map(|r| {
            let c = coords(r, &[2, 3, 2]);
            block(x, [2 * c[1]..2 * c[1] + 2, 6 * c[2]..6 * c[2] + 6, 0..4])
        })
        .collect();
    (mesh, layout, shards)
}

fn write(dir: &Path, mesh: &Mesh, layout: Layout, shards: Vec<Tensor>) {
    let none = HashMap::new();
    write_trace_dir(
        dir,
        mesh,
        None,
        &[(ID.into(), layout, shards)],
        &HashMap::new(),
        &none,
    )
    .unwrap();
}

#[test]
fn shards_cut_by_hand_on_named_axes_merge_to_the_tensor() {
    let d = temp("merge");
    let x = logical(&[6, 12, 4]);
    let (mesh, layout, shards) = fsdp_tp(&x);
    write(&d, &mesh, layout.clone(), shards.clone());
    // The library's own cut agrees with the hand-cut shards.
    assert_eq!(
        ttrace::trace::shard(&x, &layout, &mesh, ID).unwrap(),
        shards
    );
    let mut dir = TraceDir::open(&d).unwrap();
    assert_eq!(dir.manifest().version, 2);
    assert_eq!(dir.manifest().mesh, mesh);
    assert_eq!(dir.logical(ID).unwrap(), x);
    // The manifest names the axes, and every entry places the tensor along each of them.
    let text = std::fs::read_to_string(d.join("manifest.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["version"], 2);
    assert_eq!(
        v["mesh"]["axes"][1],
        serde_json::json!({"name": "dp_shard", "size": 3})
    );
    let placed: Vec<&String> = v["tensors"][0]["layout"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(placed.len(), 3, "{placed:?}");

    // A partial sum over an axis that is not innermost, with the tensor split inside it:
    // mesh [tp 2, ep 3] (tp outermost), partial over tp, dim 2 split over ep.
    let mesh = Mesh::new([(Axis::TP, 2), (Axis::EP, 3)]).unwrap();
    let x = logical(&[2, 3, 6]);
    let layout = Layout::replicated()
        .with(Axis::TP, Placement::Partial)
        .with(Axis::EP, Placement::split(2));
    let shards: Vec<Tensor> = (0..6)
        .map(|r| {
            let c = coords(r, &[2, 3]);
            let part = block(&x, [0..2, 0..3, 2 * c[1]..2 * c[1] + 2]);
            // tp rank 0 holds x − 5, tp rank 1 holds 5: integers, summed exactly.
            let v = part
                .values()
                .iter()
                .map(|&y| if c[0] == 0 { y - 5.0 } else { 5.0 })
                .collect();
            Tensor::from_vec(part.shape(), v, Format::F32).unwrap()
        })
        .collect();
    let d2 = d.join("partial");
    write(&d2, &mesh, layout, shards);
    assert_eq!(TraceDir::open(&d2).unwrap().logical(ID).unwrap(), x);
    let _ = std::fs::remove_dir_all(&d);
}

/// Partial sums merge to their exact sum rounded once to the format. Oracle: sums worked by
/// hand. 1 + 2⁻⁸ + 2⁻¹⁰⁰ lies just above BF16's tie between 1 and 1 + 2⁻⁷, so it rounds up;
/// its nearest `f64` is the tie itself, which would round to the even 1 (the sum is not exact
/// in `f64`, so the merge must not round it there first). The other elements: sums exact in
/// `f64` (2 + 2⁻⁷ + 0 = 2 + 2⁻⁷, not a BF16 value: a tie rounding to even 2), an overflow
/// (BF16's largest value twice: +∞), and cancellation (to +0).
#[test]
fn partial_sums_merge_to_the_exact_sum_rounded_once() {
    let d = temp("partial-rounding");
    let p = |e: i32| 2f64.powi(e);
    let max = Format::BF16.max_finite();
    let terms = [
        [1.0, p(-8), p(-100)],
        [2.0, p(-7), 0.0],
        [max, max, 0.0],
        [3.0, -3.0, 0.0],
    ];
    let want = [1.0 + p(-7), 2.0, f64::INFINITY, 0.0];
    let mesh = Mesh::new([(Axis::TP, 3)]).unwrap();
    let shards: Vec<Tensor> = (0..3)
        .map(|r| {
            Tensor::from_vec(&[4], terms.iter().map(|t| t[r]).collect(), Format::BF16).unwrap()
        })
        .collect();
    write(
        &d,
        &mesh,
        Layout::replicated().with(Axis::TP, Placement::Partial),
        shards,
    );
    let merged = TraceDir::open(&d).unwrap().logical(ID).unwrap();
    let bits: Vec<u64> = merged.values().iter().map(|x| x.to_bits()).collect();
    let want: Vec<u64> = want.iter().map(|x| x.to_bits()).collect();
    assert_eq!(bits, want, "{:?}", merged.values());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_check_on_named_axes_passes_when_equal_and_blames_the_corrupted_rank() {
    let d = temp("check");
    let x = logical(&[6, 12, 4]);
    let (rd, none) = (d.join("r"), HashMap::new());
    write_trace_dir(
        &rd,
        &Mesh::single(),
        None,
        &[(ID.into(), Layout::replicated(), vec![x.clone()])],
        &HashMap::new(),
        &none,
    )
    .unwrap();
    let (mesh, layout, shards) = fsdp_tp(&x);
    let good = d.join("good");
    write(&good, &mesh, layout.clone(), shards.clone());
    let out = check_dir_paths(&rd, &good, PricingMode::Auto, &|| {}).unwrap();
    assert_eq!(out.report.failures, 0, "{:?}", out.report);
    // Rank 3 = (dp_replicate 0, dp_shard 1, tp 1) and its copy along dp_replicate, rank 9 =
    // (1, 1, 1), corrupted alike: the tensor changes in rank 3's block.
    let mut bad = shards.clone();
    for r in [3, 9] {
        let v = bad[r].values().iter().map(|y| y * 1.5).collect();
        bad[r] = Tensor::from_vec(bad[r].shape(), v, Format::F32).unwrap();
    }
    let cd = d.join("bad");
    write(&cd, &mesh, layout.clone(), bad);
    let out = check_dir_paths(&rd, &cd, PricingMode::Auto, &|| {}).unwrap();
    assert!(out.report.failures > 0);
    assert_eq!(out.localization.and_then(|l| l.rank), Some(3));
    // One copy alone corrupted: the replicas along dp_replicate disagree, named by axis.
    let mut one = shards;
    let v = one[9].values().iter().map(|y| y + 1.0).collect();
    one[9] = Tensor::from_vec(one[9].shape(), v, Format::F32).unwrap();
    let cd = d.join("replica");
    write(&cd, &mesh, layout, one);
    match TraceDir::open(&cd).unwrap().logical(ID) {
        Err(Error::ReplicaMismatch { axis, rank, .. }) => {
            assert_eq!((axis.as_str(), rank), ("dp_replicate", 9))
        }
        other => panic!("{other:?}"),
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// The same shards described by a version-1 manifest (Megatron's `tp`, `cp`, `dp` mesh) and by
/// a version-2 one (the axes named, one layout leaving its replicated axes out) read alike.
#[test]
fn version_1_and_version_2_manifests_of_one_trace_read_alike() {
    let d = temp("versions");
    let x = logical(&[4, 6, 2]);
    // dp 2 (outer) × tp 2: dim 0 split over dp, dim 1 over tp; rank = d·2 + t.
    let shards: Vec<Tensor> = (0..4)
        .map(|r| {
            let (dd, t) = (r / 2, r % 2);
            block(&x, [2 * dd..2 * dd + 2, 3 * t..3 * t + 3, 0..2])
        })
        .collect();
    let mesh = Mesh::megatron(2, 1, 2, false).unwrap();
    let layout = Layout::replicated()
        .with(Axis::DP, Placement::split(0))
        .with(Axis::TP, Placement::split(1));
    write(&d, &mesh, layout, shards);
    let path = d.join("manifest.json");
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // Megatron's mesh keeps version 1's short form inside version 2.
    assert_eq!(
        written["mesh"],
        serde_json::json!({"tp": 2, "cp": 1, "dp": 2, "sp": false})
    );
    let split = |dim| serde_json::json!({"kind": "split", "dim": dim, "groups": 1});
    let rep = serde_json::json!({"kind": "replicate"});
    let entries = |v2: bool| -> Vec<serde_json::Value> {
        (0..4)
            .map(|r| {
                let layout = if v2 {
                    serde_json::json!({"tp": split(1), "dp": split(0)})
                } else {
                    serde_json::json!({"dp": split(0), "cp": rep, "tp": split(1)})
                };
                serde_json::json!({"id": ID, "rank": r, "file": format!("rank{r}.safetensors"),
                    "dtype": "f32", "layout": layout})
            })
            .collect()
    };
    let v1 = serde_json::json!({"format": "ttrace-trace", "version": 1,
        "mesh": {"tp": 2, "cp": 1, "dp": 2, "sp": false}, "tensors": entries(false)});
    let v2 = serde_json::json!({"format": "ttrace-trace", "version": 2,
        "mesh": {"axes": [{"name": "dp", "size": 2}, {"name": "cp", "size": 1},
                          {"name": "tp", "size": 2}]},
        "tensors": entries(true)});
    for m in [v1, v2] {
        std::fs::write(&path, m.to_string()).unwrap();
        let mut dir = TraceDir::open(&d).unwrap();
        assert_eq!(dir.manifest().mesh, mesh);
        assert_eq!(dir.logical(ID).unwrap(), x, "version {}", m["version"]);
    }
    // Refused: a placement along an axis the mesh lacks, a guessed axis it lacks, a mesh
    // in both forms, version 3.
    let bad = [
        serde_json::json!({"format": "ttrace-trace", "version": 2,
            "mesh": {"tp": 2, "cp": 1, "dp": 2}, "tensors": [{"id": ID, "rank": 0,
            "file": "rank0.safetensors", "dtype": "f32", "layout": {"pp": split(0)}}]}),
        serde_json::json!({"format": "ttrace-trace", "version": 2,
            "mesh": {"tp": 2, "cp": 1, "dp": 2}, "tensors": [{"id": ID, "rank": 0,
            "file": "rank0.safetensors", "dtype": "f32", "layout": {}, "guessed": ["ep"]}]}),
        serde_json::json!({"format": "ttrace-trace", "version": 2,
            "mesh": {"tp": 2, "cp": 1, "dp": 2, "axes": []}, "tensors": []}),
        serde_json::json!({"format": "ttrace-trace", "version": 3,
            "mesh": {"tp": 2, "cp": 1, "dp": 2}, "tensors": []}),
    ];
    for m in bad {
        std::fs::write(&path, m.to_string()).unwrap();
        assert!(matches!(TraceDir::open(&d), Err(Error::File { .. })), "{m}");
    }
    let _ = std::fs::remove_dir_all(&d);
}
