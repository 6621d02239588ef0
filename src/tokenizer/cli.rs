//! `torus-wgpu tokenize`: text to token ids (or ids to text) with a model's tokenizer. Needs no
//! GPU and no weights: a vocab-only GGUF file is enough.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value as Json;

use super::Tokenizer;

#[derive(clap::Args, Debug)]
pub struct TokenizeArgs {
    /// A .gguf file (vocab-only files work) or a Hugging Face model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The text to tokenize; with --decode, a JSON array of token ids such as "[1,2,3]".
    #[arg(long, conflicts_with = "text_file", required_unless_present = "text_file")]
    pub text: Option<String>,
    /// Read the text (or, with --decode, the JSON array of ids) from this file.
    #[arg(long)]
    pub text_file: Option<PathBuf>,
    /// Add the model's BOS/EOS tokens as it asks for them (off by default).
    #[arg(long, conflicts_with = "decode")]
    pub add_special_tokens: bool,
    /// Turn special-token text such as "<|im_start|>" into its id (off: it is plain text).
    #[arg(long, conflicts_with = "decode")]
    pub parse_special: bool,
    /// Decode a JSON array of ids to text instead (printed followed by a newline).
    #[arg(long)]
    pub decode: bool,
    /// With --decode: leave special tokens out of the text.
    #[arg(long, requires = "decode")]
    pub skip_special_tokens: bool,
}

/// Run the command, printing to stdout.
pub fn run(args: &TokenizeArgs) -> Result<()> {
    let input = match (&args.text, &args.text_file) {
        (Some(t), _) => t.clone(),
        (None, Some(path)) => read_text_file(path)?,
        (None, None) => bail!("give --text or --text-file"),
    };
    let tok = Tokenizer::from_path(&args.model)?;
    let out = if args.decode {
        let ids = parse_ids(&input, tok.vocab_size())?;
        let mut text = tok.decode(&ids, args.skip_special_tokens);
        text.push('\n');
        text
    } else {
        let ids = tok.tokenize(&input, args.add_special_tokens, args.parse_special)?;
        format!("{}\n", serde_json::to_string(&ids)?)
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes()).and_then(|_| stdout.flush()).context("cannot write to stdout")
}

fn read_text_file(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| anyhow!("{}: cannot read: {e}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| anyhow!("{}: not UTF-8 text: {e}", path.display()))
}

/// A JSON array of token ids, each below `vocab_size`.
pub fn parse_ids(s: &str, vocab_size: usize) -> Result<Vec<u32>> {
    let v: Json = serde_json::from_str(s.trim())
        .map_err(|e| anyhow!("--decode expects a JSON array of token ids such as [1, 2, 3]: {e}"))?;
    let Json::Array(items) = v else {
        bail!("--decode expects a JSON array of token ids such as [1, 2, 3], got {}", short(&v));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let id = x
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| anyhow!("token id at index {i} is {}, not a non-negative integer", short(x)))?;
            if id as usize >= vocab_size {
                bail!("token id {id} at index {i} is out of range (the vocabulary has {vocab_size} tokens)");
            }
            Ok(id)
        })
        .collect()
}

fn short(v: &Json) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}
