//! File formats read and written without model knowledge.
//!
//! Owns: the GGUF reader and writer (`gguf`).
//! May use: nothing.
//! Never uses: gpu, model, tokenizer, engine, server.

pub mod gguf;
