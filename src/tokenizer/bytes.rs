//! The exact bytes of every token, for grammar-constrained decoding (structured outputs): the
//! constraint library matches grammars against token byte strings, so each id must map to the
//! bytes it adds to the output, not to its display text.

use super::Tokenizer;
use anyhow::{bail, Result};
use serde_json::Value as Json;

/// Marks a special token's bytes (`<|im_end|>` and the like): such tokens never match grammar
/// text, only a grammar that names them. The constraint library's convention (0xff never starts
/// UTF-8 text).
pub const SPECIAL_TOKEN_MARKER: u8 = 0xff;

/// How a vocabulary string maps to bytes, read from the tokenizer's decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Encoding {
    /// GPT-2 byte-level BPE: each character stands for one byte.
    ByteLevel,
    /// SentencePiece style: `▁` (or the decoder's own space character) is a space and `<0xNN>`
    /// tokens are single bytes.
    Pieces { space: char },
}

/// GPT-2's byte-to-character table, inverted: characters of byte-level vocabularies to bytes.
fn byte_level_table() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    let mut map = std::collections::HashMap::with_capacity(256);
    for b in 0..=255u8 {
        let c = if printable(b) {
            b as char
        } else {
            let c = char::from_u32(next).expect("below the surrogates");
            next += 1;
            c
        };
        map.insert(c, b);
    }
    map
}

fn encoding_of(decoder: &Json) -> Option<Encoding> {
    match decoder["type"].as_str()? {
        "ByteLevel" => Some(Encoding::ByteLevel),
        "Metaspace" => {
            let space = decoder["replacement"].as_str().and_then(|s| s.chars().next()).unwrap_or('\u{2581}');
            Some(Encoding::Pieces { space })
        }
        "ByteFallback" => Some(Encoding::Pieces { space: '\u{2581}' }),
        "Sequence" => {
            let steps = decoder["decoders"].as_array()?;
            if let Some(e) = steps.iter().find_map(|d| encoding_of(d).filter(|e| *e == Encoding::ByteLevel)) {
                return Some(e);
            }
            // A Replace(x -> " ") step names the space character; ByteFallback or Metaspace
            // make it a piece vocabulary.
            let mut space = '\u{2581}';
            let mut pieces = false;
            for d in steps {
                match d["type"].as_str() {
                    Some("Replace") if d["content"].as_str() == Some(" ") => {
                        if let Some(c) = d["pattern"]["String"].as_str().and_then(|s| s.chars().next()) {
                            space = c;
                        }
                        pieces = true;
                    }
                    Some("ByteFallback") | Some("Metaspace") => pieces = true,
                    _ => {}
                }
            }
            pieces.then_some(Encoding::Pieces { space })
        }
        _ => None,
    }
}

/// `<0xNN>`: the byte NN.
fn byte_token(s: &str) -> Option<u8> {
    let hex = s.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}

impl Tokenizer {
    /// Every token's bytes, index = id (`vocab_size()` entries): special tokens are
    /// [`SPECIAL_TOKEN_MARKER`] then their text; ids with no token are empty.
    pub fn token_bytes(&self) -> Result<Vec<Vec<u8>>> {
        let inner = self.inner();
        let decoder = match inner.get_decoder() {
            Some(d) => serde_json::to_value(d)?,
            None => Json::Null,
        };
        // No file path in this error: it reaches HTTP clients (structured outputs).
        let Some(enc) = encoding_of(&decoder) else {
            bail!(
                "the tokenizer: cannot tell the bytes of its tokens (decoder {}); structured outputs need a \
                 byte-level BPE or a SentencePiece vocabulary",
                decoder["type"].as_str().unwrap_or("none")
            );
        };
        let table = byte_level_table();
        let added = inner.get_added_tokens_decoder();
        let mut out = Vec::with_capacity(self.vocab_size());
        for id in 0..self.vocab_size() as u32 {
            if let Some(t) = added.get(&id) {
                let mut b = Vec::with_capacity(t.content.len() + 1);
                if t.special {
                    b.push(SPECIAL_TOKEN_MARKER);
                }
                b.extend_from_slice(t.content.as_bytes());
                out.push(b);
                continue;
            }
            let Some(s) = inner.id_to_token(id) else {
                out.push(Vec::new());
                continue;
            };
            let bytes = match enc {
                Encoding::ByteLevel => {
                    // A character outside the table (never in a byte-level vocabulary) stands for itself.
                    let mut b = Vec::with_capacity(s.len());
                    for c in s.chars() {
                        match table.get(&c) {
                            Some(&x) => b.push(x),
                            None => b.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    b
                }
                Encoding::Pieces { space } => match byte_token(&s) {
                    Some(x) => vec![x],
                    None => s.replace(space, " ").into_bytes(),
                },
            };
            out.push(bytes);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection() {
        let t = byte_level_table();
        assert_eq!(t.len(), 256);
        let mut seen = [false; 256];
        for &b in t.values() {
            seen[b as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(t[&'\u{120}'], b' ');
        assert_eq!(t[&'\u{10a}'], b'\n');
        assert_eq!(t[&'a'], b'a');
    }

    #[test]
    fn byte_tokens() {
        assert_eq!(byte_token("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_token("<0xff>"), Some(0xff));
        assert_eq!(byte_token("<0x0>"), None);
        assert_eq!(byte_token("<s>"), None);
    }
}
