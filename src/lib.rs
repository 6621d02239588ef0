//! torus-wgpu: an LLM inference engine whose GPU work is WGSL compute shaders run through wgpu.
//!
//! Layers, from the bottom: `gpu` (device, buffers, pipelines), `model` (weights, loaders,
//! forward pass), `tokenizer` (tokenizers + chat templates), `engine` (generation loop).

pub mod gpu;
pub mod model;
pub mod tokenizer;
