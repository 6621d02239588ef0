//! Weights as the kernels read them.
//!
//! Owns: GGUF's quantized blocks (`blocks`), the tensors in GPU layout (`tensor`), and the upload of a
//! matrix to the GPU in row chunks that each fit one storage binding (`upload`).
//! May use: gpu, formats.
//! Never uses: model, ops, engine, server.

pub mod blocks;
pub mod tensor;
pub mod upload;
