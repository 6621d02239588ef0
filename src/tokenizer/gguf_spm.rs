//! SentencePiece-style BPE from GGUF metadata (`tokenizer.ggml.model == "llama"`), with
//! llama.cpp's rules:
//!
//! - the text is first cut at special tokens: user-defined ones (token type 4) always,
//!   control and unknown ones (types 3, 2) only when special-token parsing is on; longer tokens
//!   are matched first;
//! - each remaining piece of text gets a leading space when `tokenizer.ggml.add_space_prefix`
//!   (default true) and it starts the text or follows a special token; spaces become U+2581 "▁";
//! - merging: start from single characters, repeatedly merge the adjacent pair whose
//!   concatenation is a token with the highest `tokenizer.ggml.scores` entry (ties: leftmost);
//! - a final piece that is not a token (a character outside the vocabulary) becomes its UTF-8
//!   bytes as `<0xNN>` tokens.
//!
//! Decoding goes through a `tokenizers` decoder chain: "▁" to space, `<0xNN>` runs back into
//! UTF-8, and one leading space stripped when the space prefix is on.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use anyhow::{anyhow, bail, Result};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;

use super::gguf_common::{
    add_typed_tokens, is_special_type, read_token_types, read_tokens, TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED,
};
use super::limited::{pieces_by, MAX_RUN_BYTES, PIECE_BYTES};
use crate::formats::gguf::GgufFile;

/// SentencePiece's escaped space, U+2581 LOWER ONE EIGHTH BLOCK.
const SPACE: &str = "\u{2581}";

/// The characters a long text may be cut before (see `Spm::cut_before`), of those where
/// texts are usually cut: the escaped space, line breaks, CJK full stops and commas.
fn safe_cuts<'a>(tokens: impl Iterator<Item = &'a String>) -> Vec<char> {
    let mut cuts = vec!['\u{2581}', '\n', '\u{3002}', '\u{FF0C}', '\u{3001}', '\u{FF01}', '\u{FF1F}'];
    for t in tokens {
        let mut prev = None;
        for c in t.chars() {
            if prev.is_some_and(|p| p != c) && cuts.contains(&c) {
                cuts.retain(|&k| k != c);
            }
            prev = Some(c);
        }
    }
    cuts
}

/// The encoder; the `tokenizers` tokenizer built next to it serves decoding and vocabulary look-ups.
pub(super) struct Spm {
    /// Token text -> id (the lowest id when a text repeats).
    vocab: HashMap<String, u32>,
    scores: Vec<f32>,
    /// Token id of each byte for the fallback.
    byte_tokens: Vec<Option<u32>>,
    unk_id: Option<u32>,
    add_space_prefix: bool,
    /// Characters before which a text may be cut (where the character before differs): no token
    /// holds another character followed by one of them, so no merge spans the cut and each side
    /// merges as it would in the whole text (long texts are encoded in pieces).
    cut_before: Vec<char>,
    /// Tokens matched whole in the text before merging: (text, id, only when parsing specials),
    /// longest first.
    specials: Vec<(String, u32, bool)>,
}

pub(super) struct Built {
    pub inner: tokenizers::Tokenizer,
    pub tokens: Vec<String>,
    pub spm: Spm,
    /// BOS/EOS ids: the file's, else llama.cpp's defaults for this model (1 and 2) when in range.
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
}

enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

pub(super) fn build(g: &GgufFile) -> Result<Built> {
    let p = g.path.display();
    let tokens = read_tokens(g)?;
    let n = tokens.len();
    let types = read_token_types(g, n)?;
    let scores = match g.get("tokenizer.ggml.scores") {
        None => vec![0.0; n],
        Some(v) => {
            let s = g.get_f32_array("tokenizer.ggml.scores").ok_or_else(|| {
                anyhow!("{p}: tokenizer.ggml.scores should be an array of numbers, found {}", v.type_name())
            })?;
            if s.len() != n {
                bail!("{p}: tokenizer.ggml.scores has {} entries but tokenizer.ggml.tokens has {n}", s.len());
            }
            s
        }
    };
    let add_space_prefix = match g.get("tokenizer.ggml.add_space_prefix") {
        None => true,
        Some(_) => g.require_bool("tokenizer.ggml.add_space_prefix")?,
    };

    let mut vocab = HashMap::with_capacity(n);
    for (i, t) in tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(i as u32);
    }
    let id_or_default = |key: &str, default: u32| -> Option<u32> {
        match g.get_u32(key) {
            Some(id) if (id as usize) < n => Some(id),
            _ => ((default as usize) < n).then_some(default),
        }
    };
    let unk_id = id_or_default("tokenizer.ggml.unknown_token_id", 0);
    let bos_id = id_or_default("tokenizer.ggml.bos_token_id", 1);
    let eos_id = id_or_default("tokenizer.ggml.eos_token_id", 2);

    let byte_tokens = (0..=255u8)
        .map(|b| {
            vocab.get(&format!("<0x{b:02X}>")).copied().or_else(|| {
                // As llama.cpp: a vocabulary without <0xNN> tokens may hold the byte itself.
                b.is_ascii().then(|| vocab.get(&(b as char).to_string()).copied()).flatten()
            })
        })
        .collect();

    let mut specials: Vec<(String, u32, bool)> = match &types {
        None => Vec::new(),
        Some(types) => tokens
            .iter()
            .zip(types)
            .enumerate()
            .filter(|(_, (t, &ty))| !t.is_empty() && (is_special_type(ty) || ty == TOKEN_TYPE_USER_DEFINED))
            .map(|(i, (t, &ty))| (t.clone(), i as u32, ty != TOKEN_TYPE_USER_DEFINED))
            .collect(),
    };
    specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));

    // The `tokenizers` side: vocabulary, added tokens and the decoder. Its model is never asked
    // to encode (it has no merges).
    let hf_vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let mut builder = BPE::builder().vocab_and_merges(hf_vocab, Vec::new()).byte_fallback(true);
    if let Some(unk) = unk_id {
        builder = builder.unk_token(tokens[unk as usize].clone());
    }
    let bpe = builder.build().map_err(|e| anyhow!("{p}: cannot build the vocabulary from tokenizer.ggml.*: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let space_to_blank = Replace::new(SPACE, " ").map_err(|e| anyhow!("{p}: decoder: {e}"))?;
    let mut steps: Vec<DecoderWrapper> =
        vec![space_to_blank.into(), ByteFallback::default().into(), Fuse::default().into()];
    if add_space_prefix {
        steps.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(steps)));
    let types = types.unwrap_or_else(|| vec![TOKEN_TYPE_NORMAL; n]);
    add_typed_tokens(&mut inner, &tokens, &types);

    let cut_before = safe_cuts(vocab.keys());
    let spm = Spm { vocab, scores, byte_tokens, unk_id, add_space_prefix, cut_before, specials };
    Ok(Built { inner, tokens, spm, bos_id, eos_id })
}

/// A candidate merge of two adjacent symbols.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text (a stale candidate no longer matches it).
    size: usize,
}

impl Ord for Bigram {
    /// Highest score first; among equal scores the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

/// A run of the text: its byte range and its neighbours in the current segmentation.
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    /// Whether a space is put before the text (and so stripped again by the decoder).
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Tokenize `text` (no BOS/EOS). See the module comment for the rules.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        let mut after_special = true;
        let mut piece = String::new();
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(s) => {
                    piece.clear();
                    if self.add_space_prefix && after_special {
                        piece.push_str(SPACE);
                    }
                    piece.push_str(&s.replace(' ', SPACE));
                    let cut = |t: &str, p: usize| {
                        let (Some(prev), Some(c)) = (t[..p].chars().next_back(), t[p..].chars().next()) else {
                            return false;
                        };
                        prev != c && self.cut_before.contains(&c)
                    };
                    for part in
                        pieces_by(&piece, PIECE_BYTES, MAX_RUN_BYTES, |t, p| t.is_char_boundary(p) && cut(t, p))?
                    {
                        self.encode_piece(part, &mut out)?;
                    }
                    after_special = false;
                }
            }
        }
        Ok(out)
    }

    /// Cut the text at special tokens, longest tokens first.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut fragments = if text.is_empty() { Vec::new() } else { vec![Fragment::Text(text)] };
        for (tok, id, needs_parse_special) in &self.specials {
            if *needs_parse_special && !parse_special {
                continue;
            }
            if !fragments.iter().any(|f| matches!(f, Fragment::Text(s) if s.contains(tok.as_str()))) {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                let Fragment::Text(mut rest) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(pos) = rest.find(tok.as_str()) {
                    if pos > 0 {
                        next.push(Fragment::Text(&rest[..pos]));
                    }
                    next.push(Fragment::Token(*id));
                    rest = &rest[pos + tok.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// Score-ordered merging of one escaped piece of text.
    fn encode_piece(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: Some(i + 1) });
        }
        let Some(last) = symbols.last_mut() else { return Ok(()) };
        last.next = None;

        let mut queue = BinaryHeap::new();
        let candidate = |symbols: &[Symbol], left: Option<usize>, right: Option<usize>| -> Option<Bigram> {
            let (left, right) = (left?, right?);
            let (l, r) = (&symbols[left], &symbols[right]);
            let merged = &text[l.start..r.start + r.len];
            let &id = self.vocab.get(merged)?;
            Some(Bigram { score: self.scores[id as usize], left, right, size: merged.len() })
        };
        for i in 1..symbols.len() {
            queue.extend(candidate(&symbols, Some(i - 1), Some(i)));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (&symbols[b.left], &symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            let right_next = r.next;
            symbols[b.left].len += symbols[b.right].len;
            symbols[b.right].len = 0;
            symbols[b.left].next = right_next;
            if let Some(n) = right_next {
                symbols[n].prev = Some(b.left);
            }
            queue.extend(candidate(&symbols, symbols[b.left].prev, Some(b.left)));
            queue.extend(candidate(&symbols, Some(b.left), right_next));
        }

        let mut at = Some(0);
        while let Some(i) = at {
            let s = &symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.vocab.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &byte in piece.as_bytes() {
                        match self.byte_tokens[byte as usize].or(self.unk_id) {
                            Some(id) => out.push(id),
                            None => bail!("byte 0x{byte:02X} has no token (no <0x{byte:02X}> and no unknown token)"),
                        }
                    }
                }
            }
            at = s.next;
        }
        Ok(())
    }
}
