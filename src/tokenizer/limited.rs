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

/// Whether the text may be cut before byte `p`: the pre-tokenizers of byte-level BPE split
/// there whatever follows (`a| b`, `a\n|b`).
fn cut_here(b: &[u8], p: usize) -> bool {
    if p < 2 || p + 1 >= b.len() {
        return false;
    }
    let word = |c: u8| c.is_ascii_alphabetic();
    let solid = |c: u8| !c.is_ascii_whitespace() && c.is_ascii();
    (word(b[p - 1]) && b[p] == b' ' && word(b[p + 1])) || (b[p - 1] == b'\n' && solid(b[p - 2]) && solid(b[p]))
}

/// The pieces of `text`: about `piece` bytes each, cut only where [`cut_here`] allows (a text
/// without such places stays whole).
pub(super) fn pieces(text: &str, piece: usize) -> Vec<&str> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    while b.len() - start > piece {
        let target = start + piece;
        let back = (start + piece / 2..=target).rev().find(|&p| cut_here(b, p));
        let cut = back.or_else(|| (target..b.len().min(start + 8 * piece)).find(|&p| cut_here(b, p)));
        let Some(cut) = cut else { break };
        out.push(&text[start..cut]);
        start = cut;
    }
    out.push(&text[start..]);
    out
}

impl Tokenizer {
    /// The longest token's text in bytes (its vocabulary string, which is never shorter).
    fn longest_token(&self) -> usize {
        *self.max_token_bytes.get_or_init(|| {
            let vocab = self.inner.get_vocab(true);
            vocab.keys().map(|t| t.len()).max().unwrap_or(1).max(1)
        })
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
        let parts =
            if text.len() > PIECE_BYTES && self.tokenizes_in_pieces() { pieces(text, PIECE_BYTES) } else { vec![text] };
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
        let parts = pieces(&text, 64);
        assert!(parts.len() > 10, "{}", parts.len());
        assert_eq!(parts.concat(), text);
        for w in parts.windows(2) {
            let (a, b) = (w[0].as_bytes(), w[1].as_bytes());
            let joined = [a, b].concat();
            assert!(cut_here(&joined, a.len()), "cut between {:?} and {:?}", w[0], w[1]);
        }
        // Nowhere to cut: one piece.
        assert_eq!(pieces(&"9".repeat(1000), 64).len(), 1);
        assert_eq!(pieces("short", 64), vec!["short"]);
    }
}
