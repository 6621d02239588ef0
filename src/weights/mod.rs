//! Weights as the kernels read them.
//!
//! Owns: GGUF's quantized blocks (`blocks`; the grid types in `grids`, their grids in `iq_grids`), the ternary types as Q2_K (`ternary`), Hugging Face's MXFP4 layout as GGUF blocks (`mxfp4_hf`), the tensors in GPU layout (`tensor`), and the upload of a
//! matrix to the GPU in row chunks that each fit one storage binding (`upload`).
//! May use: gpu, formats.
//! Never uses: model, ops, engine, server.

pub mod blocks;
pub mod grids;
#[rustfmt::skip]
pub mod iq_grids;
pub mod mxfp4_hf;
pub mod tensor;
pub mod ternary;
pub mod upload;
