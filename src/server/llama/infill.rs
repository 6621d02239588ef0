//! Fill-in-the-middle prompts, for code completion in editors: llama-server's `POST /infill`
//! (`input_prefix`, `input_suffix`, `input_extra` [{filename, text}], `prompt`: the text already
//! typed at the cursor; every `/completion` field besides) and OpenAI's `suffix` on
//! `/v1/completions`.
//!
//! The prompt is built from the tokenizer's own FIM tokens, prefix-suffix-middle: Qwen2.5-Coder's
//! `<|fim_prefix|>` / `<|fim_suffix|>` / `<|fim_middle|>` (with `<|repo_name|>` and
//! `<|file_sep|>`, the other files of `input_extra` come first, as the model was trained),
//! StarCoder's and SmolLM's `<fim_prefix>` ..., CodeLlama's `<PRE>` `<SUF>` `<MID>`. A model
//! without them is a 400. User text is tokenized without special tokens. What does not fit the
//! context beside the answer is cut: the other files first, then the prefix from its start and
//! the suffix from its end (three quarters of the room to the prefix).

use crate::engine::EngineHandle;
use crate::server::error::ApiError;
use crate::tokenizer::Tokenizer;

/// A fill-in-the-middle request.
#[derive(Clone, Debug, Default)]
pub(crate) struct Fim {
    pub prefix: String,
    pub suffix: String,
    /// Text already typed at the cursor (after the middle token).
    pub middle: String,
    /// Other files: (name, text).
    pub extra: Vec<(String, String)>,
    /// Tokens to leave for the answer (None: a quarter of the context).
    pub answer: Option<usize>,
}

/// A model's FIM tokens.
struct FimTokens {
    pre: u32,
    suf: u32,
    mid: u32,
    /// Repository-level tokens, where the model has them.
    repo: Option<(u32, u32)>,
}

fn fim_tokens(tok: &Tokenizer) -> Option<FimTokens> {
    const FAMILIES: [[&str; 5]; 4] = [
        ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"],
        ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"],
        ["<PRE>", "<SUF>", "<MID>", "", ""],
        ["\u{2581}<PRE>", "\u{2581}<SUF>", "\u{2581}<MID>", "", ""],
    ];
    FAMILIES.iter().find_map(|[p, s, m, r, f]| {
        let id = |t: &str| if t.is_empty() { None } else { tok.token_to_id(t) };
        Some(FimTokens { pre: id(p)?, suf: id(s)?, mid: id(m)?, repo: id(r).zip(id(f)) })
    })
}

impl Fim {
    /// The prompt's token ids for `e`'s model, within its context.
    pub(crate) fn tokens(&self, e: &EngineHandle, param: &str) -> Result<Vec<u32>, ApiError> {
        let tok = &e.tokenizer;
        let t = fim_tokens(tok).ok_or_else(|| {
            ApiError::invalid(
                param,
                "this model has no fill-in-the-middle tokens (such as <|fim_prefix|>); use a FIM model such as \
                 Qwen2.5-Coder",
            )
        })?;
        let ctx = e.info.max_model_len();
        let answer = self.answer.unwrap_or(ctx / 4).clamp(1, ctx / 2);
        let budget = ctx.saturating_sub(answer + 1);
        let enc = |s: &str| {
            tok.tokenize_limited(s, false, false, usize::MAX)
                .map_err(|err| ApiError::invalid(param, format!("{err:#}")))
        };
        let bos: Vec<u32> = if tok.add_bos() { tok.bos_token_id().into_iter().collect() } else { vec![] };
        let mut extra = Vec::new();
        if let (Some((repo, sep)), false) = (t.repo, self.extra.is_empty()) {
            extra.push(repo);
            extra.extend(enc("project\n")?);
            for (name, text) in &self.extra {
                extra.push(sep);
                extra.extend(enc(&format!("{name}\n{text}"))?);
            }
            extra.push(sep);
            extra.extend(enc("file\n")?);
        }
        let (mut pre, mut suf, mid) = (enc(&self.prefix)?, enc(&self.suffix)?, enc(&self.middle)?);
        let fixed = bos.len() + 3 + mid.len();
        if fixed + extra.len() + pre.len() + suf.len() > budget {
            extra.clear();
        }
        let room = budget.saturating_sub(fixed);
        if pre.len() + suf.len() > room {
            // Three quarters to the prefix (its end, nearest the cursor), the rest to the suffix
            // (its start); a side that needs less leaves the other more.
            let keep_suf = suf.len().min(room - (room * 3 / 4).min(pre.len()));
            let keep_pre = pre.len().min(room - keep_suf);
            pre.drain(..pre.len() - keep_pre);
            suf.truncate(keep_suf);
        }
        if fixed > budget {
            return Err(ApiError::invalid(param, "the text at the cursor (`prompt`) leaves no room in the context"));
        }
        let mut ids = bos;
        ids.extend(extra);
        ids.push(t.pre);
        ids.extend(pre);
        ids.push(t.suf);
        ids.extend(suf);
        ids.push(t.mid);
        ids.extend(mid);
        Ok(ids)
    }
}
