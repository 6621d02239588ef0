//! Tokenizer (Hugging Face `tokenizers` under the hood), chat templates (minijinja with Python
//! string methods) and an incremental detokenizer for streaming.
//!
//! Two sources:
//! - a Hugging Face model directory ([`Tokenizer::from_hf_dir`]): `tokenizer.json`,
//!   `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`, `config.json`;
//! - a GGUF file ([`Tokenizer::from_gguf`]): the tokenizer is rebuilt in code from the
//!   `tokenizer.ggml.*` metadata alone (no tensor is read, so vocab-only files work): byte-level
//!   BPE (`gpt2`, with the pre-tokenizer named by `tokenizer.ggml.pre`) or SentencePiece BPE
//!   (`llama`), following llama.cpp's rules.
//!
//! Owns: tokenizers (Hugging Face and GGUF), chat templates, incremental detokenization.
//! May use: formats.
//! Never uses: model, gpu, engine, server.

mod chat;
pub mod cli;
pub use bytes::SPECIAL_TOKEN_MARKER;
mod bytes;
mod detok;
mod gguf_bpe;
mod gguf_common;
mod gguf_gemma4;
mod gguf_spm;
mod limited;
pub use detok::{IncrementalDecoder, MAX_HELD};
pub use limited::TooLong;

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::formats::gguf::GgufFile;
use chat::ChatTemplate;
pub use gguf_bpe::supported_pre_tokenizers;

/// The `tokenizer.ggml.model` values [`Tokenizer::from_gguf`] accepts.
pub const SUPPORTED_GGUF_MODELS: &[&str] = &["gpt2", "llama", "gemma4"];

/// One chat message as given to the chat template. The optional fields carry tool calling's
/// history: an assistant message's `tool_calls` (OpenAI's shape, with `function.arguments` as a
/// JSON object, as Hugging Face templates expect) and a `tool` message's `tool_call_id` and
/// `name`; absent ones are left out of the template's view (undefined, not none).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Json>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's thinking, given back by the client (vLLM's and Qwen3's templates'
    /// `reasoning_content`; Anthropic's `thinking` blocks, Ollama's `thinking`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }
}

/// A tokenizer plus everything around it that generation needs: BOS policy, stop tokens and the
/// chat template. `Send + Sync`; share it behind an `Arc`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special-token parsing off (special-token text is tokenized as plain text;
    /// user-defined tokens still match), made on first use.
    plain: OnceLock<tokenizers::Tokenizer>,
    /// SentencePiece encoder of a GGUF `llama` tokenizer (then `inner` only decodes).
    spm: Option<gguf_spm::Spm>,
    /// Where it came from (a path), for error messages.
    source: String,
    bos_id: Option<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    /// The EOS appended by [`tokenize`](Self::tokenize) with `add_special` (when `add_eos`).
    eos_id: Option<u32>,
    add_eos: bool,
    vocab_size: usize,
    chat_template: Option<ChatTemplate>,
    /// The name of the built-in chat template used because the model has none.
    builtin_template: Option<&'static str>,
    /// The longest token's text in bytes, made on first use (see `limited`).
    max_token_bytes: OnceLock<usize>,
    /// The added tokens' texts (special tokens and such), made on first use: a long text is
    /// never cut inside one (see `limited`).
    added_texts: OnceLock<Vec<String>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("sentencepiece", &self.spm.is_some())
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn read_json(path: &Path) -> Result<Option<Json>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: cannot read: {e}", path.display()))?;
    let v = serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", path.display()))?;
    Ok(Some(v))
}

/// A special token in tokenizer_config.json: `"<s>"` or `{"content": "<s>", ...}`.
fn token_content(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

/// `eos_token_id` as an int or a list of ints.
fn json_ids(v: Option<&Json>) -> Vec<u32> {
    match v {
        Some(Json::Number(n)) => n.as_u64().and_then(|n| u32::try_from(n).ok()).into_iter().collect(),
        Some(Json::Array(a)) => a.iter().filter_map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect(),
        _ => Vec::new(),
    }
}

fn push_unique(v: &mut Vec<u32>, id: u32) {
    if !v.contains(&id) {
        v.push(id);
    }
}

/// gpt-oss's harmony vocabulary (`<|return|>` and `<|call|>` both present): both end
/// generation, and `<|end|>` does not (it ends one message, the thinking, and the answer
/// follows), whatever the file's end-of-text ids say, as llama.cpp treats it.
fn harmony_stops(eos_ids: &mut Vec<u32>, id_of: impl Fn(&str) -> Option<u32>) {
    let (Some(ret), Some(call)) = (id_of("<|return|>"), id_of("<|call|>")) else { return };
    push_unique(eos_ids, ret);
    push_unique(eos_ids, call);
    if let Some(end) = id_of("<|end|>") {
        eos_ids.retain(|&id| id != end);
    }
}

impl Tokenizer {
    /// The tokenizer of a model: a Hugging Face directory or a .gguf file.
    pub fn from_path(path: &Path) -> Result<Self> {
        if !path.exists() {
            anyhow::bail!("{}: no such file or directory", path.display());
        }
        if path.is_dir() {
            Self::from_hf_dir(path)
        } else {
            Self::from_gguf(&GgufFile::open(path)?)
        }
    }

    /// Load from a Hugging Face model directory.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow!("{}: cannot load tokenizer: {e}", tok_path.display()))?;
        let source = dir.display().to_string();

        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = read_json(&cfg_path)?.unwrap_or(Json::Null);
        let bos_token = cfg.get("bos_token").and_then(token_content);
        let eos_token = cfg.get("eos_token").and_then(token_content);

        let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let (add_bos, bos_id) = match cfg.get("add_bos_token").and_then(|v| v.as_bool()) {
            Some(add) => (add && bos_id.is_some(), bos_id),
            // Not configured: see whether the tokenizer.json post-processor prepends a token.
            None => match detect_post_processor_bos(&inner) {
                Some(id) => (true, Some(id)),
                None => (false, bos_id),
            },
        };

        // Chat template: chat_template.jinja, then tokenizer_config.json, then chat_template.json.
        let jinja_path = dir.join("chat_template.jinja");
        let template_src = if jinja_path.exists() {
            Some(
                std::fs::read_to_string(&jinja_path)
                    .map_err(|e| anyhow!("{}: cannot read: {e}", jinja_path.display()))?,
            )
        } else if let Some(t) = cfg.get("chat_template").and_then(pick_template) {
            Some(t)
        } else {
            read_json(&dir.join("chat_template.json"))?
                .as_ref()
                .and_then(|v| v.get("chat_template"))
                .and_then(pick_template)
        };

        // Stop tokens: generation_config.json, else config.json; plus the tokenizer's eos token.
        let mut eos_ids =
            json_ids(read_json(&dir.join("generation_config.json"))?.as_ref().and_then(|g| g.get("eos_token_id")));
        if eos_ids.is_empty() {
            eos_ids = json_ids(read_json(&dir.join("config.json"))?.as_ref().and_then(|c| c.get("eos_token_id")));
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            push_unique(&mut eos_ids, id);
        }
        harmony_stops(&mut eos_ids, |t| inner.token_to_id(t));

        let eos_id = eos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let add_eos = cfg.get("add_eos_token").and_then(|v| v.as_bool()).unwrap_or(false) && eos_id.is_some();
        let bos_token = bos_token.or_else(|| bos_id.and_then(|id| inner.id_to_token(id)));
        let vocab_size = inner.get_vocab(true).values().copied().max().map_or(0, |m| m as usize + 1);
        Ok(Tokenizer {
            inner,
            plain: OnceLock::new(),
            spm: None,
            source,
            bos_id,
            bos_token,
            eos_token,
            eos_ids,
            add_bos,
            eos_id,
            add_eos,
            vocab_size,
            chat_template: template_src.map(ChatTemplate::new),
            builtin_template: None,
            max_token_bytes: OnceLock::new(),
            added_texts: OnceLock::new(),
        })
    }

    /// Build the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata (tensors are
    /// not needed). `tokenizer.ggml.model` is `gpt2` (byte-level BPE) or `llama` (SentencePiece).
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let source = g.path.display().to_string();
        let model = g.require_str("tokenizer.ggml.model")?;
        let (inner, tokens, spm, bos_id, eos_id, add_bos_default) = match model {
            "gpt2" => {
                let b = gguf_bpe::build(g)?;
                let in_range = |id: Option<u32>| id.filter(|&id| (id as usize) < b.tokens.len());
                let bos = in_range(g.get_u32("tokenizer.ggml.bos_token_id"));
                let eos = in_range(g.get_u32("tokenizer.ggml.eos_token_id"));
                (b.inner, b.tokens, None, bos, eos, b.add_bos_default)
            }
            "llama" => {
                let b = gguf_spm::build(g)?;
                (b.inner, b.tokens, Some(b.spm), b.bos_id, b.eos_id, true)
            }
            "gemma4" => {
                let b = gguf_gemma4::build(g)?;
                (b.inner, b.tokens, None, b.bos_id, b.eos_id, true)
            }
            other => anyhow::bail!(
                "{source}: tokenizer model {other:?} (tokenizer.ggml.model) is not supported; supported: \
                 \"gpt2\" (byte-level BPE), \"llama\" (SentencePiece BPE), \"gemma4\" (Gemma 4's BPE)"
            ),
        };
        // llama.cpp adds BOS for Gemma 4 whatever the file says.
        let force_bos = model == "gemma4";
        let token_text = |id: Option<u32>| id.and_then(|id| tokens.get(id as usize).cloned());
        let add_bos =
            (force_bos || g.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(add_bos_default)) && bos_id.is_some();
        let add_eos = g.get_bool("tokenizer.ggml.add_eos_token").unwrap_or(false) && eos_id.is_some();
        let mut eos_ids = Vec::new();
        eos_ids.extend(eos_id);
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = g.get_u32(key) {
                if (id as usize) < tokens.len() {
                    push_unique(&mut eos_ids, id);
                }
            }
        }
        // Gemma's end of turn ends generation, as llama.cpp treats it, also where the file
        // names no end-of-turn token.
        // Gemma 4's end of turn likewise.
        for end in ["<end_of_turn>", "<turn|>"] {
            if let Some(id) = tokens.iter().position(|t| t == end) {
                push_unique(&mut eos_ids, id as u32);
            }
        }
        harmony_stops(&mut eos_ids, |t| tokens.iter().position(|x| x == t).map(|i| i as u32));
        let arch = g.get_str("general.architecture").unwrap_or("");
        let (template, builtin_template) = match g.get_str("tokenizer.chat_template") {
            Some(t) => (Some(ChatTemplate::new(t.to_string())), None),
            None => match chat::builtin_template(arch) {
                Some((name, src)) => (Some(ChatTemplate::new(src.to_string())), Some(name)),
                None => (None, None),
            },
        };
        Ok(Tokenizer {
            inner,
            plain: OnceLock::new(),
            spm,
            source,
            bos_id,
            bos_token: token_text(bos_id),
            eos_token: token_text(eos_id),
            eos_ids,
            add_bos,
            eos_id,
            add_eos,
            vocab_size: tokens.len(),
            chat_template: template,
            builtin_template,
            max_token_bytes: OnceLock::new(),
            added_texts: OnceLock::new(),
        })
    }

    /// Tokenize `text`. Special tokens written in the text (e.g. `<|im_start|>`) become their
    /// ids. BOS is prepended only when the model asks for it (`add_bos`) and the text does not
    /// already start with it (a chat template that writes `{{ bos_token }}` is not doubled).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode_raw(text)?;
        if let (true, Some(bos)) = (self.add_bos, self.bos_id) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Tokenize `text` without ever adding BOS (or any post-processor tokens); special tokens
    /// written in the text become their ids.
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenize(text, false, true)
    }

    /// Tokenize as llama.cpp's `llama_tokenize` does. `add_special`: prepend BOS when the model
    /// adds one (`add_bos`) and append EOS when it adds one (`add_eos`), without looking at the
    /// text. `parse_special`: control tokens written in the text (e.g. `<|im_start|>`) become
    /// their ids; when off they are tokenized as plain text. User-defined tokens always match.
    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if add_special && self.add_bos {
            ids.extend(self.bos_id);
        }
        match &self.spm {
            Some(spm) => ids.extend(spm.encode(text, parse_special).map_err(|e| anyhow!("tokenization failed: {e}"))?),
            None => {
                let tok = if parse_special {
                    &self.inner
                } else {
                    self.plain.get_or_init(|| {
                        let mut t = self.inner.clone();
                        t.set_encode_special_tokens(true);
                        t
                    })
                };
                let enc = tok.encode(text, false).map_err(|e| anyhow!("tokenization failed: {e}"))?;
                ids.extend_from_slice(enc.get_ids());
            }
        }
        if add_special && self.add_eos {
            ids.extend(self.eos_id);
        }
        Ok(ids)
    }

    /// Detokenize. Unknown ids are skipped; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        self.inner.decode(ids, skip_special).unwrap_or_default()
    }

    /// The text one token adds in the middle of a longer text (for logprobs): like
    /// `decode(&[id], false)`, except that a SentencePiece token keeps its leading space, which
    /// `decode` strips at the start of a text (the space prefix added at encoding).
    pub fn token_text(&self, id: u32) -> String {
        let s = self.decode(&[id], false);
        let strips = self.spm.as_ref().is_some_and(|spm| spm.add_space_prefix());
        match self.inner.id_to_token(id) {
            Some(t) if strips && (t.starts_with('\u{2581}') || t == "<0x20>") => format!(" {s}"),
            _ => s,
        }
    }

    /// Render the model's chat template (variables `messages`, `add_generation_prompt`,
    /// `bos_token`, `eos_token`; function `raise_exception`; Python string/dict methods).
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// [`apply_chat_template`](Self::apply_chat_template) with the template variable `tools`
    /// (a list of OpenAI tool objects) set when `tools` is given.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_kwargs(messages, tools, add_generation_prompt, None)
    }

    /// [`apply_chat_template_with_tools`](Self::apply_chat_template_with_tools) with further
    /// template variables (a request's `chat_template_kwargs`); they never replace `messages`,
    /// `tools`, `add_generation_prompt` or the special tokens.
    pub fn apply_chat_template_kwargs(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        kwargs: Option<&serde_json::Map<String, Json>>,
    ) -> Result<String> {
        // No file path in these errors: they reach HTTP clients.
        let t = self.chat_template.as_ref().ok_or_else(|| anyhow!("the model has no chat template"))?;
        let (bos, eos) = (self.bos_token.as_deref(), self.eos_token.as_deref());
        t.render(messages, tools, add_generation_prompt, bos, eos, kwargs).context("chat template")
    }

    /// The chat template's source, if the model has one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_ref().map(|t| t.source.as_str())
    }

    /// The built-in chat template in use because the model file has none (`gemma`), if any.
    pub fn builtin_template(&self) -> Option<&'static str> {
        self.builtin_template
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Whether the chat template renders tool definitions itself: its source mentions the
    /// `tools` variable (Qwen2.5's, Llama 3.1's, Hermes' do; SmolLM2's does not).
    pub fn chat_template_supports_tools(&self) -> bool {
        self.chat_template.as_ref().is_some_and(|t| t.mentions_tools)
    }

    /// Token ids that end generation (eos, and end-of-turn tokens where the model names them).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Whether [`encode`](Self::encode) prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether [`tokenize`](Self::tokenize) with `add_special` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// One more than the largest token id (model vocabulary and added tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token's vocabulary string (byte-level form, e.g. `Ġthe`), not decoded text.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether the id is an added special token (`<|im_start|>`, `<|endoftext|>`, ...).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some_and(|t| self.inner.get_added_vocabulary().is_special_token(&t))
    }

    /// The underlying `tokenizers` tokenizer. For a GGUF SentencePiece (`llama`) tokenizer it
    /// holds the vocabulary, added tokens and decoder but does not encode like [`encode`](Self::encode).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// `chat_template` in tokenizer_config.json: a string, or a list of `{name, template}` (pick
/// "default", else the first).
fn pick_template(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => {
            let named = |name: &str| {
                list.iter()
                    .find(|e| e.get("name").and_then(|n| n.as_str()) == Some(name))
                    .and_then(|e| e.get("template"))
                    .and_then(|t| t.as_str())
            };
            named("default")
                .or_else(|| list.first().and_then(|e| e.get("template")).and_then(|t| t.as_str()))
                .map(str::to_string)
        }
        _ => None,
    }
}

/// If the tokenizer.json post-processor prepends exactly one token to a plain text, that token.
fn detect_post_processor_bos(inner: &tokenizers::Tokenizer) -> Option<u32> {
    let plain = inner.encode("a", false).ok()?;
    let with = inner.encode("a", true).ok()?;
    let (p, w) = (plain.get_ids(), with.get_ids());
    (w.len() == p.len() + 1 && w[1..] == *p).then(|| w[0])
}

#[cfg(test)]
mod harmony_tests {
    use super::harmony_stops;

    #[test]
    fn harmony_vocabularies_stop_at_return_and_call_not_at_end() {
        let vocab = ["<|endoftext|>", "<|return|>", "<|call|>", "<|end|>", "x"];
        let id_of = |t: &str| vocab.iter().position(|v| *v == t).map(|i| i as u32);
        let mut eos = vec![0, 3];
        harmony_stops(&mut eos, id_of);
        assert_eq!(eos, [0, 1, 2]);
        // Without both markers nothing changes.
        let mut eos = vec![3];
        harmony_stops(&mut eos, |t| (t == "<|end|>").then_some(3));
        assert_eq!(eos, [3]);
    }
}
