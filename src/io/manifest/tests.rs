//! The manifest's round trips, strict parsing and merges.
#![cfg(test)]

use super::write::manifest_text;
use super::*;

/// The compact text is the manifest: it parses back to the same value as serde's own
/// (indented) rendering.
#[test]
fn compact_text_is_the_manifest() {
    let e = |rank: usize| ManifestEntry {
        id: "a|fwd.output.0".into(),
        rank,
        file: format!("rank{rank}.safetensors"),
        key: "a\u{1b}|\"q\"".into(),
        dtype: Format::BF16,
        layout: Layout::replicated(),
        module: Some(ModuleInfo::of(ModuleKind::Linear)),
        threshold: Some(0.25),
        guessed: vec![],
        stage: Some(1),
        owned: None,
    };
    let run = serde_json::json!({"torch": "2.11", "gpu": "H100"});
    let pipeline = Pipeline {
        stages: 2,
        microbatches: 4,
        dim: Some(1),
    };
    for (recipe, tensors, dp_loss, run, pipeline) in [
        (None, vec![], None, None, None),
        (
            Some("bf16".to_string()),
            vec![e(0), e(1)],
            Some(DpLoss::Auto),
            Some(run),
            Some(pipeline),
        ),
    ] {
        let m = Manifest {
            format: "ttrace-trace".into(),
            version: VERSION,
            recipe,
            dp_loss,
            pipeline,
            mesh: Mesh::megatron(2, 1, 1, false).unwrap(),
            run,
            tensors,
        };
        let text = manifest_text(&m).unwrap();
        let a: serde_json::Value = serde_json::from_str(&text).unwrap();
        let b = serde_json::to_value(&m).unwrap();
        assert_eq!(a, b);
        assert_eq!(Manifest::parse(&text, Path::new("m.json")).unwrap(), m);
    }
}

/// A pipelined trace's header and stages: read by both parsers alike; out-of-range values,
/// a stage without a pipeline and fragments that disagree on it refused, naming the field.
#[test]
fn pipelines_are_read_and_checked() {
    let path = Path::new("manifest.json");
    let text = |pipeline: &str, stage: &str| {
        format!(
            r#"{{"format": "ttrace-trace", "version": 2, {pipeline}
            "mesh": {{"axes": [{{"name": "dp", "size": 1}}], "sp": false}},
            "tensors": [{{"id": "a|fwd.output.0", "rank": 0, "file": "rank1.safetensors",
                          "dtype": "f32", "layout": {{}} {stage}}}]}}"#
        )
    };
    let ok = text(
        r#""pipeline": {"stages": 2, "microbatches": 4},"#,
        r#", "stage": 1"#,
    );
    let fast = Manifest::parse_typed(&ok, path).unwrap();
    assert_eq!(fast, Manifest::parse_detailed(&ok, path).unwrap());
    assert_eq!(fast.microbatches(), 4);
    assert_eq!(fast.tensors[0].stage, Some(1));
    for (bad, what) in [
        (
            text(
                r#""pipeline": {"stages": 2, "microbatches": 4},"#,
                r#", "stage": 2"#,
            ),
            "'stage' 2 is not a stage of the pipeline (2 stages)",
        ),
        (text("", r#", "stage": 0"#), "the manifest declares none"),
        (
            text(r#""pipeline": {"stages": 2, "microbatches": 0},"#, ""),
            "must be between 1 and",
        ),
        (
            text(
                r#""pipeline": {"stages": 2, "microbatches": 1, "x": 1},"#,
                "",
            ),
            "'pipeline'",
        ),
        (
            text(
                r#""pipeline": {"stages": 2, "microbatches": 2},"#,
                r#", "stage": -1"#,
            ),
            "'stage' must be a non-negative integer",
        ),
    ] {
        match Manifest::parse(&bad, path) {
            Err(Error::File { reason, .. }) => assert!(reason.contains(what), "{reason}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
    let other = Manifest {
        pipeline: None,
        ..fast.clone()
    };
    let merged = parse::merge_parts(
        vec![(fast, path.to_path_buf()), (other, path.to_path_buf())],
        path,
    );
    assert!(matches!(merged, Err(Error::File { reason, .. }) if reason.contains("pipeline")));
}

/// The typed fast path and the field-by-field pass read the same manifests alike, and both
/// refuse a field named twice.
#[test]
fn both_parsers_agree() {
    let path = Path::new("manifest.json");
    let text = r#"{"format": "ttrace-trace", "version": 1, "recipe": "bf16",
        "mesh": {"tp": 2, "cp": 1, "dp": 1, "sp": false},
        "tensors": [
          {"id": "a|fwd.output.0", "rank": 0, "file": "rank0.safetensors", "dtype": "bf16",
           "layout": {"dp": {"kind": "replicate"}, "cp": {"kind": "replicate"},
                      "tp": {"kind": "split", "dim": 1, "groups": 1}},
           "module": {"kind": "linear", "accumulate": "f32"}, "threshold": 0.5},
          {"id": "a|fwd.output.0", "rank": 1, "file": "rank1.safetensors", "key": "k",
           "dtype": "bf16", "threshold": null,
           "layout": {"dp": {"kind": "replicate"}, "cp": {"kind": "replicate"},
                      "tp": {"kind": "split", "dim": 1, "groups": 1}}}]}"#;
    let fast = Manifest::parse_typed(text, path).unwrap();
    let slow = Manifest::parse_detailed(text, path).unwrap();
    assert_eq!(fast, slow);
    // Fields this version does not know (a newer writer's) are read by the strict pass:
    // the same manifest.
    let extra = text
        .replacen(
            "\"threshold\": null,",
            "\"threshold\": null, \"extra\": [1, 2],",
            1,
        )
        .replacen(
            "\"recipe\"",
            "\"run\": {\"torch\": \"2\"}, \"new\": 1, \"recipe\"",
            1,
        );
    // The run's settings are kept as written, by both parsers.
    let with_run = Manifest {
        run: Some(serde_json::json!({"torch": "2"})),
        ..slow.clone()
    };
    assert!(Manifest::parse_typed(&extra, path).is_err());
    assert_eq!(Manifest::parse(&extra, path).unwrap(), with_run);
    // The Python tracer's "run" is known: typed.
    let run = text.replacen("\"recipe\"", "\"run\": {\"torch\": \"2\"}, \"recipe\"", 1);
    assert_eq!(Manifest::parse_typed(&run, path).unwrap(), with_run);
    assert_eq!(Manifest::parse_detailed(&run, path).unwrap(), with_run);
    assert_eq!(fast.tensors[0].key, "a|fwd.output.0");
    assert_eq!(fast.tensors[1].key, "k");
    let twice = text.replacen("\"rank\": 0,", "\"rank\": 0, \"rank\": 1,", 1);
    assert!(matches!(
        Manifest::parse_typed(&twice, path),
        Err(Error::File { .. })
    ));
    assert!(matches!(
        Manifest::parse_detailed(&twice, path),
        Err(Error::File { .. })
    ));
    let e = Manifest::parse(&twice, path).unwrap_err().to_string();
    assert!(e.contains("twice"), "{e}");
}

/// The arithmetic a module ran with reads from both parsers; a setting ttrace has no
/// model for is `UnpricedArithmetic` naming the tensor and the setting, an unknown value
/// a file error naming the tensor's `module`.
#[test]
fn module_arithmetic_reads_and_unpriceable_settings_are_refused() {
    let path = Path::new("manifest.json");
    let text = |module: &str| {
        format!(
            r#"{{"format": "ttrace-trace", "version": 1,
        "mesh": {{"tp": 1, "cp": 1, "dp": 1, "sp": false}},
        "tensors": [
          {{"id": "fc1|grad.input.0", "rank": 0, "file": "rank0.safetensors", "dtype": "f32",
           "layout": {{"dp": {{"kind": "replicate"}}, "cp": {{"kind": "replicate"}},
                      "tp": {{"kind": "replicate"}}}},
           "module": {module}}}]}}"#
        )
    };
    let ok =
        text(r#"{"kind": "linear", "autocast": "f16", "fp32_matmul": "tf32", "device": "cuda"}"#);
    let fast = Manifest::parse_typed(&ok, path).unwrap();
    assert_eq!(fast, Manifest::parse_detailed(&ok, path).unwrap());
    let arith = &fast.tensors[0].module.as_ref().unwrap().arith;
    assert_eq!(arith.autocast, Some(Format::F16));
    assert_eq!(arith.fp32_matmul, Some(Format::TF32));
    assert_eq!(arith.device.as_deref(), Some("cuda"));
    for (module, setting) in [
        (r#"{"kind": "linear", "autocast": "e4m3"}"#, "autocast=e4m3"),
        (
            r#"{"kind": "linear", "fp32_matmul": "f16"}"#,
            "fp32_matmul=f16",
        ),
        (r#"{"fp32_conv": "e5m2"}"#, "fp32_conv=e5m2"),
    ] {
        match Manifest::parse(&text(module), path) {
            Err(Error::UnpricedArithmetic { id, setting: s }) => {
                assert_eq!(id, "fc1|grad.input.0");
                assert_eq!(s, setting);
            }
            other => panic!("{module}: {other:?}"),
        }
    }
    let e = Manifest::parse(&text(r#"{"autocast": "fp4"}"#), path).unwrap_err();
    assert!(matches!(e, Error::File { .. }), "{e:?}");
    assert!(e.to_string().contains("fc1|grad.input.0"), "{e}");
}
