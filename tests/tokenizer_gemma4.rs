//! Gemma 4's GGUF tokenizer (`tokenizer.ggml.model` "gemma4"): the fixture of
//! scripts/fixtures/gen_gemma4_tokenizer.py, a small Gemma-shaped byte-fallback BPE written as
//! llama.cpp's converter writes it, against the ids Hugging Face's `tokenizers` gives for its
//! tokenizer.json (checked there against a plain-Python port of llama.cpp's gemma4 tokenizer):
//! special tokens parsed and not, byte fallback for characters outside the vocabulary, newline
//! runs, indentation; decoding back; BOS always added; `<turn|>` ends generation.

use serde_json::Value;
use std::path::{Path, PathBuf};
use torus_wgpu::formats::gguf::GgufFile;
use torus_wgpu::tokenizer::Tokenizer;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn gemma4_gguf_tokenizer_matches_hugging_face() {
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("gemma4-tokenizer-reference.json")).unwrap())
            .unwrap();
    let g = GgufFile::open(&fixtures().join("gemma4-tokenizer.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(tok.vocab_size(), r["vocab_size"].as_u64().unwrap() as usize);
    let bos = r["bos_id"].as_u64().unwrap() as u32;
    let cases = r["cases"].as_array().unwrap();
    assert!(cases.len() >= 15);
    for c in cases {
        let (name, text) = (c["name"].as_str().unwrap(), c["text"].as_str().unwrap());
        let want = ids(&c["ids"]);
        assert_eq!(tok.tokenize(text, false, true).unwrap(), want, "{name}: ids (special tokens parsed)");
        let plain = ids(&c["ids_no_parse_special"]);
        assert_eq!(tok.tokenize(text, false, false).unwrap(), plain, "{name}: ids (special tokens as text)");
        // BOS always, once (a text that starts with <bos> keeps its own).
        let with_bos = tok.encode(text).unwrap();
        let expect = if want.first() == Some(&bos) { want.clone() } else { [vec![bos], want.clone()].concat() };
        assert_eq!(with_bos, expect, "{name}: with BOS");
        assert_eq!(tok.decode(&want, false), c["decoded"].as_str().unwrap(), "{name}: decoded");
        if c["round_trips"].as_bool() == Some(true) {
            assert_eq!(tok.decode(&plain, false), text, "{name}: round trip");
        }
    }
    // Generation ends at <eos> and at Gemma 4's end of turn.
    let turn_end = tok.tokenize("<turn|>", false, true).unwrap();
    assert_eq!(turn_end.len(), 1);
    assert!(tok.is_eos(turn_end[0]) && tok.is_eos(r["eos_id"].as_u64().unwrap() as u32));
}
