#[path = "../tests/zoo/mod.rs"]
mod zoo;
use ttrace::bounds::reduction_error;
use ttrace::*;
fn main() -> ttrace::Result<()> {
    for seed in 0..5u64 {
        let x = zoo::generate(
            zoo::Family::Constant,
            1,
            16384,
            seed,
            Format::F32,
            Format::F32,
        );
        let r = Accumulation::new(Format::F32, Format::F32, Order::Sequential);
        let c = Accumulation::new(
            Format::F32,
            Format::F32,
            Order::Blocked {
                block: 16,
                inner: BlockSum::Sequential,
            },
        );
        let ex = exact_sum(&x);
        let (er, ec) = (
            reduction_error(&x, &r, false)?,
            reduction_error(&x, &c, false)?,
        );
        println!(
            "seed {seed} c={}: Er {:e} (mean {:e} sd {:e}) Ec {:e} (mean {:e} sd {:e} tie {:e})",
            x[0],
            sum(&x, &r)? - ex,
            er.mean,
            er.variance.sqrt(),
            sum(&x, &c)? - ex,
            ec.mean,
            ec.variance.sqrt(),
            ec.tie_bound
        );
    }
    Ok(())
}
