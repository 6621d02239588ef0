//! Metadata shared by the GGUF tokenizer models: the token list and llama.cpp's token types.

use anyhow::{bail, Result};
use tokenizers::AddedToken;

use crate::formats::gguf::GgufFile;

/// llama.cpp token types (`tokenizer.ggml.token_type`).
pub const TOKEN_TYPE_NORMAL: i32 = 1;
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
pub const TOKEN_TYPE_CONTROL: i32 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// `tokenizer.ggml.tokens`, index = id.
pub fn read_tokens(g: &GgufFile) -> Result<Vec<String>> {
    let p = g.path.display();
    let tokens: Vec<String> = g.require_str_array("tokenizer.ggml.tokens")?.into_iter().map(str::to_string).collect();
    if tokens.is_empty() {
        bail!("{p}: tokenizer.ggml.tokens is empty");
    }
    if u32::try_from(tokens.len()).is_err() {
        bail!("{p}: tokenizer.ggml.tokens has {} entries, too many", tokens.len());
    }
    Ok(tokens)
}

/// `tokenizer.ggml.token_type` (optional), checked against the number of tokens.
pub fn read_token_types(g: &GgufFile, n_tokens: usize) -> Result<Option<Vec<i32>>> {
    if g.get("tokenizer.ggml.token_type").is_none() {
        return Ok(None);
    }
    let t = g.require_i32_array("tokenizer.ggml.token_type")?;
    if t.len() != n_tokens {
        bail!(
            "{}: tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {n_tokens}",
            g.path.display(),
            t.len()
        );
    }
    Ok(Some(t))
}

/// Whether llama.cpp matches a token of this type in text before tokenizing the rest, and whether
/// only when special-token parsing is on (control and unknown tokens) or always (user-defined).
pub fn is_special_type(ty: i32) -> bool {
    ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_UNKNOWN
}

/// Register control/unknown tokens as special added tokens (matched in text when special-token
/// parsing is on, skipped by `decode(skip_special)`) and user-defined tokens as plain added
/// tokens (always matched in text, always decoded), as llama.cpp does.
pub fn add_typed_tokens(inner: &mut tokenizers::Tokenizer, tokens: &[String], types: &[i32]) {
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (tok, &ty) in tokens.iter().zip(types) {
        if tok.is_empty() {
            continue;
        }
        if is_special_type(ty) {
            special.push(AddedToken::from(tok.clone(), true));
        } else if ty == TOKEN_TYPE_USER_DEFINED {
            user.push(AddedToken::from(tok.clone(), false).normalized(false));
        }
    }
    inner.add_special_tokens(&special);
    inner.add_tokens(&user);
}
