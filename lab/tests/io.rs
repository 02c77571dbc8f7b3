//! Trace files: safetensors and npy round trips for every dtype, trace directories written by a
//! sharded simulation and merged back, and malformed inputs rejected with a message.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use proptest::prelude::*;
use ttrace::engine::Gpt;
use ttrace::io::{npy, safetensors, write_trace_dir, TraceDir};
use ttrace::trace::{Axis, Layout, Mesh};
use ttrace::{Error, Format};
use ttrace::{Recipe, Tensor};
use ttrace_lab::shard::{Algorithm, ShardedGpt};
use ttrace_lab::validate::SweepOptions;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ttrace-io-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn formats() -> [Format; 6] {
    [
        Format::F64,
        Format::F32,
        Format::F16,
        Format::BF16,
        Format::E4M3,
        Format::E5M2,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Every bit pattern survives safetensors and npy, for every stored dtype.
    #[test]
    fn every_dtype_round_trips_bit_for_bit(bits in prop::collection::vec(any::<u64>(), 1..40), which in 0usize..6) {
        let f = formats()[which];
        let width = f.bit_width();
        let values: Vec<f64> = bits.iter().map(|b| {
            let b = if width == 64 { *b } else { b & ((1u64 << width) - 1) };
            f.decode(b).unwrap()
        }).collect();
        let t = Tensor::from_vec(&[values.len()], values.clone(), f).unwrap();
        let d = tmp(&format!("rt{which}"));
        let p = d.join("t.safetensors");
        safetensors::write(&p, &[("x", &t)], &BTreeMap::new()).unwrap();
        let mut file = safetensors::SafetensorsFile::open(&p).unwrap();
        let back = file.read("x").unwrap();
        prop_assert_eq!(back.format(), f);
        let same = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| f.encode(*x).unwrap() == f.encode(*y).unwrap());
        prop_assert!(same(back.values(), &values));
        let q = d.join("t.npy");
        npy::write(&q, &t).unwrap();
        let back = npy::read(&q, Some(f)).unwrap();
        prop_assert!(same(back.values(), &values));
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn a_sharded_step_written_and_read_back_merges_to_the_same_tensors() {
    for recipe in ["bf16", "fp8-delayed"] {
        let cfg = SweepOptions::model();
        let mesh = Mesh::megatron(2, 2, 1, true).unwrap();
        let mut sharded = ShardedGpt::new(
            Gpt::new(cfg, Recipe::by_name(recipe).unwrap()).unwrap(),
            mesh.clone(),
            Algorithm::Ring,
        )
        .unwrap();
        let step = sharded.step().unwrap();
        let merged = step.merge(None).unwrap();
        let entries: Vec<_> = step
            .entries
            .iter()
            .map(|e| (e.id.clone(), e.layout.clone(), e.shards.clone()))
            .collect();
        let d = tmp(recipe);
        write_trace_dir(
            &d,
            &mesh,
            Some(recipe),
            &entries,
            &HashMap::new(),
            &HashMap::new(),
        )
        .unwrap();
        let mut dir = TraceDir::open(&d).unwrap();
        assert_eq!(dir.ids().len(), merged.len());
        assert_eq!(dir.manifest().recipe.as_deref(), Some(recipe));
        for id in dir.ids().to_vec() {
            assert_eq!(
                &dir.logical(&id).unwrap(),
                merged.require(&id).unwrap(),
                "{recipe} {id}"
            );
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}

fn expect_file_error(r: Result<impl std::fmt::Debug, Error>, needle: &str) {
    match r {
        Err(Error::File { reason, .. }) => {
            assert!(reason.contains(needle), "'{reason}' lacks '{needle}'")
        }
        other => panic!("expected a file error containing '{needle}', got {other:?}"),
    }
}

#[test]
fn malformed_safetensors_and_npy_are_rejected_with_the_problem_named() {
    let d = tmp("bad");
    let t = Tensor::from_vec(&[2, 2], vec![1.0, 2.0, 3.0, 4.0], Format::BF16).unwrap();
    let p = d.join("ok.safetensors");
    safetensors::write(&p, &[("x", &t)], &BTreeMap::new()).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    let w = |name: &str, b: &[u8]| {
        let q = d.join(name);
        std::fs::write(&q, b).unwrap();
        q
    };
    // Truncated data, truncated header, a header length that lies, garbage JSON.
    expect_file_error(
        safetensors::SafetensorsFile::open(&w("trunc.safetensors", &bytes[..bytes.len() - 2])),
        "past the data",
    );
    expect_file_error(
        safetensors::SafetensorsFile::open(&w("short.safetensors", &bytes[..5])),
        "truncated",
    );
    let mut lie = bytes.clone();
    lie[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    expect_file_error(
        safetensors::SafetensorsFile::open(&w("lie.safetensors", &lie)),
        "header length",
    );
    let mut junk = 4u64.to_le_bytes().to_vec();
    junk.extend_from_slice(b"{{{{");
    expect_file_error(
        safetensors::SafetensorsFile::open(&w("junk.safetensors", &junk)),
        "JSON",
    );
    // Wrong dtype and inconsistent offsets.
    let header = br#"{"x":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(&[0u8; 8]);
    expect_file_error(
        safetensors::SafetensorsFile::open(&w("dtype.safetensors", &b)),
        "unsupported dtype",
    );
    let header = br#"{"x":{"dtype":"F32","shape":[1000000000000],"data_offsets":[0,8]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(&[0u8; 8]);
    expect_file_error(
        safetensors::SafetensorsFile::open(&w("shape.safetensors", &b)),
        "do not hold",
    );
    // A header naming a tensor twice, overlapping byte ranges, a shape no array can have
    // (a zero beside a huge dimension: zero bytes, but impossible), a name that is not UTF-8.
    let raw = |header: &[u8], data: usize| {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header);
        b.extend(std::iter::repeat_n(0u8, data));
        b
    };
    expect_file_error(
        safetensors::SafetensorsFile::open(&w(
            "dup.safetensors",
            &raw(
                br#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                8,
            ),
        )),
        "twice",
    );
    expect_file_error(
        safetensors::SafetensorsFile::open(&w(
            "overlap.safetensors",
            &raw(
                br#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                12,
            ),
        )),
        "overlap",
    );
    expect_file_error(
        safetensors::SafetensorsFile::open(&w(
            "huge.safetensors",
            &raw(
                br#"{"x":{"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]}}"#,
                0,
            ),
        )),
        "too large",
    );
    let mut bad_name = br#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#.to_vec();
    bad_name[2] = 0xff;
    expect_file_error(
        safetensors::SafetensorsFile::open(&w("utf8.safetensors", &raw(&bad_name, 4))),
        "JSON",
    );
    // npy: bad magic, truncated data, Fortran order, a BF16 carrier without a declared dtype.
    let q = d.join("ok.npy");
    npy::write(&q, &t).unwrap();
    let nb = std::fs::read(&q).unwrap();
    expect_file_error(npy::read(&w("magic.npy", b"NOTNPY0000"), None), "magic");
    expect_file_error(
        npy::read(&w("trunc.npy", &nb[..nb.len() - 1]), Some(Format::BF16)),
        "truncated",
    );
    let needle = b"'fortran_order': False";
    let at = nb.windows(needle.len()).position(|x| x == needle).unwrap();
    let mut fort = nb.clone();
    fort[at..at + needle.len()].copy_from_slice(b"'fortran_order': True ");
    expect_file_error(
        npy::read(&w("fort.npy", &fort), Some(Format::BF16)),
        "Fortran",
    );
    expect_file_error(npy::read(&q, None), "manifest must name the dtype");
    expect_file_error(npy::read(&q, Some(Format::E4M3)), "bit patterns");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn manifest_problems_name_the_tensor_and_field() {
    let d = tmp("manifest");
    let mesh = Mesh::megatron(2, 1, 1, false).unwrap();
    let t = Tensor::from_vec(&[2], vec![1.0, 2.0], Format::F32).unwrap();
    let entries = vec![(
        "a|fwd.output.0".to_string(),
        Layout::replicated(),
        vec![t.clone(), t.clone()],
    )];
    write_trace_dir(&d, &mesh, None, &entries, &HashMap::new(), &HashMap::new()).unwrap();
    assert!(TraceDir::open(&d).is_ok());
    let mpath = d.join("manifest.json");
    let good = std::fs::read_to_string(&mpath).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut w = v.clone();
        f(&mut w);
        std::fs::write(&mpath, serde_json::to_string(&w).unwrap()).unwrap();
        TraceDir::open(&d)
    };
    // Unknown fields are ignored.
    assert!(edit(&|w| {
        w["tensors"][0]["extra"] = serde_json::json!(1);
        w["note"] = serde_json::json!("x");
    })
    .is_ok());
    expect_file_error(
        edit(&|w| {
            w["tensors"][1].as_object_mut().unwrap().remove("layout");
        }),
        "tensor #1 ('a|fwd.output.0'): missing required field 'layout'",
    );
    expect_file_error(
        edit(&|w| {
            w["tensors"][0].as_object_mut().unwrap().remove("id");
        }),
        "missing required field 'id'",
    );
    expect_file_error(
        edit(&|w| {
            w["version"] = serde_json::json!(3);
        }),
        "schema version 3",
    );
    expect_file_error(
        edit(&|w| {
            w["tensors"].as_array_mut().unwrap().pop();
        }),
        "no shard for rank 1",
    );
    expect_file_error(
        edit(&|w| {
            w["tensors"][1]["key"] = serde_json::json!("nope");
        }),
        "absent",
    );
    expect_file_error(
        edit(&|w| {
            w["tensors"][1]["dtype"] = serde_json::json!("bf16");
        }),
        "stored as f32",
    );
    expect_file_error(
        edit(&|w| {
            w["tensors"][1]["rank"] = serde_json::json!(7);
        }),
        "outside the mesh",
    );
    expect_file_error(
        edit(&|w| {
            w["tensors"][1]["file"] = serde_json::json!("../x.safetensors");
        }),
        "inside the trace directory",
    );
    // A mesh so large its rank count overflows (or is absurd): refused, not wrapped.
    expect_file_error(
        edit(&|w| {
            w["mesh"]["tp"] = serde_json::json!(1u64 << 40);
            w["mesh"]["cp"] = serde_json::json!(1u64 << 40);
        }),
        "exceeds",
    );
    // The same with named axes, and in a version-1 manifest.
    expect_file_error(
        edit(&|w| {
            w["mesh"] = serde_json::json!({"axes": [
                {"name": "dp", "size": 1}, {"name": "cp", "size": 1u64 << 40},
                {"name": "tp", "size": 1u64 << 40}]});
        }),
        "exceeds",
    );
    expect_file_error(
        edit(&|w| {
            w["version"] = serde_json::json!(1);
            w["mesh"]["cp"] = serde_json::json!(1u64 << 40);
            w["mesh"]["dp"] = serde_json::json!(1u64 << 40);
        }),
        "exceeds",
    );
    // A layout along an axis the mesh does not have.
    expect_file_error(
        edit(&|w| {
            w["tensors"][0]["layout"]["pp"] = serde_json::json!({"kind": "replicate"});
        }),
        "axis 'pp', which the mesh",
    );
    // A shard whose shape differs from the other rank's: reported when merged.
    v["tensors"][1]["file"] = serde_json::json!("rank1.safetensors");
    let odd = Tensor::from_vec(&[3], vec![1.0, 2.0, 3.0], Format::F32).unwrap();
    safetensors::write(
        &d.join("rank1.safetensors"),
        &[("a|fwd.output.0", &odd)],
        &BTreeMap::new(),
    )
    .unwrap();
    std::fs::write(&mpath, &good).unwrap();
    let mut dir = TraceDir::open(&d).unwrap();
    assert!(matches!(
        dir.logical("a|fwd.output.0"),
        Err(Error::Layout { .. })
    ));
    std::fs::remove_dir_all(&d).unwrap();
}

/// The default sweep's model and settings, with fewer samples and no sensitivity pass.
fn quick_options(samples: usize) -> SweepOptions {
    let mut options = SweepOptions::default_sweep(1);
    options.simulation.samples = samples;
    options.perturbation_samples = 1;
    options.sensitivity_mesh = None;
    options
}

/// Every catalog bug, dumped by the simulator on the first mesh where it applies and checked
/// from the files, fails the check; the clean dumps of the same configurations pass.
#[test]
fn every_catalog_bug_round_trips_through_files_and_is_found() {
    use ttrace::check::check_dirs;
    use ttrace_lab::bugs::Bug;
    use ttrace_lab::validate::{bug_meshes, dump_run, run_config_with_thresholds, RunConfig};
    let options = quick_options(8);
    for bug in Bug::ALL {
        let recipe = if bug == Bug::Fp8AmaxNotReduced {
            "fp8-delayed"
        } else {
            "bf16"
        };
        let mesh = bug_meshes(bug, recipe.starts_with("fp8"), options.model.batch, 1)[0].clone();
        let run = RunConfig {
            mesh: mesh.clone(),
            recipe: recipe.into(),
            seed: 1000,
            algorithm: Algorithm::Ring,
        };
        let (_, th) = run_config_with_thresholds(&options, &run).unwrap();
        for (with_bug, want_pass) in [(None, true), (Some(bug), false)] {
            let d = tmp(&format!("{bug}-{}", with_bug.is_some()));
            dump_run(&options, &run, with_bug, &th, &d).unwrap();
            let mut r = TraceDir::open(&d.join("reference")).unwrap();
            let mut c = TraceDir::open(&d.join("candidate")).unwrap();
            let out = check_dirs(&mut r, &mut c, ttrace::check::PricingMode::Auto, &|| {}).unwrap();
            assert!(
                out.fallback.is_empty(),
                "{bug}: thresholds come from the manifest"
            );
            assert_eq!(
                out.report.passed(),
                want_pass,
                "{bug} {} (bug injected: {}): first failure {:?}",
                mesh.label(),
                with_bug.is_some(),
                out.report.first_failure
            );
            std::fs::remove_dir_all(&d).unwrap();
        }
    }
}

/// The parallel checker gives the same report as the sequential one, for any thread count.
#[test]
fn parallel_check_equals_sequential_check() {
    use ttrace::check::{check_dir_paths, check_dirs};
    use ttrace_lab::bugs::Bug;
    use ttrace_lab::validate::{dump_run, run_config_with_thresholds, RunConfig};
    let options = quick_options(4);
    let run = RunConfig {
        mesh: Mesh::megatron(2, 2, 1, true).unwrap(),
        recipe: "bf16".into(),
        seed: 1000,
        algorithm: Algorithm::Ring,
    };
    let (_, th) = run_config_with_thresholds(&options, &run).unwrap();
    let d = tmp("parallel");
    dump_run(&options, &run, Some(Bug::CpWrongLseCorrection), &th, &d).unwrap();
    let (rp, cp) = (d.join("reference"), d.join("candidate"));
    let seq = check_dirs(
        &mut TraceDir::open(&rp).unwrap(),
        &mut TraceDir::open(&cp).unwrap(),
        ttrace::check::PricingMode::Auto,
        &|| {},
    )
    .unwrap();
    assert!(!seq.report.passed());
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let par = pool
            .install(|| check_dir_paths(&rp, &cp, ttrace::check::PricingMode::Auto, &|| {}))
            .unwrap();
        assert_eq!(par, seq, "{threads} threads");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// Shards that are all addends of one sum (a 4-rank partial layout, more elements than one
/// block of the streamed sum) merge to the exactly summed, once rounded values, for every
/// stored format; the oracle is the long accumulator, element by element.
#[test]
fn partial_shards_sum_exactly_block_by_block() {
    let mesh = Mesh::megatron(4, 1, 1, false).unwrap();
    let layout = Layout::replicated().with(Axis::TP, ttrace::trace::Placement::Partial);
    let n = 70_001;
    let mut g = ttrace::engine::SplitMix64::for_name("partial-stream", 3);
    for f in formats() {
        let width = f.bit_width();
        let shards: Vec<Tensor> = (0..4)
            .map(|_| {
                let v = (0..n)
                    .map(|_| {
                        let b = g.next_u64();
                        f.decode(if width == 64 {
                            b
                        } else {
                            b & ((1 << width) - 1)
                        })
                        .unwrap()
                    })
                    .collect();
                Tensor::from_vec(&[n], v, f).unwrap()
            })
            .collect();
        let d = tmp(&format!("partial-{f}"));
        let id = "mlp.fc2|fwd.output.0".to_string();
        let none = (HashMap::new(), HashMap::new());
        write_trace_dir(
            &d,
            &mesh,
            None,
            &[(id.clone(), layout.clone(), shards.clone())],
            &none.0,
            &none.1,
        )
        .unwrap();
        let merged = TraceDir::open(&d).unwrap().logical(&id).unwrap();
        assert_eq!(merged.shape(), &[n]);
        for (i, &m) in merged.values().iter().enumerate() {
            let addends: Vec<f64> = shards.iter().map(|s| s.values()[i]).collect();
            // Rounded once from the exact sum (rounding its f64 rounding again could land on
            // a tie of the format's grid the exact sum is not on).
            let mut acc = ttrace::ExactAccumulator::new();
            acc.add_all(&addends);
            let want = acc.round(f, ttrace::Overflow::NonSaturating);
            assert!(
                m.to_bits() == want.to_bits() || (m.is_nan() && want.is_nan()),
                "{f} element {i}: {m} vs {want} from {addends:?}"
            );
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}

/// `ttrace simulate --dump` writes its traces from the run it checks (`run_bug_dumping`):
/// the same files, byte for byte, as a separate `dump_run` of that configuration, and the
/// same verdict as `run_bug`.
#[test]
fn dumping_from_the_checked_run_writes_the_same_traces() {
    use ttrace_lab::bugs::Bug;
    use ttrace_lab::validate::{
        dump_run, run_bug, run_bug_dumping, run_config_with_thresholds, RunConfig,
    };
    let options = quick_options(4);
    let run = RunConfig {
        mesh: Mesh::megatron(2, 1, 2, false).unwrap(),
        recipe: "fp8-delayed".into(),
        seed: 1000,
        algorithm: Algorithm::Ring,
    };
    let bug = Some(Bug::GradAllReduceInBf16);
    let (_, th) = run_config_with_thresholds(&options, &run).unwrap();
    let (a, b) = (tmp("dump-separate"), tmp("dump-same-run"));
    dump_run(&options, &run, bug, &th, &a).unwrap();
    let with_dump = run_bug_dumping(&options, &run, bug, &th, Some(&b)).unwrap();
    let plain = run_bug(&options, &run, bug, &th).unwrap();
    assert_eq!(
        serde_json::to_string(&with_dump).unwrap(),
        serde_json::to_string(&plain).unwrap()
    );
    for side in ["reference", "candidate"] {
        let mut names: Vec<_> = std::fs::read_dir(a.join(side))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert!(names.len() >= 2, "{side}: {names:?}");
        for n in names {
            let (x, y) = (a.join(side).join(&n), b.join(side).join(&n));
            assert!(
                std::fs::read(&x).unwrap() == std::fs::read(&y).unwrap(),
                "{} differs",
                x.display()
            );
        }
    }
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

/// Tensors written from their stored bytes read back pattern for pattern, by our reader and by
/// the `safetensors` crate; a byte count that does not fit the shape, or a name given twice,
/// is refused before anything is written.
#[test]
fn stored_bytes_are_written_as_given() {
    use safetensors::{SafetensorsFile, StoredTensor};
    let dir = tmp("write-stored");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.safetensors");
    // BF16 patterns of 1.0, -2.5, a NaN with payload and the smallest subnormal; E4M3 codes.
    let bf16: Vec<u8> = [0x3f80u16, 0xc020, 0x7fc1, 0x0001]
        .iter()
        .flat_map(|p| p.to_le_bytes())
        .collect();
    let fp8: Vec<u8> = vec![0x38, 0xb8, 0x7e, 0x01, 0x00, 0x80];
    let tensors = [
        StoredTensor {
            name: "a",
            format: Format::BF16,
            shape: &[2, 2],
            bytes: &bf16,
        },
        StoredTensor {
            name: "b",
            format: Format::E4M3,
            shape: &[3, 2],
            bytes: &fp8,
        },
    ];
    safetensors::write_stored(&path, &tensors, &BTreeMap::new(), true).unwrap();
    let raw = std::fs::read(&path).unwrap();
    let oracle = ::safetensors::SafeTensors::deserialize(&raw).unwrap();
    assert_eq!(oracle.tensor("a").unwrap().data(), &bf16[..]);
    assert_eq!(oracle.tensor("b").unwrap().data(), &fp8[..]);
    assert_eq!(oracle.tensor("b").unwrap().shape(), &[3, 2]);
    let mut ours = SafetensorsFile::open(&path).unwrap();
    let a = ours.read("a").unwrap();
    for (v, p) in a.values().iter().zip([0x3f80u64, 0xc020, 0x7fc1, 0x0001]) {
        let want = Format::BF16.decode(p).unwrap();
        assert!(v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()));
    }
    let short = StoredTensor {
        name: "c",
        format: Format::F32,
        shape: &[2],
        bytes: &fp8[..7.min(fp8.len())],
    };
    let other = dir.join("u.safetensors");
    assert!(matches!(
        safetensors::write_stored(&other, &[short], &BTreeMap::new(), false),
        Err(Error::File { .. })
    ));
    let twice = [tensors[0], tensors[0]];
    assert!(matches!(
        safetensors::write_stored(&other, &twice, &BTreeMap::new(), false),
        Err(Error::File { .. })
    ));
    assert!(!other.exists());
}

/// A tensor the candidate stores in another dtype than the reference (gradients reduced in
/// BF16 where the reference keeps FP32 main gradients) is judged, not refused: priced at the
/// wider of the two, failing with the change named when the narrower storage loses more than
/// round-off; stored wider with the same values, it passes.
#[test]
fn a_dtype_change_between_runs_is_judged_and_named() {
    use ttrace::check::{check_dir_paths, PricingMode};
    let values: Vec<f64> = (0..4096)
        .map(|i| {
            Format::F32.round(
                ((i * 7919 % 1013) as f64 - 506.0) / 97.0,
                ttrace::Overflow::Saturating,
            )
        })
        .collect();
    let f32t = Tensor::from_vec(&[64, 64], values.clone(), Format::F32).unwrap();
    let bf16 = Tensor::rounded(
        &[64, 64],
        values.clone(),
        Format::BF16,
        ttrace::Overflow::Saturating,
    )
    .unwrap();
    let f64t = Tensor::from_vec(&[64, 64], values, Format::F64).unwrap();
    let mesh = Mesh::megatron(1, 1, 1, false).unwrap();
    let write = |dir: &PathBuf, t: &Tensor| {
        let _ = std::fs::remove_dir_all(dir);
        let entries = vec![(
            "l|fwd.output.0".to_string(),
            Layout::replicated(),
            vec![t.clone()],
        )];
        write_trace_dir(dir, &mesh, None, &entries, &HashMap::new(), &HashMap::new()).unwrap();
    };
    let (r, c) = (tmp("dtype-change-ref"), tmp("dtype-change-cand"));
    write(&r, &f32t);
    write(&c, &bf16);
    let out = check_dir_paths(&r, &c, PricingMode::Local, &|| {}).unwrap();
    let v = &out.report.verdicts[0];
    assert!(!v.passed);
    let note = v.problem.as_deref().unwrap_or("");
    assert!(
        note.contains("stored as bf16 in the candidate but as f32"),
        "{note}"
    );
    write(&c, &f64t);
    let out = check_dir_paths(&r, &c, PricingMode::Local, &|| {}).unwrap();
    assert!(out.report.passed(), "{:?}", out.report.verdicts[0]);
}
