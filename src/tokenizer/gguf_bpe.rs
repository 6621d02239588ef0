//! Rebuild a byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) from GGUF metadata.
//!
//! The pre-tokenizer is named by `tokenizer.ggml.pre`. Each name stands for the list of regexes
//! llama.cpp splits on for it (applied one after the other, each to the pieces the previous one
//! left, matches and the text between them both kept as pieces), followed by GPT-2's byte-level
//! mapping. No normalizer: llama.cpp does not normalize (so e.g. `qwen2` here does not apply the
//! NFC that Qwen2's tokenizer.json asks for).

use anyhow::{anyhow, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use super::gguf_common::{add_typed_tokens, read_token_types, read_tokens};
use crate::formats::gguf::GgufFile;

/// GPT-2's split (llama.cpp's form: no trailing `|\s+`; text that no alternative matches is kept
/// as a piece of its own anyway).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's split, with the case-insensitive contractions spelled out as llama.cpp does (so
/// `(?i)` case folding cannot match e.g. U+017F LATIN SMALL LETTER LONG S).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// gpt-oss's o200k split (llama.cpp's `gpt-4o`): words split before capitals, optional
/// contractions attached, up to three digits, punctuation runs with trailing newlines or slashes.
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek LLM's letter runs: an optional whitespace, then cased letters (Unicode Lu/Ll/Lt as
/// listed by DeepSeek's tokenizer.json).
const DEEPSEEK_LLM_LETTERS: &str = concat!(
    r"\s?[",
    "A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}",
    "\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}",
    "\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}",
    "\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}",
    "\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}",
    "\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}",
    "\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}",
    "\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}",
    "\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}",
    "\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}",
    "\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}",
    "\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}",
    "\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}",
    "\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}",
    "]+"
);

/// DeepSeek LLM's punctuation runs (ASCII, fullwidth forms, curly quotes, CJK punctuation).
const DEEPSEEK_LLM_PUNCT: &str = "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+";

/// DeepSeek's CJK runs (CJK ideographs, U+0800..U+4E00, Hangul syllables).
const DEEPSEEK_CJK: &str = "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+";

/// One supported `tokenizer.ggml.pre` value (and the names llama.cpp treats the same way).
struct PreTokenizer {
    names: &'static [&'static str],
    /// Applied in order; see the module comment.
    regexes: &'static [&'static str],
    /// A word that is itself a token is taken whole without running the merges (Llama 3).
    ignore_merges: bool,
    /// `add_bos_token` when the GGUF does not say.
    add_bos: bool,
}

const PRE_TOKENIZERS: &[PreTokenizer] = &[
    PreTokenizer {
        names: &["llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral"],
        regexes: &[LLAMA3],
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizer { names: &["gpt-4o"], regexes: &[GPT4O], ignore_merges: false, add_bos: false },
    PreTokenizer { names: &["dbrx", "smaug-bpe"], regexes: &[LLAMA3], ignore_merges: false, add_bos: false },
    PreTokenizer {
        names: &["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"],
        regexes: &[QWEN2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
        regexes: &[r"\p{N}", GPT2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"],
        regexes: &[GPT2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["falcon"],
        regexes: &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["deepseek-llm"],
        regexes: &["[\r\n]", DEEPSEEK_LLM_LETTERS, DEEPSEEK_LLM_PUNCT, r"\s+$", DEEPSEEK_CJK, r"\p{N}+"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        names: &["deepseek-coder"],
        regexes: &["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        // llama.cpp's fallback, also used when tokenizer.ggml.pre is absent.
        names: &["default"],
        regexes: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
];

/// Every accepted `tokenizer.ggml.pre` value, for error messages and docs.
pub fn supported_pre_tokenizers() -> Vec<&'static str> {
    PRE_TOKENIZERS.iter().flat_map(|p| p.names.iter().copied()).collect()
}

pub(super) struct Built {
    pub inner: tokenizers::Tokenizer,
    /// Token strings, index = id.
    pub tokens: Vec<String>,
    /// `add_bos_token` when the file does not set it.
    pub add_bos_default: bool,
}

pub(super) fn build(g: &GgufFile) -> Result<Built> {
    let p = g.path.display();
    let pre_name = match g.get("tokenizer.ggml.pre") {
        None => "default",
        Some(_) => g.require_str("tokenizer.ggml.pre")?,
    };
    let pre = PRE_TOKENIZERS.iter().find(|t| t.names.contains(&pre_name)).ok_or_else(|| {
        anyhow!(
            "{p}: pre-tokenizer {pre_name:?} (tokenizer.ggml.pre) is not supported; supported: {}",
            supported_pre_tokenizers().join(", ")
        )
    })?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(pre.regexes.len() + 1);
    for re in pre.regexes {
        let split = Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| anyhow!("{p}: cannot build the {pre_name} pre-tokenizer: {e}"))?;
        steps.push(split.into());
    }
    // The regexes did the splitting; ByteLevel only maps bytes to its printable alphabet.
    steps.push(ByteLevel::new(false, true, false).into());

    let tokens = read_tokens(g)?;
    let token_types = read_token_types(g, tokens.len())?;
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
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| anyhow!("{p}: cannot build the BPE model from tokenizer.ggml.*: {e}"))?;

    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(Sequence::new(steps)));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    if let Some(types) = &token_types {
        add_typed_tokens(&mut inner, &tokens, types);
    }
    Ok(Built { inner, tokens, add_bos_default: pre.add_bos })
}
