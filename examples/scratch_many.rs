use std::collections::HashMap;
use ttrace::engine::Tensor;
use ttrace::shard::{Layout, Mesh};
use ttrace::Format;
fn main() {
    let n: usize = std::env::args().nth(1).unwrap().parse().unwrap();
    let dir = std::path::PathBuf::from(std::env::args().nth(2).unwrap());
    let entries: Vec<(String, Layout, Vec<Tensor>)> = (0..n)
        .map(|i| {
            let id = format!("layers.{}.m{}|fwd.output.0", i % 10, i);
            let t = Tensor::from_vec(&[4], vec![i as f64, 1.0, 2.0, 3.0], Format::F32).unwrap();
            (id, Layout::replicated(), vec![t])
        })
        .collect();
    for side in ["reference", "candidate"] {
        ttrace::io::write_trace_dir(&dir.join(side), &Mesh::single(), None, &entries, &HashMap::new(), &HashMap::new()).unwrap();
    }
}
