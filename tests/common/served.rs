//! A model directory served over HTTP for the chat-output tests: a temporary copy with another
//! chat template, and a server on 127.0.0.1 with a given reasoning parser.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use torus_wgpu::config::EngineConfig;
use torus_wgpu::server::reasoning::ReasoningChoice;
use torus_wgpu::server::{model_id_for_path, start, ServerConfig, ServerHandle};

/// A directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of the Hugging Face directory `src` (named by `tag`) with `template` as its chat
/// template and its config.json changed by `config`.
pub fn with_template(src: &Path, tag: &str, template: &str, config: impl FnOnce(&mut Value)) -> TempDir {
    let dir = std::env::temp_dir().join(format!("torus-template-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["generation_config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let read = |f: &str| -> Value { serde_json::from_slice(&std::fs::read(src.join(f)).unwrap()).unwrap() };
    let mut c = read("config.json");
    config(&mut c);
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&c).unwrap()).unwrap();
    let mut t = read("tokenizer_config.json");
    t["chat_template"] = json!(template);
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec(&t).unwrap()).unwrap();
    TempDir(dir)
}

/// `path` served with `cfg` and reasoning parser `parser`: the handle and the `.../v1` base URL.
pub async fn serve(path: &Path, cfg: &EngineConfig, parser: ReasoningChoice) -> (ServerHandle, String) {
    let engine = super::start_engine_async(path, cfg).await;
    let mut scfg = ServerConfig::new(model_id_for_path(path), cfg);
    scfg.reasoning_parser = parser;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let h = start(listener, scfg, Some(engine)).unwrap();
    let base = format!("http://{}/v1", h.addr);
    (h, base)
}

/// A streamed chat completion's body: its (reasoning, content) deltas joined, and its finish
/// reason.
pub fn joined_stream(text: &str) -> (String, String, String) {
    let (mut reasoning, mut content, mut finish) = (String::new(), String::new(), String::new());
    for ev in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(ev).unwrap();
        let c = &v["choices"][0];
        reasoning.push_str(c["delta"]["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (reasoning, content, finish)
}
