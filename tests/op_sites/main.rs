//! Tensors the checker prices through the op registry's models (`papers/checking.md` §8): an
//! attention core's output (`attention`), a cross-entropy's loss and logits gradient (`loss`),
//! each against kernels written in its file and exact f64 values.

mod attention;
mod loss;
