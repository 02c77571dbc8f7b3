//! A traced step checked online, never written: every process holds its own rank's shards in
//! memory, the processes fetch for all what the check's set-up reads, each receives the
//! tensors it is assigned, and the shares combine into the report of the written step.
//!
//! Oracle: the single-machine `check_dirs` of the same step written to disk (files read by
//! the directory reader), compared as values and as JSON. The processes are simulated here,
//! each with its own in-memory trace; the exchange is what `ttrace.tracer.online` does over
//! torch.distributed.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ttrace::check::{
    check_dirs, check_share, combine_shares, setup_needs, share_owners, PricingMode,
};
use ttrace::io::safetensors::SafetensorsFile;
use ttrace::io::{read_manifest, write_manifest, DpLoss, Manifest, TraceDir};
use ttrace::trace::{Axis, Mesh, Placement};
use ttrace::Error;
use ttrace_lab::bugs::Bug;

fn dumped(name: &str, mesh: Mesh, bug: Option<Bug>) -> PathBuf {
    common::dumped("online", name, mesh, bug)
}

/// A safetensors file's bytes split as the online check holds them: the header, and each
/// tensor's bytes by name (read here from the file's own header, independently of the
/// library's reader).
fn split_file(path: &Path) -> (Vec<u8>, BTreeMap<String, Arc<Vec<u8>>>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut tensors = BTreeMap::new();
    for (name, v) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let o = v["data_offsets"].as_array().unwrap();
        let (b, e) = (
            o[0].as_u64().unwrap() as usize,
            o[1].as_u64().unwrap() as usize,
        );
        tensors.insert(name.clone(), Arc::new(bytes[8 + n + b..8 + n + e].to_vec()));
    }
    (bytes[..8 + n].to_vec(), tensors)
}

/// One simulated process: the (file, key) pairs it holds.
type Holding = BTreeSet<(String, String)>;

fn in_memory(dir: &Path, manifest: &Manifest, holding: &Holding) -> TraceDir {
    let mut files = HashMap::new();
    let names: BTreeSet<&String> = manifest.tensors.iter().map(|e| &e.file).collect();
    for f in names {
        let (header, all) = split_file(&dir.join(f));
        let held = all
            .into_iter()
            .filter(|(k, _)| holding.contains(&(f.clone(), k.clone())))
            .collect();
        files.insert(
            f.clone(),
            SafetensorsFile::in_memory(&dir.join(f), &header, held).unwrap(),
        );
    }
    TraceDir::in_memory(Path::new("<online>"), manifest.clone(), files).unwrap()
}

fn entries_of<'a>(m: &'a Manifest, id: &'a str) -> impl Iterator<Item = (String, String)> + 'a {
    m.tensors
        .iter()
        .filter(move |e| e.id == id)
        .map(|e| (e.file.clone(), e.key.clone()))
}

/// The online protocol among `procs` simulated processes (process p holding rank p's shards):
/// the report, and the largest share of the step's tensors any process held.
fn online(
    reference: &TraceDir,
    dir: &Path,
    manifest: &Manifest,
    mode: PricingMode,
) -> (ttrace::check::DirCheck, usize, usize) {
    let procs = manifest.mesh.world();
    let mut holding: Vec<Holding> = (0..procs)
        .map(|p| {
            manifest
                .tensors
                .iter()
                .filter(|e| e.rank == p)
                .map(|e| (e.file.clone(), e.key.clone()))
                .collect()
        })
        .collect();
    let mut rounds = 0;
    loop {
        let needs: Vec<Vec<String>> = holding
            .iter()
            .map(|h| setup_needs(reference, &in_memory(dir, manifest, h)).unwrap())
            .collect();
        // Every process finds the same ids: they fetch in lockstep.
        assert!(needs.iter().all(|n| *n == needs[0]), "{needs:?}");
        if needs[0].is_empty() {
            break;
        }
        rounds += 1;
        assert!(rounds < 1000, "the set-up never settled");
        for id in &needs[0] {
            let all: Vec<_> = entries_of(manifest, id).collect();
            for h in holding.iter_mut() {
                h.extend(all.iter().cloned());
            }
        }
    }
    let probe = in_memory(dir, manifest, &holding[0]);
    let owners = share_owners(reference, &probe, procs).unwrap();
    for (id, &o) in reference.ids().iter().zip(&owners) {
        holding[o].extend(entries_of(manifest, id));
    }
    let shares: Vec<Vec<u8>> = (0..procs)
        .map(|p| {
            check_share(
                reference,
                &in_memory(dir, manifest, &holding[p]),
                p,
                procs,
                &|| {},
            )
            .unwrap()
        })
        .collect();
    let largest = holding.iter().map(BTreeSet::len).max().unwrap_or(0);
    (
        combine_shares(reference, &probe, mode, &shares).unwrap(),
        rounds,
        largest,
    )
}

#[test]
fn an_online_check_gives_the_written_steps_report() {
    for (name, mesh, bug, auto_loss) in [
        ("clean", Mesh::megatron(2, 1, 2, true).unwrap(), None, false),
        (
            "clean-auto-loss",
            Mesh::megatron(2, 1, 2, true).unwrap(),
            None,
            true,
        ),
        (
            "allreduce",
            Mesh::megatron(4, 1, 1, false).unwrap(),
            Some(Bug::RowBiasOnEveryRank),
            false,
        ),
        (
            "lse-guessed",
            Mesh::megatron(2, 2, 1, true).unwrap(),
            Some(Bug::CpWrongLseCorrection),
            true,
        ),
    ] {
        let d = dumped(name, mesh, bug);
        let cand_dir = d.join("candidate");
        let (mut manifest, _) = read_manifest(&cand_dir).unwrap();
        if auto_loss {
            // Left to the checker: the set-up reads activation gradients to settle it, and
            // the split layouts marked guessed make it read tensors to settle them too.
            manifest.dp_loss = Some(DpLoss::Auto);
            for e in manifest.tensors.iter_mut() {
                if e.layout.along(&Axis::TP) != Placement::Replicate {
                    e.guessed = vec![Axis::TP];
                }
            }
            write_manifest(&cand_dir.join("manifest.json"), &manifest).unwrap();
        }
        let mut r = TraceDir::open(&d.join("reference")).unwrap();
        let mut c = TraceDir::open(&cand_dir).unwrap();
        for mode in [PricingMode::Auto, PricingMode::Local] {
            let written = check_dirs(&mut r, &mut c, mode, &|| {}).unwrap();
            assert_eq!(written.report.passed(), bug.is_none(), "{name}");
            let (online, rounds, largest) = online(&r, &cand_dir, &manifest, mode);
            assert_eq!(online, written, "{name}, {mode:?}");
            assert_eq!(
                serde_json::to_string(&online).unwrap(),
                serde_json::to_string(&written).unwrap(),
                "{name}"
            );
            assert_eq!(rounds > 0, auto_loss, "{name}: fetch rounds {rounds}");
            // No process held the whole step.
            let total: BTreeSet<_> = manifest
                .tensors
                .iter()
                .map(|e| (e.file.clone(), e.key.clone()))
                .collect();
            assert!(
                largest < total.len(),
                "{name}: {largest} of {}",
                total.len()
            );
        }
    }
}

#[test]
fn a_process_lacking_a_tensor_it_checks_says_so() {
    let d = dumped("lacking", Mesh::megatron(2, 1, 1, false).unwrap(), None);
    let cand_dir = d.join("candidate");
    let (manifest, _) = read_manifest(&cand_dir).unwrap();
    let r = TraceDir::open(&d.join("reference")).unwrap();
    // Only its own rank's shards: every tensor it is assigned lacks the other rank's.
    let own: Holding = manifest
        .tensors
        .iter()
        .filter(|e| e.rank == 0)
        .map(|e| (e.file.clone(), e.key.clone()))
        .collect();
    let c = in_memory(&cand_dir, &manifest, &own);
    match check_share(&r, &c, 0, 2, &|| {}) {
        Err(Error::Layout { reason, .. }) => assert!(reason.contains("held"), "{reason}"),
        other => panic!("expected a Layout error, got {:?}", other.map(|b| b.len())),
    }
    assert!(!c.not_held().is_empty());
    // Held bytes that the header does not declare, or of another length, are refused.
    let f = manifest.tensors[0].file.clone();
    let (header, all) = split_file(&cand_dir.join(&f));
    let mut wrong = all.clone();
    let first = wrong.keys().next().unwrap().clone();
    wrong.insert(first, Arc::new(vec![0u8; 3]));
    assert!(matches!(
        SafetensorsFile::in_memory(Path::new("x"), &header, wrong),
        Err(Error::File { .. })
    ));
    let mut extra = all;
    extra.insert("not-declared".into(), Arc::new(vec![]));
    assert!(matches!(
        SafetensorsFile::in_memory(Path::new("x"), &header, extra),
        Err(Error::File { .. })
    ));
}
