//! The streaming detokenizer.

use super::Tokenizer;

/// Most ids held back for an incomplete character (or for text not visible yet) before their
/// text is released anyway, with U+FFFD for what is broken: a UTF-8 character takes at most 4
/// byte tokens, and waiting longer would only make every step re-decode a growing window (a
/// model pushed by `logit_bias` to emit continuation bytes forever would cost quadratic time).
pub const MAX_HELD: usize = 8;

/// Streaming detokenizer for one sequence: feed ids one at a time, get text as soon as it is
/// complete. Never emits a broken UTF-8 sequence: while the decoded tail ends in an incomplete
/// character (U+FFFD) the text is held back until the following tokens complete it, or until
/// [`finish`](Self::finish).
///
/// Only a small window of recent ids is re-decoded per step: the text of `ids[prefix..]` minus
/// the already-emitted text of `ids[prefix..read]`.
#[derive(Clone, Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl IncrementalDecoder {
    /// `skip_special`: leave special tokens (`<|im_end|>`, ...) out of the text.
    pub fn new(skip_special: bool) -> Self {
        IncrementalDecoder { skip_special, ..Default::default() }
    }

    /// Every id pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Add one id; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let (prefix, full) = self.window(tok);
        let overdue = self.ids.len() - self.read_offset >= MAX_HELD;
        if full.ends_with('\u{FFFD}') && !overdue {
            return String::new();
        }
        let new = suffix_after(&prefix, &full);
        if new.is_empty() {
            // Nothing visible (e.g. a skipped special token); keep the window as it is, up to
            // a point.
            if overdue {
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
            }
            return String::new();
        }
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        new
    }

    /// Flush whatever is held back (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self, tok: &Tokenizer) -> String {
        let (prefix, full) = self.window(tok);
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        suffix_after(&prefix, &full)
    }

    /// Ids decoded again at the next push (at most 2 x [`MAX_HELD`] + 1).
    pub fn window_len(&self) -> usize {
        self.ids.len() - self.prefix_offset
    }

    fn window(&self, tok: &Tokenizer) -> (String, String) {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special);
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special);
        (prefix, full)
    }
}

/// `full` minus its leading `prefix`; if `full` does not extend `prefix` (a decoder that is not
/// prefix-stable), the part after their longest common prefix.
fn suffix_after(prefix: &str, full: &str) -> String {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest.to_string();
    }
    let common = prefix
        .char_indices()
        .zip(full.chars())
        .take_while(|((_, a), b)| a == b)
        .last()
        .map_or(0, |((i, c), _)| i + c.len_utf8());
    full[common..].to_string()
}
