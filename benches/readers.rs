//! Our safetensors reader beside Hugging Face's `safetensors` crate on the same file, in the
//! same run (`cargo bench --bench readers`; `docs/safetensors-reader.md` has the figures).
//!
//! * `open_4096`: validate the header of a file of 4,096 small tensors. Ours reads the header
//!   only; the crate needs the whole file in one buffer, read here with `std::fs::read`.
//! * `read_all_64MB`: read and decode every tensor of a 64 MiB BF16 file (16 tensors): ours
//!   one tensor at a time, the crate from the whole file in memory.

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ttrace::io::safetensors as ours;
use ttrace::Tensor;
use ttrace::{Format, Overflow};

fn write(path: &Path, count: usize, len: usize) -> u64 {
    let tensors: Vec<(String, Tensor)> = (0..count)
        .map(|i| {
            let v: Vec<f64> = (0..len).map(|k| ((k * 31 + i) % 97) as f64 / 8.0).collect();
            (
                format!("layers.{i}.w"),
                Tensor::rounded(&[len], v, Format::BF16, Overflow::Saturating).unwrap(),
            )
        })
        .collect();
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    ours::write(path, &named, &Default::default()).unwrap();
    std::fs::metadata(path).unwrap().len()
}

fn readers(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("ttrace-bench-readers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let small = dir.join("small.safetensors");
    write(&small, 4096, 16);
    let mut g = c.benchmark_group("open_4096");
    g.measurement_time(Duration::from_secs(5));
    g.bench_function("ttrace", |b| {
        b.iter(|| black_box(ours::SafetensorsFile::open(&small).unwrap().entries().len()))
    });
    g.bench_function("safetensors_crate", |b| {
        b.iter(|| {
            let bytes = std::fs::read(&small).unwrap();
            black_box(safetensors::SafeTensors::deserialize(&bytes).unwrap().len())
        })
    });
    g.finish();

    let big = dir.join("big.safetensors");
    let size = write(&big, 16, 2 << 20);
    let mut g = c.benchmark_group("read_all_64MB");
    g.throughput(Throughput::Bytes(size));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(10));
    g.bench_function("ttrace", |b| {
        b.iter(|| {
            let mut f = ours::SafetensorsFile::open(&big).unwrap();
            let names: Vec<String> = f.entries().keys().cloned().collect();
            let mut total = 0.0;
            for n in &names {
                total += f.read(n).unwrap().values()[0];
            }
            black_box(total)
        })
    });
    g.bench_function("safetensors_crate", |b| {
        b.iter(|| {
            let bytes = std::fs::read(&big).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let mut total = 0.0;
            for (_, view) in st.tensors() {
                total += ours::decode_values(view.data(), Format::BF16).unwrap()[0];
            }
            black_box(total)
        })
    });
    g.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, readers);
criterion_main!(benches);
