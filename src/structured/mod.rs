//! Structured outputs (constrained decoding): a request names a grammar (a JSON schema, any JSON
//! object, a regular expression, a list of choices or a Lark grammar), and each of its sampled
//! tokens must keep the output a prefix of a sentence of that grammar.
//!
//! The grammar work is the `llguidance` library's (the one vLLM, SGLang, llama.cpp and
//! mistral.rs use): an Earley parser over a lazily built lexer that computes the set of allowed
//! tokens from a trie of the model's own token bytes, typically in well under a millisecond per
//! token, and that compiles JSON schemas itself. This module builds its tokenizer environment
//! from our [`Tokenizer`] ([`Grammars`], once per engine), compiles a request's
//! [`ConstraintSpec`] into a [`Constraint`] (before the request is submitted, so a bad grammar is
//! a 400), and gives the engine each step's mask (one bit per vocabulary id) and the accepted
//! tokens. The mask reaches the GPU with the row's sampling parameters (`SampleParams::mask`).
//!
//! Owns: grammars for constrained decoding and their token masks.
//! May use: tokenizer.
//! Never uses: engine, model, gpu, server.

pub mod bounds;
pub mod gbnf;

use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, bail, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against a schema. `strict`: keywords the library does not support are an
    /// error; otherwise they are ignored (the output still follows the rest of the schema).
    JsonSchema { schema: Value, strict: bool },
    /// Text matching a regular expression (Rust `regex` syntax), as a whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect: `start: ...`, regexes in `/.../`, JSON schemas
    /// inline with `%json`).
    Lark(String),
}

/// Regex metacharacters (those regex-syntax escapes): escaping them is always valid.
fn escape_regex(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl ConstraintSpec {
    /// The library's grammar for this constraint.
    fn grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            ConstraintSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(openai_json(serde_json::json!({"type": "object"}), true))
            }
            ConstraintSpec::JsonSchema { schema, strict } => {
                if !(schema.is_object() || schema.is_boolean()) {
                    bail!("the JSON schema must be an object or a boolean");
                }
                TopLevelGrammar::from_json_schema(openai_json(schema.clone(), *strict))
            }
            ConstraintSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            ConstraintSpec::Choice(list) => {
                if list.is_empty() {
                    bail!("the list of choices is empty");
                }
                let alts: Vec<String> = list.iter().map(|c| escape_regex(c)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alts.join("|")))
            }
            ConstraintSpec::Lark(g) => {
                if g.trim().is_empty() {
                    bail!("the grammar is empty");
                }
                TopLevelGrammar::from_lark(g.clone())
            }
        })
    }
}

/// JSON output the way OpenAI writes it: `", "` and `": "` between items, no other whitespace
/// (a small model let loose on free whitespace may never close the object). A schema's own
/// `x-guidance` options win.
pub fn openai_json(mut schema: Value, strict: bool) -> Value {
    if let Some(o) = schema.as_object_mut() {
        if !o.contains_key("x-guidance") {
            let opts = JsonCompileOptions {
                item_separator: ", ".into(),
                key_separator: ": ".into(),
                whitespace_flexible: false,
                lenient: !strict,
                ..Default::default()
            };
            if let Ok(v) = serde_json::to_value(&opts) {
                o.insert("x-guidance".into(), v);
            }
        }
    }
    schema
}

/// The library's view of our tokenizer: the trie of every token's bytes. Tokenizing text is
/// only needed for forced tokens, which the engine does not use (so greedy is enough).
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Compiles constraints for one tokenizer. Built once per engine (the trie of a 150k-token
/// vocabulary takes tens of milliseconds); `Send + Sync`.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("vocab", &self.vocab).finish()
    }
}

impl Grammars {
    pub fn new(tok: &Tokenizer) -> Result<Grammars> {
        let words = tok.token_bytes()?;
        let eos = tok.eos_token_ids();
        let Some(&first) = eos.first() else {
            bail!("the tokenizer names no end-of-sequence token; structured outputs need one");
        };
        let info = TokRxInfo::new(words.len() as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: llguidance::toktrie::TokEnv = Arc::new(Env { trie });
        let mut factory = ParserFactory::new_simple(&env)?;
        // Warnings and errors come back as values; nothing goes to stderr.
        factory.quiet();
        Ok(Grammars { factory, vocab: words.len() })
    }

    /// Compiles `spec` into a fresh constraint, or says why it cannot (for a 400): first its
    /// size and depth are checked ([`bounds`]), then it is compiled on a thread of its own
    /// whose stack holds any constraint within those bounds, whatever thread calls this.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint, String> {
        bounds::check(spec)?;
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("torus-grammar".into())
                .stack_size(bounds::COMPILE_STACK_BYTES)
                .spawn_scoped(scope, || self.compile_here(spec))
                .map_err(|e| format!("cannot start the grammar compiler: {e}"))?
                .join()
                .unwrap_or_else(|_| Err("the grammar library failed on this grammar".to_string()))
        })
    }

    /// Checks `spec`'s bounds, then compiles it on a thread of its own (as [`compile`]) and
    /// hands the result to `done` there, without waiting: the caller waits as it likes (the
    /// server, with a time limit, off its request threads).
    ///
    /// [`compile`]: Self::compile
    pub fn compile_detached(
        self: Arc<Self>,
        spec: ConstraintSpec,
        done: impl FnOnce(Result<Constraint, String>) + Send + 'static,
    ) -> Result<(), String> {
        bounds::check(&spec)?;
        std::thread::Builder::new()
            .name("torus-grammar".into())
            .stack_size(bounds::COMPILE_STACK_BYTES)
            .spawn(move || done(self.compile_here(&spec)))
            .map(|_| ())
            .map_err(|e| format!("cannot start the grammar compiler: {e}"))
    }

    fn compile_here(&self, spec: &ConstraintSpec) -> Result<Constraint, String> {
        let run = || -> Result<Constraint> {
            let grammar = spec.grammar()?;
            let parser = self.factory.create_parser(grammar)?;
            let mut matcher = Matcher::new(Ok(parser));
            // Some errors (an unsatisfiable schema, a regex that matches nothing) show only
            // when the first mask is computed.
            let mask = matcher.compute_mask().map_err(|e| anyhow!("{e}"))?;
            if let Some(e) = matcher.get_error() {
                bail!("{e}");
            }
            if mask.is_zero() {
                bail!("the grammar allows no output");
            }
            Ok(Constraint { matcher, vocab: self.vocab })
        };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
            Ok(r) => r.map_err(|e| format!("{e:#}")),
            Err(_) => Err("the grammar library failed on this grammar".to_string()),
        }
    }

    /// [`compile`](Self::compile) for a JSON schema (`strict`: unsupported keywords are errors).
    pub fn json_schema(&self, schema: Value, strict: bool) -> Result<Constraint, String> {
        self.compile(&ConstraintSpec::JsonSchema { schema, strict })
    }
}

/// One sequence's grammar state: which tokens may come next, advanced by each accepted token.
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
}

impl Clone for Constraint {
    /// An independent copy (its own parser state), e.g. for another choice of the same request.
    fn clone(&self) -> Self {
        Constraint { matcher: self.matcher.deep_clone(), vocab: self.vocab }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl Constraint {
    /// The tokens allowed next, as `words` u32 words (bit `i % 32` of word `i / 32` for token
    /// `i`; ids past the tokenizer's vocabulary are never allowed). Errs when the grammar state
    /// is broken or allows nothing.
    pub fn mask(&mut self, words: usize) -> Result<Vec<u32>, String> {
        let v = self.matcher.compute_mask_or_eos().map_err(|e| format!("structured output: {e}"))?;
        let src = v.as_slice();
        let mut out = vec![0u32; words];
        let n = src.len().min(words);
        out[..n].copy_from_slice(&src[..n]);
        // The library's last word may carry bits past its vocabulary.
        let vocab = self.vocab.min(words * 32);
        if !vocab.is_multiple_of(32) && vocab / 32 < words {
            out[vocab / 32] &= (1u32 << (vocab % 32)) - 1;
            out[vocab / 32 + 1..].fill(0);
        }
        if out.iter().all(|&w| w == 0) {
            return Err("structured output: the grammar allows no next token".into());
        }
        Ok(out)
    }

    /// Advances past a sampled token (one the last mask allowed).
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| format!("structured output: {e}"))
    }

    /// The grammar is complete and allows nothing more (the sequence ends with `stop`).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The output so far is a whole sentence of the grammar (end-of-sequence is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regex_escape_keeps_literals() {
        assert_eq!(escape_regex("a.b|c"), "a\\.b\\|c");
        assert_eq!(escape_regex("x (y)"), "x \\(y\\)");
    }
}
