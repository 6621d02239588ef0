//! Gemma 4's GGUF tokenizer (`tokenizer.ggml.model == "gemma4"`), with llama.cpp's rules (its
//! LLAMA_VOCAB_PRE_TYPE_GEMMA4): byte-fallback BPE whose merges apply by rank (the file's
//! `tokenizer.ggml.merges`; its scores are placeholders), over text whose spaces became U+2581
//! "▁", with no prefix space, the text first split into runs of newlines and runs of the rest;
//! a piece outside the vocabulary becomes its UTF-8 bytes as `<0xNN>` tokens; control and
//! user-defined tokens are matched before (llama.cpp's token types). BOS is always added, as
//! llama.cpp does for Gemma 4.
//!
//! Decoding: "▁" back to spaces, `<0xNN>` runs back into UTF-8 (Hugging Face's GemmaTokenizer
//! chain, without a stripped leading space).

use anyhow::{anyhow, bail, Result};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::SplitDelimiterBehavior;

use super::gguf_common::{add_typed_tokens, read_token_types, read_tokens};
use crate::formats::gguf::GgufFile;

/// SentencePiece's escaped space, U+2581.
const SPACE: &str = "\u{2581}";

pub(super) struct Built {
    pub inner: tokenizers::Tokenizer,
    /// Token strings, index = id.
    pub tokens: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
}

/// `tokenizer.ggml.merges` as pairs: each entry cut at its first space after the first character
/// (llama.cpp's rule, so a merge of a lone space token still parses).
fn merges(g: &GgufFile) -> Result<Vec<(String, String)>> {
    let p = g.path.display();
    g.require_str_array("tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let at = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(at, _)| at);
            at.map(|at| (m[..at].to_string(), m[at + 1..].to_string())).ok_or_else(|| {
                anyhow!("{p}: tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space")
            })
        })
        .collect()
}

pub(super) fn build(g: &GgufFile) -> Result<Built> {
    let p = g.path.display();
    let tokens = read_tokens(g)?;
    let types = read_token_types(g, tokens.len())?;
    let in_range = |key: &str| g.get_u32(key).filter(|&id| (id as usize) < tokens.len());
    let (bos_id, eos_id, unk_id) = (
        in_range("tokenizer.ggml.bos_token_id"),
        in_range("tokenizer.ggml.eos_token_id"),
        in_range("tokenizer.ggml.unknown_token_id"),
    );
    if bos_id.is_none() {
        bail!("{p}: a gemma4 tokenizer needs tokenizer.ggml.bos_token_id (llama.cpp always adds BOS for it)");
    }
    let vocab: Vocab = tokens.iter().enumerate().rev().map(|(i, t)| (t.clone(), i as u32)).collect();
    let mut bpe = BPE::builder().vocab_and_merges(vocab, merges(g)?).byte_fallback(true).fuse_unk(true);
    if let Some(unk) = unk_id {
        bpe = bpe.unk_token(tokens[unk as usize].clone());
    }
    let bpe = bpe.build().map_err(|e| anyhow!("{p}: cannot build the BPE model from tokenizer.ggml.*: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let escape = Replace::new(" ", SPACE).map_err(|e| anyhow!("{p}: normalizer: {e}"))?;
    inner.with_normalizer(Some(escape));
    let newlines = Split::new(SplitPattern::Regex("\n+".into()), SplitDelimiterBehavior::Isolated, false)
        .map_err(|e| anyhow!("{p}: pre-tokenizer: {e}"))?;
    inner.with_pre_tokenizer(Some(newlines));
    let space = Replace::new(SPACE, " ").map_err(|e| anyhow!("{p}: decoder: {e}"))?;
    let steps: Vec<DecoderWrapper> = vec![space.into(), ByteFallback::default().into(), Fuse::default().into()];
    inner.with_decoder(Some(DecoderSequence::new(steps)));
    if let Some(types) = &types {
        add_typed_tokens(&mut inner, &tokens, types);
    }
    Ok(Built { inner, tokens, bos_id, eos_id })
}
