//! Data parallelism: rayon's global pool with the `parallel` feature, the calling thread
//! without it. Every caller's result is independent of the number of threads (each item is
//! computed alone and results keep their order), so the feature changes speed only.

#[cfg(feature = "parallel")]
use rayon::prelude::*;

/// The number of threads items are spread over (1 without the `parallel` feature).
pub(crate) fn threads() -> usize {
    #[cfg(feature = "parallel")]
    return rayon::current_num_threads().max(1);
    #[cfg(not(feature = "parallel"))]
    1
}

/// `f(item)` for every item, consuming them.
pub(crate) fn for_each_owned<T: Send>(items: Vec<T>, f: impl Fn(T) + Sync + Send) {
    #[cfg(feature = "parallel")]
    items.into_par_iter().for_each(f);
    #[cfg(not(feature = "parallel"))]
    items.into_iter().for_each(f);
}

/// `f((i, chunk))` for the i-th run of `size` consecutive elements of `data` (the last run may
/// be shorter).
pub(crate) fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    size: usize,
    f: impl Fn((usize, &mut [T])) + Sync + Send,
) {
    #[cfg(feature = "parallel")]
    data.par_chunks_mut(size).enumerate().for_each(f);
    #[cfg(not(feature = "parallel"))]
    data.chunks_mut(size).enumerate().for_each(f);
}

/// `[f(item) for item in items]`, in order.
pub fn map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
    #[cfg(feature = "parallel")]
    return items.par_iter().map(f).collect();
    #[cfg(not(feature = "parallel"))]
    items.iter().map(f).collect()
}

/// `(a(), b())`, the two run side by side where threads are free.
pub(crate) fn join<A: Send, B: Send>(
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B + Send,
) -> (A, B) {
    #[cfg(feature = "parallel")]
    return rayon::join(a, b);
    #[cfg(not(feature = "parallel"))]
    (a(), b())
}
