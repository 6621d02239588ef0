pub mod gguf;
