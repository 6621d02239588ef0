//! Rebuild a byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` metadata.

use anyhow::{anyhow, bail, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::model::gguf::GgufFile;

/// llama.cpp token types.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Qwen2's pre-tokenizer split (contractions, letters, single digits, punctuation, newlines,
/// whitespace).
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub(super) struct Built {
    pub inner: tokenizers::Tokenizer,
    /// Token strings, index = id.
    pub tokens: Vec<String>,
}

pub(super) fn build(g: &GgufFile) -> Result<Built> {
    let p = g.path.display();
    let model = g.require_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!("{p}: tokenizer model {model:?} is not supported (only \"gpt2\", byte-level BPE)");
    }
    let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        "smollm" => Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])
        .into(),
        "qwen2" => {
            let split = Split::new(SplitPattern::Regex(QWEN2_PATTERN.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| anyhow!("{p}: cannot build the qwen2 pre-tokenizer: {e}"))?;
            Sequence::new(vec![split.into(), ByteLevel::new(false, false, false).into()]).into()
        }
        "gpt2" | "default" => ByteLevel::new(false, true, true).into(),
        other => bail!(
            "{p}: pre-tokenizer {other:?} (tokenizer.ggml.pre) is not supported (supported: smollm, qwen2, gpt2, default)"
        ),
    };

    let tokens: Vec<String> = g.require_str_array("tokenizer.ggml.tokens")?.into_iter().map(str::to_string).collect();
    if tokens.is_empty() {
        bail!("{p}: tokenizer.ggml.tokens is empty");
    }
    if u32::try_from(tokens.len()).is_err() {
        bail!("{p}: tokenizer.ggml.tokens has {} entries, too many", tokens.len());
    }
    let token_types = match g.get("tokenizer.ggml.token_type") {
        None => None,
        Some(_) => {
            let t = g.require_i32_array("tokenizer.ggml.token_type")?;
            if t.len() != tokens.len() {
                bail!(
                    "{p}: tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                    t.len(),
                    tokens.len()
                );
            }
            Some(t)
        }
    };
    let merges = g
        .require_str_array("tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).ok_or_else(|| {
                anyhow!("{p}: tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space")
            })
        })
        .collect::<Result<Vec<_>>>()?;

    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| anyhow!("{p}: cannot build the BPE model from tokenizer.ggml.*: {e}"))?;

    let mut inner = tokenizers::Tokenizer::new(bpe);
    if pre == "qwen2" {
        inner.with_normalizer(Some(NFC));
    }
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevelDecoder::default()));

    if let Some(types) = &token_types {
        // Control tokens are special (matched in text, skipped by decode(skip_special));
        // user-defined tokens are matched in text and always decoded, as llama.cpp does.
        let mut special = Vec::new();
        let mut user = Vec::new();
        for (tok, &ty) in tokens.iter().zip(types) {
            if tok.is_empty() {
                continue;
            }
            match ty {
                TOKEN_TYPE_CONTROL => special.push(AddedToken::from(tok.clone(), true)),
                TOKEN_TYPE_USER_DEFINED => user.push(AddedToken::from(tok.clone(), false).normalized(false)),
                _ => {}
            }
        }
        inner.add_special_tokens(&special);
        inner.add_tokens(&user);
    }

    Ok(Built { inner, tokens })
}
