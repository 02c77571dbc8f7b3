//! An expert's tensors under expert parallelism: held whole by one coordinate of an axis
//! (`owned` in the manifest), the other coordinates holding no entry of them.
//!
//! Oracle: the shards are cut by hand from the logical tensor (a tensor-parallel split of
//! dimension 1 within the owner's ranks, written here with index arithmetic); the merged
//! tensor must equal the original bit for bit, a check against a single-device reference must
//! pass, and the owner's shard corrupted by hand must fail and be blamed on the owner's global
//! rank. A manifest whose owned entries are not held by exactly the ranks of one coordinate,
//! or whose layout does not replicate them along the owned axis, is refused, naming why.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use ttrace::check::{check_dir_paths, PricingMode};
use ttrace::io::{safetensors, write_trace_dir, TraceDir};
use ttrace::trace::{Axis, Layout, Mesh};
use ttrace::{Error, Format, Tensor};

/// An expert's output, owned along dp.
const EXPERT: &str = "moe.experts.1|fwd.output.0";
/// A tensor every rank holds (replicated), so the trace has one of each kind.
const DENSE: &str = "moe.gate|fwd.output.0";

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-experts-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Integers in [-64, 64) (exact in F32) of shape [rows, cols].
fn logical(rows: usize, cols: usize) -> Tensor {
    let v = (0..rows * cols)
        .map(|i| ((i * 37 + 11) % 128) as f64 - 64.0)
        .collect();
    Tensor::from_vec(&[rows, cols], v, Format::F32).unwrap()
}

/// Columns `c0..c1` of a [rows, cols] tensor.
fn columns(t: &Tensor, c0: usize, c1: usize) -> Tensor {
    let (rows, cols) = (t.shape()[0], t.shape()[1]);
    let v = (0..rows)
        .flat_map(|i| (c0..c1).map(move |j| (i, j)))
        .map(|(i, j)| t.values()[i * cols + j])
        .collect();
    Tensor::from_vec(&[rows, c1 - c0], v, Format::F32).unwrap()
}

/// A dp 2 × tp 2 trace (rank = d·2 + t): `DENSE` replicated on every rank, and `EXPERT`'s
/// column halves (split along tp) on the ranks `holders` (by tp coordinate: rank r holds
/// half r % 2), declared `owned` along `owned_axis` with the layout `expert_layout`.
fn write(
    dir: &Path,
    expert: &Tensor,
    holders: &[usize],
    owned_axis: &str,
    expert_layout: serde_json::Value,
) {
    let mesh = Mesh::new([(Axis::DP, 2), (Axis::TP, 2)]).unwrap();
    let dense = logical(4, 3);
    write_trace_dir(
        dir,
        &mesh,
        None,
        &[(DENSE.into(), Layout::replicated(), vec![dense; 4])],
        &HashMap::new(),
        &HashMap::new(),
    )
    .unwrap();
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let half = expert.shape()[1] / 2;
    for &r in holders {
        let t = r % 2;
        let shard = columns(expert, t * half, (t + 1) * half);
        let file = format!("expert{r}.safetensors");
        safetensors::write(&dir.join(&file), &[(EXPERT, &shard)], &BTreeMap::new()).unwrap();
        m["tensors"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
            "id": EXPERT, "rank": r, "file": file, "dtype": "f32",
            "layout": expert_layout.clone(), "owned": owned_axis}));
    }
    std::fs::write(&path, m.to_string()).unwrap();
}

fn tp_split() -> serde_json::Value {
    serde_json::json!({"tp": {"kind": "split", "dim": 1, "groups": 1}})
}

/// The reference: one device holding both tensors whole.
fn reference(dir: &Path, expert: &Tensor) {
    write_trace_dir(
        dir,
        &Mesh::single(),
        None,
        &[
            (DENSE.into(), Layout::replicated(), vec![logical(4, 3)]),
            (EXPERT.into(), Layout::replicated(), vec![expert.clone()]),
        ],
        &HashMap::new(),
        &HashMap::new(),
    )
    .unwrap();
}

#[test]
fn an_owned_tensor_merges_over_its_owners_ranks_and_is_checked() {
    let d = temp("merge");
    let x = logical(5, 6);
    let good = d.join("good");
    // dp coordinate 1 owns the expert: ranks 2 and 3.
    write(&good, &x, &[2, 3], "dp", tp_split());
    let mut dir = TraceDir::open(&good).unwrap();
    assert_eq!(dir.logical(EXPERT).unwrap(), x);
    assert_eq!(dir.owner(EXPERT), Some((&Axis::DP, 1)));
    assert_eq!(dir.owner(DENSE), None);
    assert_eq!(dir.mesh_of(EXPERT).world(), 2);
    assert_eq!(dir.global_rank(EXPERT, 1), 3);
    let rd = d.join("ref");
    reference(&rd, &x);
    let out = check_dir_paths(&rd, &good, PricingMode::Auto, &|| {}).unwrap();
    assert_eq!(out.report.failures, 0, "{:?}", out.report);
    // The owner's second half (global rank 3) changed: a failure blamed on rank 3.
    let mut y = x.values().to_vec();
    for i in 0..5 {
        y[i * 6 + 4] *= 1.5;
    }
    let bad = d.join("bad");
    write(
        &bad,
        &Tensor::from_vec(&[5, 6], y, Format::F32).unwrap(),
        &[2, 3],
        "dp",
        tp_split(),
    );
    let out = check_dir_paths(&rd, &bad, PricingMode::Auto, &|| {}).unwrap();
    assert!(out.report.failures > 0);
    assert_eq!(out.localization.and_then(|l| l.rank), Some(3));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn owned_entries_held_otherwise_or_placed_along_their_axis_are_refused() {
    let d = temp("refused");
    let x = logical(4, 6);
    let split_dp = serde_json::json!({"dp": {"kind": "split", "dim": 0, "groups": 1},
                                      "tp": {"kind": "split", "dim": 1, "groups": 1}});
    for (k, (holders, axis, layout, why)) in [
        // Ranks 1 and 2 lie on different dp coordinates.
        (
            &[1, 2][..],
            "dp",
            tp_split(),
            "not by the ranks of one coordinate",
        ),
        // One rank of the owner's two.
        (
            &[2][..],
            "dp",
            tp_split(),
            "not by the ranks of one coordinate",
        ),
        (
            &[2, 3][..],
            "dp",
            split_dp,
            "must replicate the tensor along it",
        ),
        (&[2, 3][..], "ep", tp_split(), "does not have it"),
    ]
    .into_iter()
    .enumerate()
    {
        let c = d.join(format!("case{k}"));
        write(&c, &x, holders, axis, layout);
        match TraceDir::open(&c) {
            Err(Error::File { reason, .. }) => assert!(reason.contains(why), "{why}: {reason}"),
            other => panic!("{why}: {other:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A dp 2 trace (no tp): `DENSE` replicated, and each `(id, tensor, owner)` held whole by its
/// owner's one rank, owned along dp, in the order given (execution order).
fn write_dp(dir: &Path, experts: &[(&str, Tensor, usize)]) {
    let mesh = Mesh::new([(Axis::DP, 2)]).unwrap();
    let dense = (
        DENSE.to_string(),
        Layout::replicated(),
        vec![logical(4, 3); 2],
    );
    write_trace_dir(dir, &mesh, None, &[dense], &HashMap::new(), &HashMap::new()).unwrap();
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (k, (id, t, owner)) in experts.iter().enumerate() {
        let file = format!("expert{k}.safetensors");
        safetensors::write(&dir.join(&file), &[(id, t)], &BTreeMap::new()).unwrap();
        m["tensors"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
            "id": id, "rank": owner, "file": file, "dtype": "f32", "layout": {},
            "owned": "dp"}));
    }
    std::fs::write(&path, m.to_string()).unwrap();
}

#[test]
fn a_failing_tensor_an_expert_computes_names_its_owner_unless_other_owners_fail_too() {
    let d = temp("owner");
    let ids = [
        "moe.experts.0|fwd.input.0",
        "moe.experts.1|fwd.input.0",
        "moe.experts.0|fwd.output.0",
        "moe.experts.1|fwd.output.0",
    ];
    let x = logical(5, 6);
    let scaled = Tensor::from_vec(
        &[5, 6],
        x.values().iter().map(|v| v * 1.5).collect(),
        Format::F32,
    )
    .unwrap();
    let rd = d.join("ref");
    let mut whole = vec![(DENSE.to_string(), Layout::replicated(), vec![logical(4, 3)])];
    whole.extend(
        ids.iter()
            .map(|i| (i.to_string(), Layout::replicated(), vec![x.clone()])),
    );
    write_trace_dir(
        &rd,
        &Mesh::single(),
        None,
        &whole,
        &HashMap::new(),
        &HashMap::new(),
    )
    .unwrap();
    // Expert e on rank e; `bad` lists the ids changed (scaled by 1.5).
    for (k, (bad, first, rank)) in [
        // Rank 1's expert computes a wrong output, rank 0's a right one: rank 1.
        (&[ids[3]][..], ids[3], Some(1)),
        // Both experts' outputs wrong: every rank's experts, no rank.
        (&[ids[2], ids[3]][..], ids[2], None),
        // An expert's input gathers every rank's tokens: no rank.
        (&[ids[1]][..], ids[1], None),
    ]
    .into_iter()
    .enumerate()
    {
        let c = d.join(format!("case{k}"));
        let held: Vec<(&str, Tensor, usize)> = ids
            .iter()
            .enumerate()
            .map(|(j, i)| {
                let t = if bad.contains(i) { &scaled } else { &x };
                (*i, t.clone(), j % 2)
            })
            .collect();
        write_dp(&c, &held);
        let out = check_dir_paths(&rd, &c, PricingMode::Auto, &|| {}).unwrap();
        let loc = out.localization.expect("a failure");
        assert_eq!((loc.tensor.as_str(), loc.rank), (first, rank), "case {k}");
    }
    let _ = std::fs::remove_dir_all(&d);
}
