//! Tokenizer, chat template, incremental detokenizer and GGUF reader tests.
//!
//! Reference data: `tests/fixtures/` (see its README). Tests that need the default GGUF
//! model fail when `models/SmolLM2-135M-Instruct.Q4_1.gguf` is absent (scripts/setup.sh fetches it).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;
use torus_wgpu::formats::gguf::{GgmlType, GgufFile, GgufValue};
use torus_wgpu::tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixtures() -> PathBuf {
    crate_dir().join("tests/fixtures")
}

fn model_path() -> PathBuf {
    crate_dir().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("id fits u32"))
        .collect()
}

fn messages_of(v: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(v.clone()).expect("messages")
}

/// The default GGUF model and its tokenizer, or None (with a notice) when the file is absent.
fn smollm2() -> (GgufFile, Tokenizer) {
    let path = model_path();
    assert!(path.exists(), "{} is missing: run scripts/setup.sh (or scripts/fetch-model.sh)", path.display());
    let g = GgufFile::open(&path).expect("open GGUF");
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer from GGUF");
    (g, tok)
}

fn smollm2_reference() -> Value {
    read_json(&fixtures().join("smollm2-reference.json"))
}

#[test]
fn tokenizer_is_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<GgufFile>();
    assert_send_sync::<IncrementalDecoder>();
}

#[test]
fn smollm2_prompts_match_reference() {
    let (_g, tok) = smollm2();
    let reference = smollm2_reference();
    let prompts = reference["prompts"].as_array().expect("prompts");
    assert!(!prompts.is_empty());
    let mut n_chat = 0;
    for p in prompts {
        let name = p["name"].as_str().unwrap();
        let text = p["prompt_text"].as_str().unwrap();
        let expected = ids_of(&p["input_ids"]);
        assert_eq!(tok.encode(text).unwrap(), expected, "prompt {name}: token ids");
        if p["kind"] == "chat" {
            n_chat += 1;
            let messages = messages_of(&p["messages"]);
            let rendered = tok.apply_chat_template(&messages, true).unwrap();
            assert_eq!(rendered, text, "prompt {name}: chat template rendering");
            // Without the generation prompt the assistant header is absent.
            let bare = tok.apply_chat_template(&messages, false).unwrap();
            assert_eq!(format!("{bare}<|im_start|>assistant\n"), text, "prompt {name}");
        }
        assert_eq!(tok.decode(&expected, false), text, "prompt {name}: decode");
    }
    assert!(n_chat >= 1, "the fixture should contain chat prompts");
}

#[test]
fn smollm2_edge_cases_match_reference() {
    let (_g, tok) = smollm2();
    let reference = smollm2_reference();
    let cases = reference["tokenizer_edge_cases"].as_array().expect("edge cases");
    assert!(cases.len() >= 5);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let expected = ids_of(&c["ids"]);
        assert_eq!(tok.encode(text).unwrap(), expected, "edge case {text:?}");
        assert_eq!(tok.decode(&expected, false), text, "roundtrip of {text:?}");
    }
    // The README's example of the smollm digit split.
    assert_eq!(tok.encode("a  2").unwrap(), vec![81, 256, 34]);
}

#[test]
fn smollm2_special_tokens_and_ids() {
    let (_g, tok) = smollm2();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.eos_token_ids(), &[2]);
    assert!(tok.is_eos(2) && !tok.is_eos(1));
    assert_eq!(tok.bos_token_id(), Some(1));
    assert!(!tok.add_bos(), "SmolLM2 GGUF has add_bos_token = false");
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert!(tok.is_special(1) && !tok.is_special(81));
    assert_eq!(tok.encode("<|im_end|>").unwrap(), vec![2]);
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n").unwrap();
    assert_eq!(tok.decode(&ids, true), "user\nhi\n");
    assert_eq!(tok.decode(&ids, false), "<|im_start|>user\nhi<|im_end|>\n");
    assert_eq!(tok.encode("").unwrap(), Vec::<u32>::new());
    // Ids outside the vocabulary are skipped, not a panic.
    assert_eq!(tok.decode(&[81, 999_999], false), "a");
}

#[test]
fn smollm2_gguf_metadata_and_tensors() {
    let (g, _tok) = smollm2();
    assert_eq!(g.version, 3);
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.tensors.len(), 272);
    assert_eq!(g.get_u32("llama.block_count"), Some(30));
    assert_eq!(g.get_u32("llama.embedding_length"), Some(576));
    assert_eq!(g.get_f32("llama.rope.freq_base"), Some(100000.0));
    assert_eq!(g.get_f32("llama.attention.layer_norm_rms_epsilon"), Some(1e-5));
    assert_eq!(g.get_bool("tokenizer.ggml.add_bos_token"), Some(false));
    assert_eq!(g.get_str("tokenizer.ggml.pre"), Some("smollm"));
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(g.get_i32_array("tokenizer.ggml.token_type").unwrap()[0], 3);
    assert!(g.get_u32("tokenizer.ggml.tokens").is_none());
    assert_eq!(g.require_u32("llama.attention.head_count").unwrap(), 9);

    let err = g.require_u32("llama.no_such_key").unwrap_err().to_string();
    assert!(err.contains("llama.no_such_key") && err.contains(&g.path.display().to_string()), "{err}");
    let err = g.require_u32("general.name").unwrap_err().to_string();
    assert!(err.contains("general.name") && err.contains("string"), "{err}");

    let emb = g.tensor("token_embd.weight").expect("token_embd.weight");
    assert_eq!(emb.dims, vec![576, 49152]);
    assert_eq!(emb.ggml_type, GgmlType::Q8_0);
    assert_eq!(emb.n_bytes, 576 / 32 * 34 * 49152);
    assert_eq!(g.tensor_data(emb).len() as u64, emb.n_bytes);
    let q = g.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!((q.ggml_type, q.dims.clone(), q.n_bytes), (GgmlType::Q4_1, vec![576, 576], 576 * 576 / 32 * 20));
    let norm = g.tensor("blk.0.attn_norm.weight").unwrap();
    assert_eq!(norm.ggml_type, GgmlType::F32);
    let data = g.tensor_data(norm);
    let w0 = f32::from_le_bytes(data[..4].try_into().unwrap());
    assert!(w0.is_finite() && w0 != 0.0);
    assert!(g.tensor("output.weight").is_none(), "SmolLM2 ties embeddings");
    for t in &g.tensors {
        assert!(t.offset.is_multiple_of(32), "{} misaligned", t.name);
        assert!(t.offset + t.n_bytes <= g.file_len());
        assert!(matches!(t.ggml_type, GgmlType::F32 | GgmlType::Q4_1 | GgmlType::Q8_0), "{}", t.name);
    }
    assert_eq!(GgmlType::Q4_1.name(), "Q4_1");
    assert_eq!(GgmlType::Other(12).name(), "Q4_K");
    assert_eq!(GgmlType::Q8_0.block_size(), Some(32));
    assert_eq!(GgmlType::Q8_0.type_size(), Some(34));
    assert_eq!(GgmlType::Q4_0.type_size(), Some(18));
    assert_eq!(GgmlType::BF16.type_size(), Some(2));
    assert_eq!(GgmlType::from_code(30), GgmlType::BF16);
}

#[test]
fn tiny_qwen2_matches_reference() {
    let dir = fixtures().join("tiny-qwen2");
    let tok = Tokenizer::from_hf_dir(&dir).expect("tiny-qwen2 tokenizer");
    let reference = read_json(&fixtures().join("tiny-qwen2-reference.json"));
    let mut n_checked = 0;
    for p in reference["prompts"].as_array().expect("prompts") {
        let name = p["name"].as_str().unwrap();
        let expected = ids_of(&p["input_ids"]);
        let Some(text) = p["text"].as_str() else {
            // Raw-id prompts have no text; they must still decode without trouble.
            let _ = tok.decode(&expected, false);
            continue;
        };
        assert_eq!(tok.encode(text).unwrap(), expected, "prompt {name}");
        assert_eq!(tok.decode(&expected, false), text, "prompt {name}: decode");
        n_checked += 1;
    }
    assert!(n_checked >= 2);
    assert!(tok.eos_token_ids().contains(&511), "eos ids {:?}", tok.eos_token_ids());
    assert!(!tok.add_bos());
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(510));

    // The "chatml" prompt is the fixture's chat template applied to a system + user exchange.
    let chatml =
        reference["prompts"].as_array().unwrap().iter().find(|p| p["name"] == "chatml").expect("chatml prompt");
    let messages = [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "What is the capital of France?"),
    ];
    assert_eq!(tok.apply_chat_template(&messages, true).unwrap(), chatml["text"].as_str().unwrap());
    // Without a system message the template inserts its default one: same text here.
    assert_eq!(tok.apply_chat_template(&messages[1..], true).unwrap(), chatml["text"].as_str().unwrap());
}

#[test]
fn incremental_decoder_holds_back_partial_utf8() {
    let (_g, tok) = smollm2();
    let reference = smollm2_reference();
    let case = reference["tokenizer_edge_cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["text"].as_str().unwrap().contains('🤖'))
        .expect("edge case with emoji");
    let ids = ids_of(&case["ids"]);
    let full = tok.decode(&ids, false);
    assert_eq!(full, case["text"].as_str().unwrap());

    let mut dec = IncrementalDecoder::new(false);
    let mut out = String::new();
    let mut held_back = 0;
    for &id in &ids {
        let piece = dec.push(&tok, id);
        assert!(!piece.contains('\u{FFFD}'), "piece {piece:?} after id {id}");
        if piece.is_empty() {
            held_back += 1;
        }
        out.push_str(&piece);
    }
    out.push_str(&dec.finish(&tok));
    assert_eq!(out, full);
    assert_eq!(dec.ids(), &ids[..]);
    assert!(held_back > 0, "the case should contain characters split across tokens");

    // A multi-byte character cut off at the end is flushed by finish() as U+FFFD.
    let mut dec = IncrementalDecoder::new(false);
    let last_two = &ids[ids.len() - 2..]; // "٣" is split into two byte tokens
    assert_eq!(dec.push(&tok, last_two[0]), "");
    assert_eq!(dec.finish(&tok), "\u{FFFD}");
}

#[test]
fn incremental_decoder_matches_full_decode_on_chat_prompts() {
    let (_g, tok) = smollm2();
    let reference = smollm2_reference();
    for p in reference["prompts"].as_array().unwrap() {
        let ids = ids_of(&p["input_ids"]);
        for skip_special in [false, true] {
            let mut dec = IncrementalDecoder::new(skip_special);
            let mut out: String = ids.iter().map(|&id| dec.push(&tok, id)).collect();
            out.push_str(&dec.finish(&tok));
            assert_eq!(out, tok.decode(&ids, skip_special), "prompt {}", p["name"]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// GGUF reader robustness. Files are written by hand into a per-test temp directory.

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("torus-tokenizer-test-{}-{tag}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Minimal GGUF v3 writer for tests.
#[derive(Default)]
struct GgufBuilder {
    version: u32,
    kv: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    alignment: u64,
    data: Vec<u8>,
}

fn gguf_str(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

impl GgufBuilder {
    fn new() -> Self {
        GgufBuilder { version: 3, alignment: 32, ..Default::default() }
    }
    fn kv_raw(&mut self, key: &str, ty: u32, payload: Vec<u8>) -> &mut Self {
        self.kv.push((key.to_string(), ty, payload));
        self
    }
    fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.kv_raw(key, 8, gguf_str(v))
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv_raw(key, 4, v.to_le_bytes().to_vec())
    }
    fn kv_bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.kv_raw(key, 7, vec![v as u8])
    }
    fn kv_str_array(&mut self, key: &str, items: &[String]) -> &mut Self {
        let mut p = 8u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(items.len() as u64).to_le_bytes());
        for s in items {
            p.extend(gguf_str(s));
        }
        self.kv_raw(key, 9, p)
    }
    fn kv_i32_array(&mut self, key: &str, items: &[i32]) -> &mut Self {
        let mut p = 5u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(items.len() as u64).to_le_bytes());
        for x in items {
            p.extend_from_slice(&x.to_le_bytes());
        }
        self.kv_raw(key, 9, p)
    }
    /// A tensor whose data is `bytes`, placed (aligned) after the previous ones.
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, bytes: &[u8]) -> &mut Self {
        let a = self.alignment as usize;
        while !self.data.len().is_multiple_of(a) {
            self.data.push(0);
        }
        let off = self.data.len() as u64;
        self.data.extend_from_slice(bytes);
        self.tensors.push((name.to_string(), dims.to_vec(), ty, off));
        self
    }
    /// A tensor description with an explicit relative offset and no data added.
    fn tensor_at(&mut self, name: &str, dims: &[u64], ty: u32, rel_offset: u64) -> &mut Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, rel_offset));
        self
    }
    fn build(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, ty, payload) in &self.kv {
            b.extend(gguf_str(k));
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(payload);
        }
        for (name, dims, ty, off) in &self.tensors {
            b.extend(gguf_str(name));
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&off.to_le_bytes());
        }
        while !(b.len() as u64).is_multiple_of(self.alignment) {
            b.push(0);
        }
        b.extend_from_slice(&self.data);
        b
    }
}

/// Open must fail, with the path and `needle` in a one-line message.
fn expect_open_error(path: &Path, needle: &str) -> String {
    let err = match GgufFile::open(path) {
        Ok(g) => panic!("{} opened but should not have: {g:?}", path.display()),
        Err(e) => e.to_string(),
    };
    assert!(err.contains(&path.display().to_string()), "error does not name the file: {err}");
    assert!(err.contains(needle), "error {err:?} does not mention {needle:?}");
    assert!(!err.contains('\n'), "error is not one line: {err:?}");
    err
}

#[test]
fn gguf_valid_handmade_file() {
    let tmp = TempDir::new("valid");
    let f32_data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut b = GgufBuilder::new();
    b.alignment = 64;
    b.kv_str("general.architecture", "qwen2")
        .kv_raw("general.alignment", 4, 64u32.to_le_bytes().to_vec())
        .kv_raw("qwen2.rope.freq_base", 6, 10000.0f32.to_le_bytes().to_vec())
        .kv_raw("qwen2.block_count", 10, 2u64.to_le_bytes().to_vec())
        .kv_raw("some.i8", 1, vec![0xff])
        .kv_bool("some.flag", true)
        .tensor("a", &[3, 2], 0, &f32_data)
        .tensor("q", &[32, 2], 8, &[7u8; 68])
        .tensor("k4", &[256], 12, &[9u8; 144])
        .tensor("q8k", &[256], 15, &[5u8; 292]); // Q8_K (ggml's activation type): unsupported here, but legal
    let path = tmp.write("valid.gguf", &b.build());
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.architecture().unwrap(), "qwen2");
    assert_eq!(g.alignment, 64);
    assert_eq!(g.data_offset % 64, 0);
    assert_eq!(g.get_u32("qwen2.block_count"), Some(2));
    assert_eq!(g.get_f32("qwen2.rope.freq_base"), Some(10000.0));
    assert_eq!(g.get("some.i8"), Some(&GgufValue::I8(-1)));
    assert_eq!(g.get_u32("some.i8"), None, "negative values do not convert to u32");
    assert_eq!(g.get_bool("some.flag"), Some(true));
    let a = g.tensor("a").unwrap();
    assert_eq!((a.dims.clone(), a.ggml_type, a.n_bytes, a.n_elements()), (vec![3, 2], GgmlType::F32, 24, 6));
    assert_eq!(a.shape(), vec![2, 3]);
    assert_eq!(g.tensor_data(a), &f32_data[..]);
    let q = g.tensor("q").unwrap();
    assert_eq!((q.ggml_type, q.n_bytes), (GgmlType::Q8_0, 68));
    assert_eq!(q.offset % 64, 0);
    assert!(g.tensor_data(q).iter().all(|&x| x == 7));
    let k4 = g.tensor("k4").unwrap();
    assert_eq!((k4.ggml_type, k4.n_bytes), (GgmlType::Q4_K, 144));
    assert!(k4.ggml_type.is_supported());
    let q8k = g.tensor("q8k").unwrap();
    assert_eq!((q8k.ggml_type, q8k.n_bytes), (GgmlType::Other(15), 292));
    assert!(!q8k.ggml_type.is_supported());
    assert_eq!(q8k.ggml_type.name(), "Q8_K");
}

#[test]
fn gguf_missing_file() {
    let path = std::env::temp_dir().join(format!("torus-no-such-file-{}.gguf", std::process::id()));
    let err = GgufFile::open(&path).unwrap_err().to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
}

#[test]
fn gguf_wrong_magic_and_version() {
    let tmp = TempDir::new("magic");
    let p = tmp.write("magic.gguf", b"GGML\x03\x00\x00\x00 and then some more bytes");
    expect_open_error(&p, "not a GGUF file");
    let p = tmp.write("tiny.gguf", b"GG");
    expect_open_error(&p, "not a GGUF file");
    let p = tmp.write("empty.gguf", b"");
    expect_open_error(&p, "not a GGUF file");
    let mut b = GgufBuilder::new();
    b.version = 7;
    let p = tmp.write("v7.gguf", &b.build());
    expect_open_error(&p, "version 7");
    b.version = 1;
    let p = tmp.write("v1.gguf", &b.build());
    expect_open_error(&p, "version 1");
    b.version = 3u32.swap_bytes();
    let p = tmp.write("be.gguf", &b.build());
    expect_open_error(&p, "big-endian");
}

#[test]
fn gguf_corrupt_headers() {
    let tmp = TempDir::new("corrupt");
    // A string length far beyond the file.
    let mut b = GgufBuilder::new();
    b.kv_raw("general.name", 8, u64::MAX.to_le_bytes().to_vec());
    expect_open_error(&tmp.write("strlen.gguf", &b.build()), "general.name");
    // An array claiming 2^60 elements.
    let mut payload = 4u32.to_le_bytes().to_vec();
    payload.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let mut b = GgufBuilder::new();
    b.kv_raw("big.array", 9, payload);
    expect_open_error(&tmp.write("arrlen.gguf", &b.build()), "big.array");
    // Tensor and metadata counts beyond the file.
    let mut bytes = GgufBuilder::new().build();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    expect_open_error(&tmp.write("ntensors.gguf", &bytes), "tensor count");
    let mut bytes = GgufBuilder::new().build();
    bytes[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    expect_open_error(&tmp.write("nkv.gguf", &bytes), "metadata count");
    // Unknown value type.
    let mut b = GgufBuilder::new();
    b.kv_raw("weird", 99, vec![0; 16]);
    expect_open_error(&tmp.write("vtype.gguf", &b.build()), "weird");
    // Arrays nested beyond any sane depth.
    let mut payload = Vec::new();
    for _ in 0..64 {
        payload.extend_from_slice(&9u32.to_le_bytes());
        payload.extend_from_slice(&1u64.to_le_bytes());
    }
    payload.extend_from_slice(&4u32.to_le_bytes());
    payload.extend_from_slice(&0u64.to_le_bytes());
    let mut b = GgufBuilder::new();
    b.kv_raw("nested", 9, payload);
    expect_open_error(&tmp.write("nested.gguf", &b.build()), "nested");
    // Five dimensions.
    let mut b = GgufBuilder::new();
    b.tensor("t5", &[1, 1, 1, 1, 1], 0, &[0; 4]);
    expect_open_error(&tmp.write("dims.gguf", &b.build()), "t5");
    // Shape whose element count overflows u64.
    let mut b = GgufBuilder::new();
    b.tensor_at("huge", &[1 << 32, 1 << 32, 1 << 32], 0, 0);
    expect_open_error(&tmp.write("overflow.gguf", &b.build()), "huge");
    // Row length that is not a whole number of blocks.
    let mut b = GgufBuilder::new();
    b.tensor("ragged", &[33], 8, &[0; 68]);
    expect_open_error(&tmp.write("ragged.gguf", &b.build()), "ragged");
    // Bad alignment value.
    let mut b = GgufBuilder::new();
    b.kv_u32("general.alignment", 0);
    expect_open_error(&tmp.write("align.gguf", &b.build()), "general.alignment");
    // Duplicate tensor names.
    let mut b = GgufBuilder::new();
    b.tensor("dup", &[1], 0, &[0; 4]).tensor("dup", &[1], 0, &[0; 4]);
    expect_open_error(&tmp.write("dup.gguf", &b.build()), "dup");
}

#[test]
fn gguf_tensor_past_end_of_file() {
    let tmp = TempDir::new("past-eof");
    let mut b = GgufBuilder::new();
    b.kv_str("general.architecture", "llama").tensor("ok.weight", &[8], 0, &[0; 32]).tensor_at(
        "blk.3.attn_q.weight",
        &[64, 64],
        0,
        1024,
    );
    let err = expect_open_error(&tmp.write("past.gguf", &b.build()), "blk.3.attn_q.weight");
    assert!(err.contains("past end of file"), "{err}");
    // An offset so large that offset + size overflows.
    let mut b = GgufBuilder::new();
    b.tensor_at("far", &[8], 0, u64::MAX - 31);
    expect_open_error(&tmp.write("far.gguf", &b.build()), "far");
}

#[test]
fn gguf_truncated_copies_of_the_model() {
    let path = model_path();
    if !path.exists() {
        eprintln!("SKIP: {} not found", path.display());
        return;
    }
    let bytes = std::fs::read(&path).unwrap();
    let tmp = TempDir::new("truncated");
    // Cut inside the metadata (the token list).
    expect_open_error(&tmp.write("first1000.gguf", &bytes[..1000]), "truncated");
    // Cut inside the header at every small length: never a panic, always an error.
    for n in [4, 7, 8, 15, 16, 23, 24, 25, 40, 100] {
        expect_open_error(&tmp.write(&format!("first{n}.gguf"), &bytes[..n]), "");
    }
    // Cut inside the tensor data: the error names a tensor.
    let err = expect_open_error(&tmp.write("first50MB.gguf", &bytes[..50_000_000]), "past end of file");
    assert!(err.contains("tensor blk."), "{err}");
    // Cut one byte short.
    expect_open_error(&tmp.write("short1.gguf", &bytes[..bytes.len() - 1]), "past end of file");
}

// ---------------------------------------------------------------------------------------------
// GGUF tokenizer construction from hand-written metadata.

/// GPT-2's byte -> printable char table: printable Latin-1 bytes map to themselves, the rest to
/// U+0100 onwards in byte order.
fn byte_level_alphabet() -> Vec<String> {
    let keeps = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut next = 0x100u32;
    (0u32..256)
        .map(|b| {
            let c = if keeps(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap().to_string()
        })
        .collect()
}

/// A tiny gpt2-model GGUF: 256 byte tokens, merges "h e" -> "he", "he llo"... plus control and
/// user-defined tokens.
fn tiny_tokenizer_gguf(model: &str, pre: &str, template: Option<&str>) -> GgufBuilder {
    let mut tokens = byte_level_alphabet();
    let merges: Vec<String> = ["h e", "l l", "he ll", "hell o", "Ġ w"].iter().map(|s| s.to_string()).collect();
    for m in &merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![1; tokens.len()];
    for (t, ty) in [("<|end|>", 3), ("<think>", 4)] {
        tokens.push(t.to_string());
        types.push(ty);
    }
    let mut b = GgufBuilder::new();
    b.kv_str("general.architecture", "llama")
        .kv_str("tokenizer.ggml.model", model)
        .kv_str("tokenizer.ggml.pre", pre)
        .kv_str_array("tokenizer.ggml.tokens", &tokens)
        .kv_i32_array("tokenizer.ggml.token_type", &types)
        .kv_str_array("tokenizer.ggml.merges", &merges)
        .kv_u32("tokenizer.ggml.eos_token_id", 261)
        .kv_u32("tokenizer.ggml.bos_token_id", 261)
        .kv_bool("tokenizer.ggml.add_bos_token", true);
    if let Some(t) = template {
        b.kv_str("tokenizer.chat_template", t);
    }
    b
}

#[test]
fn gguf_tokenizer_from_handmade_metadata() {
    let tmp = TempDir::new("tok");
    // 256 bytes + 5 merges: "<|end|>" = 261, "<think>" = 262, "hello" = 259, "Ġw" = 260.
    let template = "{% for m in messages %}[{{ m.role.upper() }}]{{ m.content.strip() }}{{ eos_token }}{% endfor %}\
                    {% if add_generation_prompt %}[A]{% endif %}";
    for pre in ["gpt2", "default", "qwen2", "smollm"] {
        let path = tmp.write(&format!("{pre}.gguf"), &tiny_tokenizer_gguf("gpt2", pre, Some(template)).build());
        let g = GgufFile::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(&g).unwrap();
        assert_eq!(tok.vocab_size(), 263);
        assert_eq!(tok.eos_token_ids(), &[261]);
        // add_bos: BOS (here the same id as <|end|>) is prepended once.
        let ids = tok.encode("hello<|end|><think> w").unwrap();
        assert_eq!(ids, vec![261, 259, 261, 262, 260], "pre {pre}");
        assert_eq!(tok.encode("<|end|>x").unwrap(), vec![261, b'x' as u32], "no doubled BOS");
        assert_eq!(tok.encode_raw("hello").unwrap(), vec![259]);
        assert_eq!(tok.decode(&ids, true), "hello<think> w", "control skipped, user-defined kept");
        assert_eq!(tok.decode(&ids, false), "<|end|>hello<|end|><think> w");
        let msgs = [ChatMessage::new("user", "  hi  ")];
        assert_eq!(tok.apply_chat_template(&msgs, true).unwrap(), "[USER]hi<|end|>[A]");
    }

    // Unsupported model type and pre-tokenizer names are errors naming them and the file.
    let path = tmp.write("bert.gguf", &tiny_tokenizer_gguf("bert", "default", None).build());
    let err = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap_err().to_string();
    assert!(err.contains("\"bert\"") && err.contains(&path.display().to_string()), "{err}");
    let path = tmp.write("pre.gguf", &tiny_tokenizer_gguf("gpt2", "mystery-pre", None).build());
    let err = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap_err().to_string();
    assert!(err.contains("mystery-pre") && err.contains(&path.display().to_string()), "{err}");

    // No chat template: an error that names no file (it reaches HTTP clients).
    let path = tmp.write("notemplate.gguf", &tiny_tokenizer_gguf("gpt2", "gpt2", None).build());
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    assert!(!tok.has_chat_template());
    let err = tok.apply_chat_template(&[ChatMessage::new("user", "x")], true).unwrap_err().to_string();
    assert!(err.contains("no chat template") && !err.contains(&path.display().to_string()), "{err}");

    // raise_exception surfaces as an error carrying the template's message.
    let t =
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}ok";
    let path = tmp.write("raise.gguf", &tiny_tokenizer_gguf("gpt2", "gpt2", Some(t)).build());
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let err = format!("{:#}", tok.apply_chat_template(&[ChatMessage::new("user", "x")], true).unwrap_err());
    assert!(err.contains("first message must be system"), "{err}");
    assert_eq!(tok.apply_chat_template(&[ChatMessage::new("system", "x")], true).unwrap(), "ok");

    // A template that does not compile loads, and fails on use.
    let path = tmp.write("broken.gguf", &tiny_tokenizer_gguf("gpt2", "gpt2", Some("{% for %}")).build());
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    assert!(tok.apply_chat_template(&[ChatMessage::new("user", "x")], true).is_err());
}

/// A model file whose tensors are of a type the engine cannot run (IQ*, TQ*, ...) fails at load
/// naming the file, the tensor, the type and the supported list; so does an unknown architecture
/// and a rope scaling type we do not implement.
#[test]
fn gguf_unsupported_tensor_type_architecture_and_rope_scaling() {
    use torus_wgpu::model::loader::HostModel;
    let tmp = TempDir::new("unsupported");
    let (hidden, vocab) = (64u64, 32u64);
    let model = |arch: &str, ty: u32, bytes: usize, extra: &dyn Fn(&mut GgufBuilder)| {
        let mut b = GgufBuilder::new();
        b.kv_str("general.architecture", arch)
            .kv_u32(&format!("{arch}.embedding_length"), hidden as u32)
            .kv_u32(&format!("{arch}.block_count"), 1)
            .kv_u32(&format!("{arch}.attention.head_count"), 4)
            .kv_u32(&format!("{arch}.feed_forward_length"), 128)
            .tensor("token_embd.weight", &[hidden, vocab], ty, &vec![0u8; bytes]);
        extra(&mut b);
        b.build()
    };
    // Q8_1 (type 9, 32-element blocks of 36 bytes; ggml's activation type): legal, not loaded.
    // The supported list names the IQ types, MXFP4 and the ternary types.
    let path = tmp.write("iq.gguf", &model("llama", 9, (hidden * vocab / 32 * 36) as usize, &|_| {}));
    let err = HostModel::load(&path, &|_, _| {}).err().expect("Q8_1 must be refused").to_string();
    for needle in [
        "iq.gguf",
        "token_embd.weight",
        "Q8_1",
        "not supported",
        "Q4_K",
        "IQ4_XS",
        "MXFP4",
        "IQ2_XXS",
        "IQ1_M",
        "TQ2_0",
    ] {
        assert!(err.contains(needle), "{needle:?} missing from: {err}");
    }
    let path = tmp.write("arch.gguf", &model("gpt-neox", 0, (hidden * vocab * 4) as usize, &|_| {}));
    let err = HostModel::load(&path, &|_, _| {}).err().expect("unknown arch").to_string();
    assert!(err.contains("gpt-neox") && err.contains("qwen3"), "{err}");
    let path = tmp.write(
        "rope.gguf",
        &model("llama", 0, (hidden * vocab * 4) as usize, &|b| {
            b.kv_str("llama.rope.scaling.type", "longrope");
        }),
    );
    let err = HostModel::load(&path, &|_, _| {}).err().expect("longrope").to_string();
    assert!(err.contains("longrope") && err.contains("yarn"), "{err}");

    // The scalings llama.cpp writes as metadata are read as such.
    use torus_wgpu::model::config::{yarn_mscale, RopeScaling};
    use torus_wgpu::model::loader::read_config;
    let f32kv = |b: &mut GgufBuilder, k: &str, v: f32| {
        b.kv_raw(k, 6, v.to_le_bytes().to_vec());
    };
    let path = tmp.write(
        "linear.gguf",
        &model("llama", 0, (hidden * vocab * 4) as usize, &|b| {
            b.kv_str("llama.rope.scaling.type", "linear");
            f32kv(b, "llama.rope.scaling.factor", 4.0);
        }),
    );
    let cfg = read_config(&path).unwrap();
    assert_eq!(cfg.rope_scaling, RopeScaling::Linear { factor: 4.0 });
    let (inv, attn) = cfg.rope_scaling.inv_freq(10000.0, 16);
    let (plain, _) = RopeScaling::None.inv_freq(10000.0, 16);
    assert!(inv.iter().zip(&plain).all(|(a, b)| (a * 4.0 - b).abs() < 1e-12) && attn == 1.0);
    let path = tmp.write(
        "yarn.gguf",
        &model("llama", 0, (hidden * vocab * 4) as usize, &|b| {
            b.kv_str("llama.rope.scaling.type", "yarn");
            f32kv(b, "llama.rope.scaling.factor", 4.0);
            f32kv(b, "llama.rope.scaling.original_context_length", 4096.0);
        }),
    );
    match read_config(&path).unwrap().rope_scaling {
        RopeScaling::Yarn { factor, original_max, attention_factor, .. } => {
            assert_eq!((factor, original_max), (4.0, 4096.0));
            assert!((attention_factor - yarn_mscale(4.0, 1.0)).abs() < 1e-12);
        }
        other => panic!("expected YaRN, got {other:?}"),
    }
}
