//! The tiny GPT: a complete, finite trace with the canonical ids; exact replay of every module;
//! a whole-model gradient check in F64; determinism.

use std::collections::BTreeSet;

use ttrace::engine::*;
use ttrace::{Format, Overflow};
use ttrace::{Recipe, Scaling, Tensor};

/// The canonical ids of one step, written out from the architecture (not from the model code).
fn expected_ids(layers: usize, norm_bias: bool) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut module = |name: &str, inputs: usize, params: &[&str]| {
        for i in 0..inputs {
            ids.insert(format!("{name}|fwd.input.{i}"));
            ids.insert(format!("{name}|grad.input.{i}"));
        }
        ids.insert(format!("{name}|fwd.output.0"));
        ids.insert(format!("{name}|grad.output.0"));
        for p in params {
            ids.insert(format!("{name}.{p}|param_grad"));
        }
    };
    let ln: &[&str] = if norm_bias {
        &["weight", "bias"]
    } else {
        &["weight"]
    };
    module("embedding", 0, &["wte", "wpe"]);
    for l in 0..layers {
        let p = format!("layers.{l}");
        module(&format!("{p}.ln1"), 1, ln);
        module(&format!("{p}.attn.qkv"), 1, &["weight", "bias"]);
        module(&format!("{p}.attn.core"), 1, &[]);
        module(&format!("{p}.attn.proj"), 1, &["weight", "bias"]);
        module(&format!("{p}.resid1"), 2, &[]);
        module(&format!("{p}.ln2"), 1, ln);
        module(&format!("{p}.mlp.fc1"), 1, &["weight", "bias"]);
        module(&format!("{p}.mlp.act"), 1, &[]);
        module(&format!("{p}.mlp.fc2"), 1, &["weight", "bias"]);
        module(&format!("{p}.resid2"), 2, &[]);
    }
    module("final_ln", 1, ln);
    module("lm_head", 1, &["weight"]);
    module("loss", 1, &[]);
    ids
}

#[test]
fn bf16_step_has_a_complete_finite_trace() {
    let config = GptConfig::default(); // 2 layers, hidden 64, 4 heads, seq 32, batch 2
    assert_eq!(
        (
            config.layers,
            config.hidden,
            config.heads,
            config.seq,
            config.batch
        ),
        (2, 64, 4, 32, 2)
    );
    let mut model = Gpt::new(config.clone(), Recipe::bf16()).unwrap();
    let step = model.step().unwrap();
    let ids: BTreeSet<String> = step.trace.ids().map(str::to_string).collect();
    assert_eq!(ids, expected_ids(2, true));
    for e in step.trace.entries() {
        assert!(e.tensor.all_finite(), "{} has a non-finite value", e.id);
    }
    // Random init: the loss is close to ln(vocab).
    assert!(
        (step.loss - (config.vocab as f64).ln()).abs() < 0.2,
        "loss {}",
        step.loss
    );
    // Formats as the recipe declares: BF16 activations and gradients, FP32 parameter grads.
    let t = &step.trace;
    assert_eq!(
        t.require("layers.1.mlp.fc1|fwd.output.0").unwrap().format(),
        Format::BF16
    );
    assert_eq!(
        t.require("layers.0.attn.qkv|grad.input.0")
            .unwrap()
            .format(),
        Format::BF16
    );
    assert_eq!(
        t.require("layers.0.mlp.fc1.weight|param_grad")
            .unwrap()
            .format(),
        Format::F32
    );
    assert_eq!(
        t.require("layers.0.mlp.fc1|fwd.output.0").unwrap().shape(),
        &[2, 32, 256]
    );
    assert_eq!(
        t.require("lm_head.weight|param_grad").unwrap().shape(),
        &[128, 64]
    );
    // Execution order: forward before backward, the loss last forward and first backward.
    let order: Vec<&str> = t.ids().collect();
    let pos = |id: &str| order.iter().position(|x| *x == id).unwrap();
    assert!(pos("embedding|fwd.output.0") < pos("layers.0.ln1|fwd.output.0"));
    assert!(pos("loss|fwd.output.0") < pos("loss|grad.output.0"));
    assert!(pos("loss|grad.input.0") < pos("lm_head|grad.output.0"));
    assert!(pos("layers.0.ln1|grad.input.0") < pos("embedding|grad.output.0"));
}

#[test]
fn rmsnorm_silu_online_variant_traces() {
    let config = GptConfig {
        norm: NormKind::RmsNorm,
        activation: Activation::Silu,
        attention: AttentionImpl::Online { block: 8 },
        variance: Variance::Welford,
        layers: 1,
        ..GptConfig::default()
    };
    let step = Gpt::new(config, Recipe::fp32()).unwrap().step().unwrap();
    let ids: BTreeSet<String> = step.trace.ids().map(str::to_string).collect();
    assert_eq!(ids, expected_ids(1, false));
    assert!(step.trace.entries().iter().all(|e| e.tensor.all_finite()));
}

/// Every module, re-run on its traced inputs (and traced output gradient), reproduces its
/// traced output and gradients bit for bit: the replay localization relies on.
fn replay_is_exact(recipe: Recipe) {
    let config = GptConfig {
        layers: 1,
        hidden: 32,
        seq: 16,
        vocab: 64,
        ..GptConfig::default()
    };
    let mut model = Gpt::new(config, recipe).unwrap();
    let step = model.step().unwrap();
    let t = &step.trace;
    let modules = model.modules().to_vec();
    for m in &modules {
        let inputs: Vec<Tensor> = (0..m.inputs.len())
            .map(|i| {
                t.require(&format!("{}|fwd.input.{i}", m.name))
                    .unwrap()
                    .clone()
            })
            .collect();
        let out = model.forward_module(&m.name, &inputs).unwrap();
        assert_eq!(
            &out,
            t.require(&format!("{}|fwd.output.0", m.name)).unwrap(),
            "{} forward",
            m.name
        );
        let g = t
            .require(&format!("{}|grad.output.0", m.name))
            .unwrap()
            .clone();
        let (gin, pg) = model.backward_module(&m.name, &inputs, &g).unwrap();
        for (i, gi) in gin.iter().enumerate() {
            assert_eq!(
                gi,
                t.require(&format!("{}|grad.input.{i}", m.name)).unwrap(),
                "{} grad.input.{i}",
                m.name
            );
        }
        for (name, gp) in pg {
            assert_eq!(
                &gp,
                t.require(&format!("{name}|param_grad")).unwrap(),
                "{name}"
            );
        }
    }
}

#[test]
fn replay_is_exact_bf16() {
    replay_is_exact(Recipe::bf16());
}

#[test]
fn replay_is_exact_fp8_delayed() {
    replay_is_exact(Recipe::fp8(Scaling::PerTensorDelayed { margin: 0 }));
}

#[test]
fn replay_is_exact_fp8_mx() {
    replay_is_exact(Recipe::fp8(Scaling::Block { size: 32 }));
}

#[test]
fn replay_rejects_bad_requests() {
    let mut model = Gpt::new(
        GptConfig {
            layers: 1,
            ..GptConfig::default()
        },
        Recipe::bf16(),
    )
    .unwrap();
    assert!(matches!(
        model.forward_module("layers.7.mlp.fc1", &[]),
        Err(ttrace::Error::UnknownName { .. })
    ));
    assert!(
        model
            .forward_module("layers.0.mlp.fc1", &[])
            .err()
            .is_some_and(|e| matches!(e, ttrace::Error::LengthMismatch { .. })),
        "wrong number of inputs"
    );
    let wrong = Tensor::zeros(&[2, 32, 17], Format::BF16);
    assert!(
        model
            .forward_module("layers.0.mlp.fc1", &[wrong])
            .err()
            .is_some_and(|e| matches!(e, ttrace::Error::ShapeMismatch { .. })),
        "wrong feature size"
    );
    assert!(Gpt::new(
        GptConfig {
            hidden: 30,
            heads: 4,
            ..GptConfig::default()
        },
        Recipe::bf16()
    )
    .err()
    .is_some_and(|e| matches!(e, ttrace::Error::InvalidParameter { .. })));
    assert!(Gpt::new(
        GptConfig {
            layers: 0,
            ..GptConfig::default()
        },
        Recipe::bf16()
    )
    .err()
    .is_some_and(|e| matches!(e, ttrace::Error::InvalidParameter { .. })));
    assert!(matches!(
        model.param("nope"),
        Err(ttrace::Error::UnknownName { .. })
    ));
}

/// d loss / dθ from the trace against a fourth-order central difference of the loss, in F64,
/// along random directions in every parameter. Tolerance 1e-6 relative to ‖∇‖·‖v‖.
#[test]
fn whole_model_gradient_check_f64() {
    let config = GptConfig {
        layers: 2,
        hidden: 16,
        heads: 2,
        seq: 8,
        batch: 2,
        vocab: 32,
        ..GptConfig::default()
    };
    let mut model = Gpt::new(config, Recipe::uniform(Format::F64)).unwrap();
    let step = model.step().unwrap();
    let names: Vec<String> = model.params().keys().cloned().collect();
    let mut checked = 0;
    for (k, name) in names.iter().enumerate() {
        let theta = model.param(name).unwrap().clone();
        let grad = step
            .trace
            .require(&format!("{name}|param_grad"))
            .unwrap()
            .clone();
        let v = normal_values(
            &format!("direction.{name}"),
            theta.len(),
            0.0,
            1.0,
            k as u64,
        );
        let h = 1e-4;
        let mut loss_at = |s: f64| {
            let p: Vec<f64> = theta
                .values()
                .iter()
                .zip(&v)
                .map(|(a, b)| a + s * h * b)
                .collect();
            model
                .set_param(
                    name,
                    Tensor::from_vec(theta.shape(), p, Format::F64).unwrap(),
                )
                .unwrap();
            model.step().unwrap().loss
        };
        let (l2, l1, m1, m2) = (loss_at(2.0), loss_at(1.0), loss_at(-1.0), loss_at(-2.0));
        model.set_param(name, theta.clone()).unwrap();
        let numeric = (-l2 + 8.0 * l1 - 8.0 * m1 + m2) / (12.0 * h);
        let exact: f64 = grad.values().iter().zip(&v).map(|(a, b)| a * b).sum();
        let norm = |x: &[f64]| x.iter().map(|a| a * a).sum::<f64>().sqrt();
        let scale = (norm(grad.values()) * norm(&v)).max(1e-5 * l1.abs());
        let rel = (numeric - exact).abs() / scale;
        assert!(
            rel < 1e-6,
            "{name}: numeric {numeric:e} analytic {exact:e} (relative {rel:e})"
        );
        checked += 1;
    }
    assert_eq!(checked, names.len());
}

#[test]
fn steps_are_deterministic_and_seeded_by_name() {
    let c = GptConfig {
        layers: 1,
        ..GptConfig::default()
    };
    let a = Gpt::new(c.clone(), Recipe::bf16()).unwrap().step().unwrap();
    let b = Gpt::new(c.clone(), Recipe::bf16()).unwrap().step().unwrap();
    assert_eq!(a.trace, b.trace);
    let other = Gpt::new(
        GptConfig {
            seed: 99,
            ..c.clone()
        },
        Recipe::bf16(),
    )
    .unwrap()
    .step()
    .unwrap();
    assert_ne!(a.trace.entries()[0].tensor, other.trace.entries()[0].tensor);
    // Parameters are the generator's values for their names, rounded to the parameter format.
    let model = Gpt::new(c.clone(), Recipe::bf16()).unwrap();
    let w = model.param("layers.0.mlp.fc1.weight").unwrap();
    let expect = normal_values("layers.0.mlp.fc1.weight", w.len(), 0.0, 0.02, c.seed);
    for (x, e) in w.values().iter().zip(expect) {
        assert_eq!(*x, Format::BF16.round(e, Overflow::Saturating));
    }
}

#[test]
fn recipes_differ_but_stay_close() {
    let c = GptConfig {
        layers: 1,
        ..GptConfig::default()
    };
    let f32_loss = Gpt::new(c.clone(), Recipe::fp32())
        .unwrap()
        .step()
        .unwrap()
        .loss;
    for name in ["bf16", "fp8-current", "fp8-delayed", "fp8-mx"] {
        let loss = Gpt::new(c.clone(), Recipe::by_name(name).unwrap())
            .unwrap()
            .step()
            .unwrap()
            .loss;
        assert!(loss.is_finite());
        assert!(
            (loss - f32_loss).abs() < 0.05,
            "{name}: {loss} vs fp32 {f32_loss}"
        );
    }
}

/// Every recipe's name reads back through `Recipe::by_name` as the same recipe.
#[test]
fn recipe_names_read_back() {
    let mut all = vec![
        Recipe::fp32(),
        Recipe::bf16(),
        Recipe::fp8(Scaling::None),
        Recipe::fp8(Scaling::PerTensorCurrent { margin: 0 }),
        Recipe::fp8(Scaling::PerTensorDelayed { margin: 0 }),
        Recipe::fp8(Scaling::Block { size: 32 }),
    ];
    all.extend([Format::F64, Format::F32, Format::BF16, Format::F16].map(Recipe::uniform));
    for r in all {
        let back = Recipe::by_name(&r.name).unwrap();
        assert_eq!(back, r, "{}", r.name);
    }
    assert_eq!(Recipe::by_name("f32").unwrap().name, "fp32");
    assert!(matches!(
        Recipe::by_name("fp7"),
        Err(ttrace::Error::UnknownName { .. })
    ));
}

/// Every id a training step traces reads back through `TensorId` as itself, and its parsed
/// pass and role agree with the naming convention.
#[test]
fn traced_ids_read_back_through_tensor_id() {
    use ttrace::trace::{TensorId, TensorRole};
    let step = Gpt::new(GptConfig::default(), Recipe::bf16())
        .unwrap()
        .step()
        .unwrap();
    let mut n = 0;
    for id in step.trace.ids() {
        let t = TensorId::parse(id).unwrap_or_else(|| panic!("{id} does not parse"));
        assert_eq!(t.to_string(), id);
        let (_, what) = id.split_once('|').unwrap();
        assert_eq!(t.pass() == Pass::Forward, what.starts_with("fwd"), "{id}");
        assert_eq!(
            matches!(t.role, TensorRole::ParamGrad { .. }),
            what == "param_grad",
            "{id}"
        );
        n += 1;
    }
    assert!(n > 100);
    for bad in [
        "",
        "x",
        "x|",
        "x|fwd.output",
        "x|fwd.output.a",
        "x|sideways.0",
    ] {
        assert!(TensorId::parse(bad).is_none(), "{bad:?}");
    }
}
