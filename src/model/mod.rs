//! Model hyper-parameters, weight loading (Hugging Face safetensors, GGUF) and the GPU forward.
//!
//! Owns: ModelConfig, the model families (families/: one recipe file each, and their table), the
//! shared blocks (blocks/), the weight loaders, the layer recipe, memory and step plans, the step validator, Model::run.
//! May use: ops, weights, formats, kv, gpu, config, sampling.
//! Never uses: exec, engine, server, tokenizer.

pub mod blocks;
pub mod builder;
pub mod config;
mod emit;
pub mod families;
pub mod fit;
pub mod forward;
mod hf_weights;
pub mod layers;
pub mod loader;
pub mod plan;
pub mod profile;
pub mod recipe;
pub mod record;
pub mod rope_scaling;
pub mod scratch;
pub mod step;
pub mod stream;
pub mod synth;
pub mod synth_tiny;
pub mod validate;

pub use forward::{Model, SharedIo};
pub use plan::{kv_block_bytes, kv_blocks, kv_chunking, MemoryPlan};
pub use step::{sub_steps, StageOutput, StepInput, StepLimits};
pub use validate::StepBounds;
