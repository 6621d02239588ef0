//! Tokenizing with a limit on the number of tokens, so that a huge text is refused without
//! the memory and time of tokenizing all of it (the `tokenizers` crate keeps ~300 bytes per
//! token while it encodes: 4 MiB of short words took 575 MB and 2.3 s).
//!
//! Two guards:
//! - a lower bound: no token is longer than the vocabulary's longest, so a text of `n` bytes
//!   has at least `n / longest` tokens; past the limit, it is refused at once;
//! - pieces: a byte-level BPE tokenizer without a normalizer (every GGUF `gpt2` tokenizer, and
//!   Hugging Face's GPT-2, Llama 3 and Qwen tokenizers) encodes a long text in pieces of about
//!   [`PIECE_BYTES`], cut only where its pre-tokenizer splits anyway (between a letter and a
//!   single space before a letter, or after a newline that follows and precedes non-space), and
//!   stops once the limit is passed. The pieces' tokens are the whole text's: the tests compare
//!   both on long texts for every tokenizer they load.

use super::Tokenizer;
use anyhow::Result;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;

/// About how much text is encoded at once when a text is cut in pieces.
pub const PIECE_BYTES: usize = 16 << 10;

/// The text has more tokens than allowed (at least `at_least`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooLong {
    pub limit: usize,
    pub at_least: usize,
}

impl std::fmt::Display for TooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the text has more than {} tokens (at least {})", self.limit, self.at_least)
    }
}

impl std::error::Error for TooLong {}

/// The most bytes of text encoded at once: a longer run without a place to cut it (see
/// [`cut_here`]) is refused ([`UncutRun`]), so that no text costs the encoder more than about
/// this many tokens' worth of memory at a time (~300 bytes each in `tokenizers`).
pub const MAX_RUN_BYTES: usize = 8 * PIECE_BYTES;

/// The text has a run of more than [`MAX_RUN_BYTES`] without a place to cut it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UncutRun {
    /// Where the run starts (bytes into the text).
    pub at: usize,
}

impl std::fmt::Display for UncutRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the text has more than {} KiB without a word boundary (from byte {}); send such text in shorter runs",
            MAX_RUN_BYTES >> 10,
            self.at
        )
    }
}

impl std::error::Error for UncutRun {}

/// What a character is to the pre-tokenizers of byte-level BPE (GPT-2's, Llama 3's and Qwen's
/// expressions): only characters whose Unicode class is certain get one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Surely `\p{L}`.
    Letter,
    /// An ASCII digit.
    Digit,
    /// Surely neither `\p{L}`, `\p{N}` nor whitespace (ASCII and common CJK punctuation).
    Punct,
    /// A space or tab (not a line break).
    Space,
    /// A line break or anything else.
    Other,
}

fn class(c: char) -> Class {
    match c {
        'a'..='z' | 'A'..='Z' => Class::Letter,
        '0'..='9' => Class::Digit,
        ' ' | '\t' => Class::Space,
        c if c.is_ascii_punctuation() => Class::Punct,
        '\u{C0}'..='\u{24F}' if c != '\u{D7}' && c != '\u{F7}' => Class::Letter,
        '\u{391}'..='\u{3A1}' | '\u{3A3}'..='\u{3A9}' | '\u{3B1}'..='\u{3C9}' | '\u{410}'..='\u{44F}' => Class::Letter,
        '\u{3041}'..='\u{3096}' | '\u{30A1}'..='\u{30FA}' | '\u{3400}'..='\u{4DBF}' => Class::Letter,
        '\u{4E00}'..='\u{9FEF}' | '\u{AC00}'..='\u{D7A3}' => Class::Letter,
        '\u{3001}'..='\u{3003}' | '\u{3008}'..='\u{3011}' | '\u{2010}'..='\u{2027}' => Class::Punct,
        '\u{FF01}'..='\u{FF0F}' | '\u{FF1A}'..='\u{FF20}' => Class::Punct,
        _ => Class::Other,
    }
}

/// Whether the text may be cut before byte `p` (a character boundary): the pre-tokenizers of
/// byte-level BPE split there whatever comes after. No piece of theirs holds a letter or digit
/// followed by something else (`a| b`, `a|,`, `7|a`, `a|7`), punctuation followed by a digit
/// or a space (`,|7`, `.| `; not a line break, which Qwen's joins to it), or spans a line break
/// between two non-space characters (`a\n|b`).
fn cut_here(text: &str, p: usize) -> bool {
    let b = text.as_bytes();
    if p < 2 || p >= b.len() || !text.is_char_boundary(p) {
        return false;
    }
    let (Some(prev), Some(cur)) = (text[..p].chars().next_back(), text[p..].chars().next()) else { return false };
    let solid = |c: u8| !c.is_ascii_whitespace() && c.is_ascii();
    if prev == '\n' {
        return solid(b[p - 2]) && solid(b[p]);
    }
    match (class(prev), class(cur)) {
        (Class::Letter, Class::Digit | Class::Punct | Class::Space) => true,
        (Class::Digit, Class::Letter | Class::Punct | Class::Space) => true,
        (Class::Letter | Class::Digit, Class::Other) => cur == '\n',
        (Class::Punct, Class::Digit | Class::Space) => true,
        _ => false,
    }
}

/// The pieces of `text`: about `piece` bytes each, cut only where [`cut_here`] allows; a run of
/// more than `max_run` bytes with nowhere to cut is an error.
#[cfg(test)]
fn pieces(text: &str, piece: usize, max_run: usize) -> Result<Vec<&str>, UncutRun> {
    pieces_by(text, piece, max_run, cut_here)
}

/// [`pieces`] where `cut(text, p)` says whether the text may be cut before byte `p`.
pub(super) fn pieces_by(
    text: &str,
    piece: usize,
    max_run: usize,
    cut_here: impl Fn(&str, usize) -> bool,
) -> Result<Vec<&str>, UncutRun> {
    let mut out = Vec::new();
    let mut start = 0;
    while text.len() - start > piece {
        let target = start + piece;
        let back = (start + piece / 2..=target).rev().find(|&p| cut_here(text, p));
        let cut = back.or_else(|| (target..text.len().min(start + max_run)).find(|&p| cut_here(text, p)));
        match cut {
            Some(cut) => {
                out.push(&text[start..cut]);
                start = cut;
            }
            None if text.len() - start > max_run => return Err(UncutRun { at: start }),
            None => break,
        }
    }
    out.push(&text[start..]);
    Ok(out)
}

impl Tokenizer {
    /// The longest token's text in bytes (its vocabulary string, which is never shorter).
    fn longest_token(&self) -> usize {
        *self.max_token_bytes.get_or_init(|| {
            let vocab = self.inner.get_vocab(true);
            vocab.keys().map(|t| t.len()).max().unwrap_or(1).max(1)
        })
    }

    /// Whether byte `p` of `text` falls inside an added token's text (`<|im_start|>` and such,
    /// which the tokenizer matches before any pre-tokenizer splits).
    fn inside_added(&self, text: &str, p: usize) -> bool {
        let added = self.added_texts.get_or_init(|| {
            let mut v: Vec<String> = self
                .inner
                .get_added_tokens_decoder()
                .values()
                .map(|t| t.content.clone())
                .filter(|t| t.len() > 1)
                .collect();
            v.sort();
            v.dedup();
            v
        });
        let b = text.as_bytes();
        added.iter().any(|t| (1..t.len()).any(|k| p >= k && b[p - k..].starts_with(t.as_bytes())))
    }

    /// Whether a long text is encoded in pieces (see the module docs): pieces give the whole
    /// text's tokens for this tokenizer.
    pub fn tokenizes_in_pieces(&self) -> bool {
        if self.spm.is_some() || self.inner.get_normalizer().is_some() {
            return false;
        }
        let plain = |p: &PreTokenizerWrapper| match p {
            PreTokenizerWrapper::ByteLevel(b) => !b.add_prefix_space,
            PreTokenizerWrapper::Split(_) | PreTokenizerWrapper::Digits(_) => true,
            _ => false,
        };
        match self.inner.get_pre_tokenizer() {
            Some(PreTokenizerWrapper::ByteLevel(b)) => !b.add_prefix_space,
            Some(PreTokenizerWrapper::Sequence(s)) => {
                s.as_ref().iter().all(plain)
                    && s.as_ref().iter().any(|p| matches!(p, PreTokenizerWrapper::ByteLevel(_)))
            }
            _ => false,
        }
    }

    /// [`tokenize`](Self::tokenize), or [`TooLong`] (as the error) once the text is known to
    /// have more than `max_tokens` tokens, without tokenizing the rest of it.
    pub fn tokenize_limited(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        max_tokens: usize,
    ) -> Result<Vec<u32>> {
        let at_least = text.len() / self.longest_token();
        if at_least > max_tokens {
            return Err(TooLong { limit: max_tokens, at_least }.into());
        }
        let parts = if text.len() > PIECE_BYTES && self.tokenizes_in_pieces() {
            pieces_by(text, PIECE_BYTES, MAX_RUN_BYTES, |t, p| cut_here(t, p) && !self.inside_added(t, p))?
        } else {
            vec![text]
        };
        let mut ids = Vec::new();
        let n = parts.len();
        for (i, part) in parts.into_iter().enumerate() {
            // BOS with the first piece, EOS with the last.
            let mut got = self.tokenize(part, false, parse_special)?;
            if add_special && i == 0 && self.add_bos {
                ids.extend(self.bos_id);
            }
            ids.append(&mut got);
            if add_special && i + 1 == n && self.add_eos {
                ids.extend(self.eos_id);
            }
            if ids.len() > max_tokens {
                return Err(TooLong { limit: max_tokens, at_least: ids.len() }.into());
            }
        }
        Ok(ids)
    }

    /// The first `max_tokens` tokens of [`encode`](Self::encode)'s (Ollama's `truncate`). The
    /// text is first cut to what that many tokens can span (no token is longer than the
    /// vocabulary's longest), so a long text costs no more than a short one; where that cut
    /// falls inside a word that starts among the kept tokens, the last of them may differ from
    /// the whole text's.
    pub fn encode_prefix(&self, text: &str, max_tokens: usize) -> Result<Vec<u32>> {
        let mut end = text.len().min(max_tokens.saturating_add(2).saturating_mul(self.longest_token()));
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let mut ids = self.tokenize_limited(&text[..end], false, true, usize::MAX)?;
        if let (true, Some(bos)) = (self.add_bos, self.bos_id) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        ids.truncate(max_tokens);
        Ok(ids)
    }

    /// [`encode`](Self::encode) within `max_tokens` (see [`tokenize_limited`](Self::tokenize_limited)).
    pub fn encode_limited(&self, text: &str, max_tokens: usize) -> Result<Vec<u32>> {
        let mut ids = self.tokenize_limited(text, false, true, max_tokens)?;
        if let (true, Some(bos)) = (self.add_bos, self.bos_id) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        if ids.len() > max_tokens {
            return Err(TooLong { limit: max_tokens, at_least: ids.len() }.into());
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cut_only_between_words() {
        let text = "alpha beta\ngamma  delta\n\nepsilon 12 34 zeta".repeat(50);
        let parts = pieces(&text, 64, 8 * 64).unwrap();
        assert!(parts.len() > 10, "{}", parts.len());
        assert_eq!(parts.concat(), text);
        for w in parts.windows(2) {
            let joined = [w[0], w[1]].concat();
            assert!(cut_here(&joined, w[0].len()), "cut between {:?} and {:?}", w[0], w[1]);
        }
        assert_eq!(pieces("short", 64, 512).unwrap(), vec!["short"]);
        // Nowhere to cut: one piece up to the longest run, an error past it.
        assert_eq!(pieces(&"9".repeat(500), 64, 512).unwrap().len(), 1);
        assert_eq!(pieces(&"9".repeat(1000), 64, 512), Err(UncutRun { at: 0 }));
        let long = format!("{} {}", "a".repeat(100), "b".repeat(1000));
        assert_eq!(pieces(&long, 64, 512), Err(UncutRun { at: 100 }));
    }

    #[test]
    fn where_text_may_be_cut() {
        let at = |s: &str| s.find('|').unwrap();
        for yes in [
            "ab| cd",
            "ab|, cd",
            "ab|7 x",
            "12|ab",
            "ab|\nc",
            "x\n|y",
            "1,|2",
            "a.| b",
            "中文|，中文",
            "中文| x",
            "héllo| x",
        ] {
            assert!(cut_here(&yes.replace('|', ""), at(yes)), "{yes:?}");
        }
        for no in ["a|b", "1|2", " |a", "a |b", ",|a", ".|\nb", "\r|\n", "中|文", "，|中", "a|\u{300}x", "\u{300}| x"]
        {
            assert!(!cut_here(&no.replace('|', ""), at(no)), "{no:?}");
        }
    }
}
