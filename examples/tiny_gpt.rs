//! One training step of the tiny GPT under a recipe, with a summary of its trace.
//!
//! `cargo run --release --example tiny_gpt [recipe]` with recipe one of f64, fp32, bf16,
//! fp8-current, fp8-delayed, fp8-mx (default bf16).

use ttrace::engine::{Gpt, GptConfig};
use ttrace::Recipe;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let name = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "bf16".to_string());
    let recipe = Recipe::by_name(&name)?;
    let config = GptConfig::default();
    let mut model = Gpt::new(config.clone(), recipe)?;
    let start = std::time::Instant::now();
    let step = model.step()?;
    let elapsed = start.elapsed();
    println!(
        "tiny GPT: {} layers, hidden {}, {} heads, seq {}, batch {}, vocab {}; recipe {}",
        config.layers, config.hidden, config.heads, config.seq, config.batch, config.vocab, name
    );
    println!(
        "loss = {:.6} (ln vocab = {:.6}), step took {:.1?}",
        step.loss,
        (config.vocab as f64).ln(),
        elapsed
    );
    let t = &step.trace;
    let count = |p: &str| t.ids().filter(|id| id.contains(p)).count();
    println!(
        "trace: {} tensors ({} forward inputs/outputs, {} gradients, {} parameter gradients), all finite: {}",
        t.len(),
        count("|fwd."),
        count("|grad."),
        count("|param_grad"),
        t.entries().iter().all(|e| e.tensor.all_finite())
    );
    println!(
        "\n{:<44} {:>16} {:>6} {:>12}",
        "first and last entries", "shape", "fmt", "rms"
    );
    let entries = t.entries();
    for e in entries
        .iter()
        .take(6)
        .chain(entries.iter().rev().take(4).rev())
    {
        let v = e.tensor.values();
        let rms = (v.iter().map(|x| x * x).sum::<f64>() / v.len().max(1) as f64).sqrt();
        println!(
            "{:<44} {:>16} {:>6} {:>12.4e}",
            e.id,
            format!("{:?}", e.tensor.shape()),
            e.tensor.format().name(),
            rms
        );
    }
    Ok(())
}
