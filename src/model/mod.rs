//! Model hyper-parameters, weight loading (Hugging Face safetensors, GGUF) and the GPU forward.
//!
//! Owns: ModelConfig, the weight loaders, the architecture recipes, memory and step plans, the step validator, Model::run.
//! May use: ops, weights, formats, kv, gpu, config, sampling.
//! Never uses: exec, engine, server, tokenizer.

pub mod builder;
pub mod config;
mod emit;
pub mod fit;
pub mod forward;
pub mod gemma;
pub mod gemma4;
pub mod gemma4_moe;
pub mod gptoss;
mod hf_weights;
pub mod layers;
pub mod llama;
pub mod loader;
pub mod moe;
pub mod mtp;
pub mod plan;
pub mod ple;
pub mod profile;
pub mod qwen35;
pub mod record;
pub mod recurrent;
pub mod rope_scaling;
pub mod scratch;
pub mod step;
pub mod stream;
pub mod synth;
pub mod synth_gemma4;
pub mod synth_hybrid;
pub mod synth_tiny;
pub mod validate;

pub use forward::{Model, SharedIo};
pub use plan::{kv_block_bytes, kv_blocks, kv_chunking, MemoryPlan};
pub use step::{sub_steps, StageOutput, StepInput, StepLimits};
pub use validate::StepBounds;
