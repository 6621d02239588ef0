//! GGUF tokenizers against independent references, and the `tokenize` command.
//!
//! Fixtures (committed, written by `scripts/fixtures/gen_tokenizer_fixture.py`):
//! - `tests/fixtures/tokenizer_strings.json`: the hard strings;
//! - `tests/fixtures/vocab/*.gguf`: vocab-only GGUF files (metadata, no tensors): one byte-level
//!   BPE vocabulary under every supported `tokenizer.ggml.pre` name, two SentencePiece ones;
//! - `tests/fixtures/tokenizer_expected.json`: the expected ids, computed by the Python
//!   `tokenizers` library (cross-checked by a plain-Python BPE) and by `sentencepiece`, and
//!   compared with llama.cpp's own tokenizer (llama-cpp-python 0.3.36, `--check-llama-cpp`):
//!   llama.cpp agrees on every id list and SentencePiece decoding.
//!
//! Every test reads its fixtures with a panic when one is missing: none of them skips.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use torus_wgpu::formats::gguf::GgufFile;
use torus_wgpu::tokenizer::{supported_pre_tokenizers, Tokenizer};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixtures() -> PathBuf {
    crate_dir().join("tests/fixtures")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fixtures/gen_tokenizer_fixture.py)", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn expected() -> Value {
    read_json(&fixtures().join("tokenizer_expected.json"))
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("id fits u32"))
        .collect()
}

/// name -> text from the committed list of hard strings.
fn hard_strings() -> Vec<(String, String)> {
    let doc = read_json(&fixtures().join("tokenizer_strings.json"));
    doc["strings"]
        .as_array()
        .expect("strings")
        .iter()
        .map(|s| (s["name"].as_str().unwrap().to_string(), s["text"].as_str().unwrap().to_string()))
        .collect()
}

fn load(file: &str) -> Tokenizer {
    let path = fixtures().join(file);
    assert!(path.is_file(), "{}: fixture missing (run scripts/fixtures/gen_tokenizer_fixture.py)", path.display());
    Tokenizer::from_path(&path).unwrap_or_else(|e| panic!("{file}: {e:#}"))
}

/// Check one vocabulary's cases; returns a description of each mismatch.
fn check_cases(tok: &Tokenizer, entry: &Value, label: &str, decoded_key: Option<&str>) -> Vec<String> {
    let strings = hard_strings();
    let cases = entry["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), strings.len(), "{label}: the fixture is stale (regenerate it)");
    let bos = entry["bos_id"].as_u64().unwrap() as u32;
    let add_bos = entry["add_bos"].as_bool().unwrap();
    assert_eq!(tok.add_bos(), add_bos, "{label}: add_bos");
    assert_eq!(tok.bos_token_id(), Some(bos), "{label}: bos id");
    assert_eq!(tok.vocab_size() as u64, entry["n_tokens"].as_u64().unwrap(), "{label}: vocabulary size");
    let mut failures = Vec::new();
    for (case, (name, text)) in cases.iter().zip(&strings) {
        assert_eq!(case["name"].as_str(), Some(name.as_str()), "{label}: the fixture is stale");
        assert_eq!(case["text"].as_str(), Some(text.as_str()), "{label} {name}: the fixture is stale");
        let want = ids_of(&case["ids"]);
        let want_special = ids_of(&case["ids_parse_special"]);
        let got = tok.tokenize(text, false, false).unwrap();
        if got != want {
            failures.push(format!("{label} {name} {text:?}: plain text: got {got:?}, want {want:?}"));
        }
        let got = tok.tokenize(text, false, true).unwrap();
        if got != want_special {
            failures.push(format!("{label} {name} {text:?}: parse_special: got {got:?}, want {want_special:?}"));
        }
        // encode_raw is the engine's path: special tokens parsed, no BOS.
        assert_eq!(tok.encode_raw(text).unwrap(), want_special, "{label} {name}: encode_raw");
        let with_bos: Vec<u32> = add_bos.then_some(bos).into_iter().chain(want.iter().copied()).collect();
        assert_eq!(tok.tokenize(text, true, false).unwrap(), with_bos, "{label} {name}: add_special");
        let want_text = match decoded_key {
            Some(k) => case[k].as_str().unwrap(),
            None => text.as_str(),
        };
        let decoded = tok.decode(&want, false);
        if decoded != want_text {
            failures.push(format!("{label} {name}: decode gives {decoded:?}, want {want_text:?}"));
        }
    }
    failures
}

#[test]
fn byte_level_bpe_pre_tokenizers_match_the_reference() {
    let exp = expected();
    let entries = exp["bpe"].as_array().expect("bpe entries");
    let mut failures = Vec::new();
    let mut names = Vec::new();
    for e in entries {
        let pre = e["pre"].as_str().unwrap();
        names.push(pre.to_string());
        let tok = load(e["file"].as_str().unwrap());
        // Byte-level BPE decodes back to the exact text (no normalizer, as in llama.cpp). Here
        // torus-wgpu differs from llama.cpp's llama_detokenize, which for most byte-level
        // pre-tokenizers also removes the space before "?!.," and some apostrophes (its
        // clean_spaces); llama.cpp's per-token pieces, which its server streams, do not.
        failures.extend(check_cases(&tok, e, pre, None));
        assert_eq!(tok.eos_token_ids(), &[e["eos_id"].as_u64().unwrap() as u32], "{pre}");
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    for required in [
        "llama-bpe",
        "llama3",
        "dbrx",
        "smaug-bpe",
        "qwen2",
        "smollm",
        "deepseek-llm",
        "deepseek-coder",
        "starcoder",
        "gpt-2",
        "falcon",
        "mpt",
        "refact",
        "command-r",
        "default",
        "gpt-4o",
    ] {
        assert!(names.iter().any(|n| n == required), "no fixture for pre-tokenizer {required}");
        assert!(supported_pre_tokenizers().contains(&required), "{required} is not supported");
    }
}

/// The differences between the pre-tokenizers show in the ids (so the fixture really tells them
/// apart), and Llama 3's `ignore_merges` is what separates `llama-bpe` from `dbrx`.
#[test]
fn pre_tokenizers_differ_where_llama_cpp_differs() {
    let exp = expected();
    let entries = exp["bpe"].as_array().unwrap();
    let ids = |pre: &str, name: &str| -> Vec<u32> {
        let e = entries.iter().find(|e| e["pre"] == pre).unwrap_or_else(|| panic!("no {pre}"));
        let c = e["cases"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap();
        ids_of(&c["ids"])
    };
    let tok = load("vocab/bpe-llama-bpe.gguf");
    let zzqx = tok.token_to_id("Ġzzqx").expect("the unreachable test token");
    assert!(ids("llama-bpe", "ignore_merges").contains(&zzqx), "llama-bpe takes a whole-word token");
    assert!(!ids("dbrx", "ignore_merges").contains(&zzqx), "dbrx runs the merges");
    assert_eq!(ids("llama-bpe", "ignore_merges"), ids("llama3", "ignore_merges"), "aliases");
    assert_eq!(ids("dbrx", "digits"), ids("smaug-bpe", "digits"), "aliases");
    // Digits: Llama 3 groups up to three, Qwen2 and the smollm family split each one.
    assert_ne!(ids("llama-bpe", "long_number"), ids("qwen2", "long_number"));
    assert_eq!(ids("smollm", "long_number").len(), 20);
    assert_eq!(ids("qwen2", "long_number").len(), 20);
    assert_ne!(ids("gpt-2", "digits"), ids("starcoder", "digits"));
}

#[test]
fn sentencepiece_matches_sentencepiece() {
    let exp = expected();
    let entries = exp["spm"].as_array().expect("spm entries");
    assert_eq!(entries.len(), 2);
    let mut failures = Vec::new();
    for e in entries {
        let file = e["file"].as_str().unwrap();
        let tok = load(file);
        // Decoding is compared with sentencepiece's own decoder: "▁" to spaces, <0xNN> bytes
        // back to UTF-8, the prefix space dropped.
        failures.extend(check_cases(&tok, e, file, Some("decoded")));
        assert_eq!(tok.eos_token_ids(), &[e["eos_id"].as_u64().unwrap() as u32], "{file}");
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// The points where llama.cpp's SentencePiece rules differ from calling sentencepiece on the
/// whole text; the fixture follows llama.cpp (see the generator's docstring).
#[test]
fn sentencepiece_follows_llama_cpp_around_special_tokens() {
    let tok = load("vocab/spm-llama.gguf");
    let think = tok.token_to_id("<think>").expect("user-defined token");
    let im_start = tok.token_to_id("<|im_start|>").expect("control token");
    // A user-defined token is cut out even with special-token parsing off, and the text after
    // it gets the space prefix again (sentencepiece would not add it there).
    let ids = tok.tokenize("<think>x", false, false).unwrap();
    assert_eq!(ids[0], think);
    assert_eq!(ids[1..], tok.tokenize("x", false, false).unwrap()[..]);
    // A control token only matches with parsing on; then the text after it is prefixed too.
    let plain = tok.tokenize("<|im_start|>x", false, false).unwrap();
    assert!(!plain.contains(&im_start));
    let parsed = tok.tokenize("<|im_start|>x", false, true).unwrap();
    assert_eq!(parsed[0], im_start);
    assert_eq!(parsed[1..], tok.tokenize("x", false, false).unwrap()[..]);
    // Characters outside the vocabulary (this fox is not in the training text) fall back to
    // their UTF-8 bytes, and decode back.
    let fox = "\u{1F98A}";
    assert_eq!(tok.token_to_id(fox), None);
    let ids = tok.tokenize(fox, false, false).unwrap();
    let bytes: Vec<String> = fox.bytes().map(|b| format!("<0x{b:02X}>")).collect();
    let pieces: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
    assert_eq!(pieces[pieces.len().saturating_sub(4)..], bytes[..], "{pieces:?}");
    assert_eq!(tok.decode(&ids, false), fox);
    // BOS from the file, added by default for this model type; EOS only on request.
    assert!(tok.add_bos() && !tok.add_eos());
    assert_eq!(tok.tokenize("", true, false).unwrap(), vec![tok.bos_token_id().unwrap()]);
    assert_eq!(tok.decode(&[tok.bos_token_id().unwrap()], true), "");
    assert!(tok.is_special(im_start) && !tok.is_special(think));
    // One token on its own: decode drops the prefix space, token_text (logprobs) keeps it.
    let ids = tok.tokenize("hello world", false, false).unwrap();
    let first = ids[0];
    assert!(tok.id_to_token(first).unwrap().starts_with('\u{2581}'), "{:?}", tok.id_to_token(first));
    let alone = tok.decode(&[first], false);
    assert!(!alone.starts_with(' ') && tok.token_text(first) == format!(" {alone}"));
    let joined: String = ids.iter().map(|&i| tok.token_text(i)).collect();
    assert_eq!(joined, " hello world");

    let noprefix = load("vocab/spm-llama-noprefix.gguf");
    assert!(!noprefix.add_bos(), "add_bos_token = false in the file");
    let a = noprefix.tokenize("hello world", false, false).unwrap();
    assert_eq!(noprefix.decode(&a, false), "hello world");
    assert!(!noprefix.id_to_token(a[0]).unwrap().starts_with('\u{2581}'), "no space prefix");
}

/// Streaming detokenization gives the same text as decoding all ids at once, for both
/// SentencePiece files (prefix space stripped at the start only, byte-fallback runs held back
/// until complete) and a byte-level one.
#[test]
fn incremental_decoder_matches_full_decode() {
    use torus_wgpu::tokenizer::IncrementalDecoder;
    for file in ["vocab/spm-llama.gguf", "vocab/spm-llama-noprefix.gguf", "vocab/bpe-llama-bpe.gguf"] {
        let tok = load(file);
        for (name, text) in hard_strings() {
            let ids = tok.tokenize(&text, false, true).unwrap();
            for skip_special in [false, true] {
                let mut dec = IncrementalDecoder::new(skip_special);
                let mut streamed = String::new();
                for &id in &ids {
                    let piece = dec.push(&tok, id);
                    assert!(!piece.contains('\u{FFFD}'), "{file} {name}: broken character in {piece:?}");
                    streamed.push_str(&piece);
                }
                streamed.push_str(&dec.finish(&tok));
                assert_eq!(streamed, tok.decode(&ids, skip_special), "{file} {name} skip_special={skip_special}");
            }
        }
    }
}

#[test]
fn vocab_only_files_have_no_tensors() {
    for entry in std::fs::read_dir(fixtures().join("vocab")).expect("tests/fixtures/vocab") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "gguf") {
            let g = GgufFile::open(&path).unwrap();
            assert!(g.tensors.is_empty(), "{}", path.display());
            assert!(std::fs::metadata(&path).unwrap().len() < 2 << 20, "{}: keep fixtures small", path.display());
        }
    }
}

#[test]
fn unknown_pre_tokenizer_and_model_are_errors_naming_them() {
    let path = fixtures().join("vocab/bad-pre.gguf");
    let err = format!("{:#}", Tokenizer::from_path(&path).unwrap_err());
    assert!(err.contains("\"mystery-pre\"") && err.contains("tokenizer.ggml.pre"), "{err}");
    assert!(err.contains(&path.display().to_string()), "{err}");
    for name in supported_pre_tokenizers() {
        assert!(err.contains(name), "the error should list {name}: {err}");
    }
    let path = fixtures().join("vocab/bad-model.gguf");
    let err = format!("{:#}", Tokenizer::from_path(&path).unwrap_err());
    assert!(err.contains("\"mystery-model\"") && err.contains("\"gpt2\"") && err.contains("\"llama\""), "{err}");
}

// ---------------------------------------------------------------------------------------------
// The `tokenize` command.

fn torus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_torus-wgpu")).args(args).output().expect("run torus-wgpu")
}

fn ok_stdout(args: &[&str]) -> String {
    let out = torus(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?} failed: {stderr}");
    String::from_utf8(out.stdout).expect("UTF-8 stdout")
}

fn json_ids(stdout: &str) -> Vec<u32> {
    assert!(stdout.ends_with('\n') && stdout.lines().count() == 1, "one line: {stdout:?}");
    ids_of(&serde_json::from_str(stdout).unwrap_or_else(|e| panic!("{stdout:?}: {e}")))
}

/// Runs the command and checks that it failed cleanly with a message containing `needle`.
fn expect_failure(args: &[&str], needle: &str) {
    let out = torus(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    assert!(stderr.contains(needle), "{args:?}: {needle:?} not in {stderr}");
    assert!(out.stdout.is_empty(), "{args:?} printed {:?}", String::from_utf8_lossy(&out.stdout));
}

fn case<'a>(entry: &'a Value, name: &str) -> &'a Value {
    entry["cases"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no case {name}"))
}

#[test]
fn tokenize_command_on_vocab_only_files() {
    let exp = expected();
    let tmp = std::env::temp_dir().join(format!("torus-tokenize-cli-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let spm = &exp["spm"][0];
    let llama3 = exp["bpe"].as_array().unwrap().iter().find(|e| e["pre"] == "llama-bpe").unwrap();
    for (entry, names) in [
        (spm, ["special_text", "crlf", "emoji", "python_code"]),
        (llama3, ["special_text", "crlf", "cjk", "ignore_merges"]),
    ] {
        let model = fixtures().join(entry["file"].as_str().unwrap());
        let model = model.to_str().unwrap();
        let bos = entry["bos_id"].as_u64().unwrap() as u32;
        for name in names {
            let c = case(entry, name);
            let text = c["text"].as_str().unwrap();
            let want = ids_of(&c["ids"]);
            // Default: no BOS, special-token text is plain text.
            assert_eq!(json_ids(&ok_stdout(&["tokenize", "--model", model, "--text", text])), want, "{name}");
            let special = json_ids(&ok_stdout(&["tokenize", "--model", model, "--text", text, "--parse-special"]));
            assert_eq!(special, ids_of(&c["ids_parse_special"]), "{name}");
            let with_bos =
                json_ids(&ok_stdout(&["tokenize", "--model", model, "--text", text, "--add-special-tokens"]));
            assert_eq!(with_bos, [vec![bos], want.clone()].concat(), "{name}");
            // The same text from a file.
            let file = tmp.join(format!("{name}.txt"));
            std::fs::write(&file, text).unwrap();
            let from_file =
                json_ids(&ok_stdout(&["tokenize", "--model", model, "--text-file", file.to_str().unwrap()]));
            assert_eq!(from_file, want, "{name} from a file");
            // --decode round trip, from the argument and from a file.
            let ids_json = serde_json::to_string(&want).unwrap();
            let decoded = ok_stdout(&["tokenize", "--model", model, "--decode", "--text", &ids_json]);
            let want_text = c.get("decoded").and_then(|d| d.as_str()).unwrap_or(text);
            assert_eq!(decoded, format!("{want_text}\n"), "{name} decode");
            let ids_file = tmp.join(format!("{name}.json"));
            std::fs::write(&ids_file, &ids_json).unwrap();
            let decoded =
                ok_stdout(&["tokenize", "--model", model, "--decode", "--text-file", ids_file.to_str().unwrap()]);
            assert_eq!(decoded, format!("{want_text}\n"), "{name} decode from a file");
        }
    }
    // Special tokens: rendered by default, left out with --skip-special-tokens.
    let model = fixtures().join("vocab/spm-llama.gguf");
    let model = model.to_str().unwrap();
    let ids = json_ids(&ok_stdout(&["tokenize", "--model", model, "--text", "<|im_start|>hi", "--parse-special"]));
    let ids_json = serde_json::to_string(&ids).unwrap();
    assert_eq!(ok_stdout(&["tokenize", "--model", model, "--decode", "--text", &ids_json]), "<|im_start|> hi\n");
    let skipped = ok_stdout(&["tokenize", "--model", model, "--decode", "--text", &ids_json, "--skip-special-tokens"]);
    assert_eq!(skipped, "hi\n");
    // The empty text and the empty list.
    assert_eq!(ok_stdout(&["tokenize", "--model", model, "--text", ""]), "[]\n");
    assert_eq!(ok_stdout(&["tokenize", "--model", model, "--decode", "--text", "[]"]), "\n");
    std::fs::remove_dir_all(&tmp).ok();
}

#[test]
fn tokenize_command_on_a_hugging_face_directory() {
    let dir = crate_dir().join("tests/fixtures/tiny-qwen2");
    assert!(dir.join("tokenizer.json").is_file(), "{}: fixture missing", dir.display());
    let tok = Tokenizer::from_path(&dir).unwrap();
    let text = "Hello <|im_start|> world 12345";
    let dir = dir.to_str().unwrap();
    let plain = json_ids(&ok_stdout(&["tokenize", "--model", dir, "--text", text]));
    assert_eq!(plain, tok.tokenize(text, false, false).unwrap());
    let parsed = json_ids(&ok_stdout(&["tokenize", "--model", dir, "--text", text, "--parse-special"]));
    assert_eq!(parsed, tok.encode_raw(text).unwrap());
    assert_ne!(plain, parsed, "<|im_start|> is one token only when parsed");
}

#[test]
fn tokenize_command_rejects_bad_input() {
    let spm = fixtures().join("vocab/spm-llama.gguf");
    let spm = spm.to_str().unwrap();
    let missing = std::env::temp_dir().join("torus-no-such-model.gguf");
    let missing = missing.to_str().unwrap();
    expect_failure(&["tokenize", "--model", missing, "--text", "x"], "no such file or directory");
    expect_failure(&["tokenize", "--model", spm, "--text-file", missing], "cannot read");
    expect_failure(&["tokenize", "--model", spm, "--decode", "--text", "[1, 2"], "JSON array of token ids");
    expect_failure(&["tokenize", "--model", spm, "--decode", "--text", "hello"], "JSON array of token ids");
    expect_failure(&["tokenize", "--model", spm, "--decode", "--text", "{\"a\": 1}"], "JSON array of token ids");
    expect_failure(&["tokenize", "--model", spm, "--decode", "--text", "[1, -2]"], "index 1");
    expect_failure(&["tokenize", "--model", spm, "--decode", "--text", "[1, 2.5]"], "not a non-negative integer");
    expect_failure(&["tokenize", "--model", spm, "--decode", "--text", "[1, 800]"], "out of range");
    expect_failure(&["tokenize", "--model", spm, "--decode", "--text", "[99999999999]"], "not a non-negative integer");
    expect_failure(&["tokenize", "--model", spm], "--text");
    let bad_pre = fixtures().join("vocab/bad-pre.gguf");
    expect_failure(&["tokenize", "--model", bad_pre.to_str().unwrap(), "--text", "x"], "mystery-pre");
    let bad_model = fixtures().join("vocab/bad-model.gguf");
    expect_failure(&["tokenize", "--model", bad_model.to_str().unwrap(), "--text", "x"], "mystery-model");
    // A GGUF that is not one: an error, not a panic.
    let not_gguf = fixtures().join("tokenizer_strings.json");
    expect_failure(&["tokenize", "--model", not_gguf.to_str().unwrap(), "--text", "x"], "GGUF");
}
