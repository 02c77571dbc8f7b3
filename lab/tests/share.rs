//! A directory check shared among checker ranks (`check_share` on each, `combine_shares` of
//! all) gives the single-machine check's report, whatever the number of ranks.
//!
//! Oracle: the sequential `check_dirs` of the same files (one reader, one thread, no
//! sharing), compared field by field and as JSON; the assignment is checked against the
//! tensors' byte sizes read from the files' headers here.

mod common;

use std::path::{Path, PathBuf};

use ttrace::check::{check_dirs, check_share, combine_shares, share_owners, DirCheck, PricingMode};
use ttrace::io::TraceDir;
use ttrace::trace::Mesh;
use ttrace::Error;
use ttrace_lab::bugs::Bug;

fn dumped(name: &str, mesh: Mesh, bug: Option<Bug>) -> PathBuf {
    common::dumped("share", name, mesh, bug)
}

fn open(d: &Path) -> (TraceDir, TraceDir) {
    (
        TraceDir::open(&d.join("reference")).unwrap(),
        TraceDir::open(&d.join("candidate")).unwrap(),
    )
}

fn shared(r: &TraceDir, c: &TraceDir, ranks: usize, mode: PricingMode) -> DirCheck {
    let shares: Vec<Vec<u8>> = (0..ranks)
        .map(|k| check_share(r, c, k, ranks, &|| {}).unwrap())
        .collect();
    combine_shares(r, c, mode, &shares).unwrap()
}

#[test]
fn shared_checks_equal_the_single_machine_check() {
    for (name, mesh, bug) in [
        ("clean", Mesh::megatron(2, 1, 2, true).unwrap(), None),
        (
            "lse",
            Mesh::megatron(2, 2, 1, true).unwrap(),
            Some(Bug::CpWrongLseCorrection),
        ),
        (
            "allreduce",
            Mesh::megatron(4, 1, 1, false).unwrap(),
            Some(Bug::RowBiasOnEveryRank),
        ),
    ] {
        let d = dumped(name, mesh, bug);
        let (mut r, mut c) = open(&d);
        for mode in [PricingMode::Auto, PricingMode::Local] {
            let single = check_dirs(&mut r, &mut c, mode, &|| {}).unwrap();
            assert_eq!(single.report.passed(), bug.is_none(), "{name}");
            for ranks in [1, 2, 3, 4, 8] {
                let combined = shared(&r, &c, ranks, mode);
                assert_eq!(combined, single, "{name}, {ranks} ranks, {mode:?}");
                assert_eq!(
                    serde_json::to_string(&combined).unwrap(),
                    serde_json::to_string(&single).unwrap()
                );
            }
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}

/// Bytes per id from the files' headers (safetensors: 8-byte little-endian header length,
/// then JSON with `data_offsets`), summed over every shard: read here, not from the library.
fn bytes_by_id(dir: &Path) -> std::collections::HashMap<String, u64> {
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let mut out = std::collections::HashMap::new();
    for e in manifest["tensors"].as_array().unwrap() {
        let file = std::fs::read(dir.join(e["file"].as_str().unwrap())).unwrap();
        let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&file[8..8 + n]).unwrap();
        let off = &header[e["key"].as_str().unwrap()]["data_offsets"];
        let len = off[1].as_u64().unwrap() - off[0].as_u64().unwrap();
        *out.entry(e["id"].as_str().unwrap().to_string())
            .or_insert(0) += len;
    }
    out
}

#[test]
fn ranks_are_balanced_by_bytes() {
    let d = dumped("balance", Mesh::megatron(2, 1, 2, true).unwrap(), None);
    let (r, c) = open(&d);
    let (rb, cb) = (
        bytes_by_id(&d.join("reference")),
        bytes_by_id(&d.join("candidate")),
    );
    let ids = r.ids().to_vec();
    let size: Vec<u64> = ids.iter().map(|id| rb[id] + cb[id]).collect();
    let largest = *size.iter().max().unwrap();
    for ranks in [1, 2, 3, 5, 8] {
        let owners = share_owners(&r, &c, ranks).unwrap();
        assert_eq!(owners.len(), ids.len());
        let mut load = vec![0u64; ranks];
        for (k, &o) in owners.iter().enumerate() {
            load[o] += size[k];
        }
        // Greedy largest-first: no rank exceeds the mean by more than the largest tensor.
        let mean = size.iter().sum::<u64>() as f64 / ranks as f64;
        for (o, l) in load.iter().enumerate() {
            assert!(
                (*l as f64) <= mean + largest as f64,
                "{ranks} ranks: rank {o} reads {l} bytes, mean {mean}, largest {largest}"
            );
        }
        // The same on every call (every checker rank computes it alone).
        assert_eq!(share_owners(&r, &c, ranks).unwrap(), owners);
    }
    std::fs::remove_dir_all(&d).unwrap();
}

fn invalid(r: Result<DirCheck, Error>, needle: &str) {
    match r {
        Err(Error::InvalidParameter {
            name: "shares",
            reason,
        }) => {
            assert!(reason.contains(needle), "{reason:?} lacks {needle:?}")
        }
        other => panic!("expected InvalidParameter(shares) with {needle:?}, got {other:?}"),
    }
}

#[test]
fn shares_that_do_not_fit_together_are_refused() {
    let d = dumped("refuse", Mesh::megatron(2, 1, 2, true).unwrap(), None);
    let (r, c) = open(&d);
    let mode = PricingMode::Auto;
    let three: Vec<Vec<u8>> = (0..3)
        .map(|k| check_share(&r, &c, k, 3, &|| {}).unwrap())
        .collect();
    // A share missing: the combination is for two ranks, the shares say three.
    invalid(combine_shares(&r, &c, mode, &three[..2]), "rank 0 of 3");
    // Out of rank order.
    let swapped = vec![three[1].clone(), three[0].clone(), three[2].clone()];
    invalid(
        combine_shares(&r, &c, mode, &swapped),
        "comes from checker rank 1",
    );
    // Not a share at all, and a truncated one.
    let mut garbage = three.clone();
    garbage[1] = b"not a share".to_vec();
    invalid(combine_shares(&r, &c, mode, &garbage), "share 1 is not");
    let mut cut = three.clone();
    let half = cut[2].len() / 2;
    cut[2].truncate(half);
    invalid(combine_shares(&r, &c, mode, &cut), "share 2 is not");
    // Shares of other traces (the candidate checked against itself as a stand-in for another
    // pair is refused by the plan; here the other pair is the same run with another mesh).
    let other = dumped("refuse-other", Mesh::megatron(1, 1, 2, true).unwrap(), None);
    let (r2, c2) = open(&other);
    let foreign: Vec<Vec<u8>> = (0..3)
        .map(|k| check_share(&r2, &c2, k, 3, &|| {}).unwrap())
        .collect();
    let mut mixed = three.clone();
    mixed[1] = foreign[1].clone();
    invalid(combine_shares(&r, &c, mode, &mixed), "read other traces");
    // A rank outside the split, and zero ranks.
    assert!(matches!(
        check_share(&r, &c, 3, 3, &|| {}),
        Err(Error::InvalidParameter { name: "rank", .. })
    ));
    assert!(matches!(
        combine_shares::<Vec<u8>>(&r, &c, mode, &[]),
        Err(Error::InvalidParameter { name: "ranks", .. })
    ));
    std::fs::remove_dir_all(&d).unwrap();
    std::fs::remove_dir_all(&other).unwrap();
}

#[test]
fn ids_stored_in_the_same_places_go_to_one_rank_and_count_once() {
    let d = dumped("aliases", Mesh::megatron(2, 1, 1, false).unwrap(), None);
    // Every id stored a second time under another name, in the same places (what the tracer
    // does for a tensor handed on between modules), in both runs.
    for side in ["reference", "candidate"] {
        let dir = d.join(side);
        let (mut m, _) = ttrace::io::read_manifest(&dir).unwrap();
        let copies: Vec<_> = m
            .tensors
            .iter()
            .map(|e| {
                let mut c = e.clone();
                c.id = format!("{}#again", e.id);
                c
            })
            .collect();
        m.tensors.extend(copies);
        ttrace::io::write_manifest(&dir.join("manifest.json"), &m).unwrap();
    }
    let (mut r, mut c) = open(&d);
    let ids = r.ids().to_vec();
    let size = bytes_by_id(&d.join("reference"));
    let csize = bytes_by_id(&d.join("candidate"));
    for ranks in [2, 3, 4] {
        let owners = share_owners(&r, &c, ranks).unwrap();
        let at = |id: &str| owners[ids.iter().position(|x| x == id).unwrap()];
        let mut load = vec![0u64; ranks];
        for (k, id) in ids.iter().enumerate() {
            if let Some(first) = id.strip_suffix("#again") {
                assert_eq!(at(first), owners[k], "{id}, {ranks} ranks");
            } else {
                load[owners[k]] += size[id] + csize[id];
            }
        }
        // Counted once: balanced over the distinct tensors.
        let distinct: Vec<u64> = ids
            .iter()
            .filter(|id| !id.ends_with("#again"))
            .map(|id| size[id] + csize[id])
            .collect();
        let mean = distinct.iter().sum::<u64>() as f64 / ranks as f64;
        let largest = *distinct.iter().max().unwrap() as f64;
        assert!(load.iter().all(|&l| l as f64 <= mean + largest), "{load:?}");
        let single = check_dirs(&mut r, &mut c, PricingMode::Auto, &|| {}).unwrap();
        assert_eq!(
            shared(&r, &c, ranks, PricingMode::Auto),
            single,
            "{ranks} ranks"
        );
    }
    std::fs::remove_dir_all(&d).unwrap();
}
