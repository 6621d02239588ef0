//! Weights as the kernels read them.
//!
//! Owns: the quantized tensor formats and their repacking (`tensor`), and the upload of a
//! matrix to the GPU in row chunks that each fit one storage binding (`upload`).
//! May use: gpu, formats.
//! Never uses: model, ops, engine, server.

pub mod tensor;
pub mod upload;
