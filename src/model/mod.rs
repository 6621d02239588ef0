//! Model hyper-parameters, weight loading (Hugging Face safetensors, GGUF) and the GPU forward.

pub mod config;
pub mod forward;
pub mod gguf;
pub mod harness;
pub mod loader;
pub mod ops;
pub mod synth;
pub mod tensor;
