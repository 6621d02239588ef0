//! torus-wgpu: an LLM inference engine whose GPU work is WGSL compute shaders run through wgpu.
//!
//! Layers, from the bottom: `gpu` (device, buffers, pipelines), `model` (weights, loaders,
//! forward pass), `tokenizer` (tokenizers + chat templates), `sampling`, `structured` (grammar
//! constraints for structured outputs, over the tokenizer), `engine` (generation),
//! `exec` (the executors: one device, layer stages across adapters and worker processes), `server` (OpenAI API),
//! `kv_events` (the prefix cache's changes published for KV-aware routers).
//! A module uses the ones below it: server -> engine -> exec -> model/kv -> gpu.

pub mod bench;
pub mod config;
pub mod engine;
pub mod exec;
pub mod formats;
pub mod gpu;
pub mod hub;
pub mod kv;
pub mod kv_events;
pub mod model;
pub mod ops;
pub mod sampling;
pub mod server;
pub mod shutdown;
pub mod spec;
pub mod structured;
pub mod tokenizer;
pub mod weights;
