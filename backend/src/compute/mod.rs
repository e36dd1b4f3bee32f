//! Compute kernels. `cpu` is the reference: plain f32, threaded with rayon, exact
//! enough to check other backends against.

pub mod cpu;
pub mod cuda;
pub mod fp4;
