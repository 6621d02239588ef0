//! Which of a repository's files a model is: a GGUF repository's file of the quantization asked
//! for (every part of a split file), or a Transformers repository's weights, config and
//! tokenizer files. Pure functions over file names, so they serve the Hub's listing and a cached
//! snapshot's alike.

/// The quantization taken when none is named (llama.cpp's and Ollama's default).
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// What to fetch: the files, and the one to load (a GGUF file, its first part; or the snapshot
/// directory, as `None`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub files: Vec<String>,
    pub entry: Option<String>,
}

/// `name`'s split part as (index, count), for llama.cpp's `-00001-of-00003.gguf` names.
pub fn split_part(name: &str) -> Option<(u32, u32)> {
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (_, index) = rest.rsplit_once('-')?;
    let ok = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !ok(index) || !ok(count) {
        return None;
    }
    Some((index.parse().ok()?, count.parse().ok()?))
}

/// The quantization tag of a GGUF file name (`Qwen3-8B-Q4_K_M.gguf` -> `Q4_K_M`), read as the
/// last `-` or `.` separated part before the extension and the split suffix.
pub fn quant_of(name: &str) -> Option<String> {
    let base = name.rsplit('/').next().unwrap_or(name);
    let mut stem = base.strip_suffix(".gguf")?;
    if split_part(base).is_some() {
        stem = stem.rsplit_once("-of-")?.0.rsplit_once('-')?.0;
    }
    let tag = stem.rsplit(['-', '.']).next()?;
    let up = tag.to_ascii_uppercase();
    let known = up.starts_with('Q') || up.starts_with("IQ") || ["F16", "BF16", "F32", "MXFP4"].contains(&up.as_str());
    (known && up.len() > 1).then_some(up)
}

fn is_gguf(name: &str) -> bool {
    name.ends_with(".gguf") && !name.rsplit('/').next().unwrap_or(name).starts_with("mmproj")
}

/// The files of `quant` (or the default, else the first GGUF) among `names`; an error lists the
/// quantizations there are. A repository without GGUF files is read as a Transformers one.
pub fn select(repo: &str, names: &[String], quant: Option<&str>) -> Result<Selection, String> {
    let ggufs: Vec<&String> = names.iter().filter(|n| is_gguf(n)).collect();
    if ggufs.is_empty() {
        return transformers(repo, names, quant);
    }
    let mut quants: Vec<String> = ggufs.iter().filter_map(|n| quant_of(n)).collect();
    quants.sort();
    quants.dedup();
    let want = quant.map(str::to_ascii_uppercase);
    let pick =
        |q: &str| -> Vec<&String> { ggufs.iter().copied().filter(|n| quant_of(n).as_deref() == Some(q)).collect() };
    let chosen: Vec<&String> = match &want {
        Some(q) => pick(q),
        None if quants.iter().any(|q| q == DEFAULT_QUANT) => pick(DEFAULT_QUANT),
        None => {
            let mut all = ggufs.clone();
            all.sort();
            let first = all[0];
            match quant_of(first) {
                Some(q) => pick(&q),
                None => vec![first],
            }
        }
    };
    if chosen.is_empty() {
        let there = if quants.is_empty() { "none named by quantization".to_string() } else { quants.join(", ") };
        return Err(format!("{repo} has no GGUF file of quantization {} (it has: {there})", want.unwrap_or_default()));
    }
    // One file, or every part of one split file (the first file's set, when a quantization has
    // several models in different folders).
    let mut chosen: Vec<String> = chosen.into_iter().cloned().collect();
    chosen.sort();
    let first = chosen[0].clone();
    let files = match split_part(&first) {
        Some((_, count)) => {
            let prefix = &first[..first.len() - "00001-of-00003.gguf".len()];
            let parts: Vec<String> =
                chosen.iter().filter(|n| n.starts_with(prefix) && split_part(n).is_some()).cloned().collect();
            if parts.len() != count as usize {
                return Err(format!(
                    "{repo}: {first} is part 1 of {count}, but the repository has {} of its parts",
                    parts.len()
                ));
            }
            parts
        }
        None => vec![first.clone()],
    };
    Ok(Selection { entry: Some(files[0].clone()), files })
}

/// A Transformers repository: its config, tokenizer and generation files and its safetensors
/// weights (with their index); the entry is the snapshot directory.
fn transformers(repo: &str, names: &[String], quant: Option<&str>) -> Result<Selection, String> {
    if let Some(q) = quant {
        return Err(format!("{repo} has no GGUF files, so no quantization {q} to choose (leave out :{q})"));
    }
    const FILES: [&str; 6] = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "model.safetensors.index.json",
    ];
    if !names.iter().any(|n| n == "config.json") || !names.iter().any(|n| n.ends_with(".safetensors")) {
        return Err(format!("{repo} has neither GGUF files nor a Transformers model (config.json and .safetensors)"));
    }
    let files: Vec<String> = names
        .iter()
        .filter(|n| FILES.contains(&n.as_str()) || (!n.contains('/') && n.ends_with(".safetensors")))
        .cloned()
        .collect();
    Ok(Selection { files, entry: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn quantization_tags() {
        assert_eq!(quant_of("Qwen3-8B-Q4_K_M.gguf").as_deref(), Some("Q4_K_M"));
        assert_eq!(quant_of("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf").as_deref(), Some("Q4_K_M"));
        assert_eq!(quant_of("SmolLM2-135M-Instruct.Q4_1.gguf").as_deref(), Some("Q4_1"));
        assert_eq!(quant_of("gpt-oss-20b-mxfp4.gguf").as_deref(), Some("MXFP4"));
        assert_eq!(quant_of("Big-Q8_0-00002-of-00003.gguf").as_deref(), Some("Q8_0"));
        assert_eq!(quant_of("model.gguf"), None);
        assert_eq!(split_part("Big-Q8_0-00002-of-00003.gguf"), Some((2, 3)));
        assert_eq!(split_part("Big-Q8_0.gguf"), None);
    }

    #[test]
    fn gguf_repositories() {
        let repo = names(&["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-IQ2_XS.gguf", "mmproj-m-f16.gguf"]);
        let s = select("o/r", &repo, None).unwrap();
        assert_eq!((s.files, s.entry.as_deref()), (names(&["m-Q4_K_M.gguf"]), Some("m-Q4_K_M.gguf")));
        assert_eq!(select("o/r", &repo, Some("q8_0")).unwrap().files, names(&["m-Q8_0.gguf"]));
        let e = select("o/r", &repo, Some("Q5_K_S")).unwrap_err();
        assert!(e.contains("Q5_K_S") && e.contains("IQ2_XS, Q4_K_M, Q8_0"), "{e}");
        // Without Q4_K_M: the first file's quantization.
        let s = select("o/r", &names(&["b-Q8_0.gguf", "a-Q6_K.gguf"]), None).unwrap();
        assert_eq!(s.files, names(&["a-Q6_K.gguf"]));
        // Split files: every part, the first to load; a missing part is an error.
        let split = names(&["B-Q8_0-00002-of-00002.gguf", "B-Q8_0-00001-of-00002.gguf", "B-Q4_K_M.gguf"]);
        let s = select("o/r", &split, Some("Q8_0")).unwrap();
        assert_eq!(s.files, names(&["B-Q8_0-00001-of-00002.gguf", "B-Q8_0-00002-of-00002.gguf"]));
        assert_eq!(s.entry.as_deref(), Some("B-Q8_0-00001-of-00002.gguf"));
        assert!(select("o/r", &split[..1], Some("Q8_0")).unwrap_err().contains("part 1 of 2"));
    }

    #[test]
    fn transformers_repositories() {
        let repo = names(&[
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "README.md",
            "onnx/model.onnx",
        ]);
        let s = select("o/r", &repo, None).unwrap();
        assert_eq!(s.entry, None);
        assert_eq!(s.files.len(), 6, "{:?}", s.files);
        assert!(!s.files.iter().any(|f| f.ends_with(".md") || f.contains('/')));
        assert!(select("o/r", &repo, Some("Q4_K_M")).unwrap_err().contains("no GGUF"));
        assert!(select("o/r", &names(&["README.md"]), None).unwrap_err().contains("neither"));
    }
}
