//! Split GGUF files (llama.cpp's `gguf-split`: `NAME-00001-of-00003.gguf` ...): every part is a
//! GGUF file of its own with `split.no` (0-based), `split.count` and `split.tensors.count`; the
//! first holds the model's metadata, each holds some of the tensors. Opening the first part
//! opens the others beside it and joins their tensor tables (each tensor remembers its part);
//! `write_split` writes such parts from one file (tests, and users who want to cut one).

use super::gguf::{encode_header, GgufFile, GgufTensorInfo, GgufTensorSpec, GgufValue};
use anyhow::{anyhow, bail, Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const SPLIT_NO: &str = "split.no";
pub const SPLIT_COUNT: &str = "split.count";
pub const SPLIT_TENSORS: &str = "split.tensors.count";
/// More parts than this is no file llama.cpp writes (it counts them in a u16).
const MAX_PARTS: u64 = 9999;

/// The path of part `i` (0-based) of `count` beside `first`, whose name must be llama.cpp's
/// `PREFIX-00001-of-NNNNN.gguf`.
pub fn part_path(first: &Path, i: u64, count: u64) -> Result<PathBuf> {
    let name = first.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let suffix = format!("-00001-of-{count:05}.gguf");
    let Some(prefix) = name.strip_suffix(&suffix) else {
        bail!(
            "{}: a split GGUF file of {count} parts must be named PREFIX{suffix} (the first part) to find the others",
            first.display()
        );
    };
    Ok(first.with_file_name(format!("{prefix}-{:05}-of-{count:05}.gguf", i + 1)))
}

/// The split count a file declares (1: not split), checked.
pub fn split_count(g: &GgufFile) -> Result<u64> {
    let Some(n) = g.get(SPLIT_COUNT) else { return Ok(1) };
    let n = n.as_u64().filter(|&n| (1..=MAX_PARTS).contains(&n));
    let n = n.ok_or_else(|| anyhow!("{}: {SPLIT_COUNT} must be 1 to {MAX_PARTS}", g.path.display()))?;
    let no = g.get(SPLIT_NO).and_then(GgufValue::as_u64).unwrap_or(0);
    if n > 1 && no != 0 {
        bail!(
            "{}: this is part {} of a split GGUF file of {n}: open the first part (-00001-of-{n:05}.gguf)",
            g.path.display(),
            no + 1
        );
    }
    Ok(n)
}

/// Checks part `i` of `count` and gives its tensors, marked with their part.
pub fn part_tensors(part: &GgufFile, i: u64, count: u64) -> Result<Vec<GgufTensorInfo>> {
    let p = part.path.display();
    let no = part.get(SPLIT_NO).and_then(GgufValue::as_u64);
    let n = part.get(SPLIT_COUNT).and_then(GgufValue::as_u64);
    if (no, n) != (Some(i), Some(count)) {
        bail!("{p}: expected part {} of {count} (split.no {i}), the file says split.no {no:?} of {n:?}", i + 1);
    }
    Ok(part.tensors.iter().cloned().map(|t| GgufTensorInfo { part: i as usize, ..t }).collect())
}

/// Checks a joined tensor table: names unique, as many tensors as the first part announced.
pub fn check_joined(first: &GgufFile, tensors: &[GgufTensorInfo]) -> Result<()> {
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        bail!("{}: tensor {} is in two parts of the split file", first.path.display(), w[0]);
    }
    if let Some(want) = first.get(SPLIT_TENSORS).and_then(GgufValue::as_u64) {
        if want != tensors.len() as u64 {
            bail!(
                "{}: the split file announces {want} tensors, its parts hold {}",
                first.path.display(),
                tensors.len()
            );
        }
    }
    Ok(())
}

/// Writes `src` as `parts` files `PREFIX-0000i-of-0000N.gguf` (PREFIX: `out_prefix`), the
/// tensors in order, about the same number in each; the first part keeps every metadata key.
pub fn write_split(src: &GgufFile, out_prefix: &Path, parts: usize) -> Result<Vec<PathBuf>> {
    if src.tensors.is_empty() || parts == 0 || parts > src.tensors.len() || parts as u64 > MAX_PARTS {
        bail!("cannot cut {} tensors into {parts} parts", src.tensors.len());
    }
    let per = src.tensors.len().div_ceil(parts);
    let count = src.tensors.len().div_ceil(per);
    let mut out = Vec::new();
    for (i, chunk) in src.tensors.chunks(per).enumerate() {
        let mut meta: Vec<(String, GgufValue)> = Vec::new();
        if i == 0 {
            // The parts are written at the default alignment.
            let skip = [SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS, "general.alignment"];
            meta.extend(
                src.metadata.iter().filter(|(k, _)| !skip.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())),
            );
        }
        meta.push((SPLIT_NO.into(), GgufValue::U16(i as u16)));
        meta.push((SPLIT_COUNT.into(), GgufValue::U16(count as u16)));
        meta.push((SPLIT_TENSORS.into(), GgufValue::I32(src.tensors.len() as i32)));
        let specs: Vec<GgufTensorSpec> = chunk
            .iter()
            .map(|t| GgufTensorSpec { name: t.name.clone(), dims: t.dims.clone(), ggml_type: t.ggml_type })
            .collect();
        let h = encode_header(&meta, &specs)?;
        let name = format!("{}-{:05}-of-{count:05}.gguf", out_prefix.display(), i + 1);
        let path = PathBuf::from(name);
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).with_context(|| path.display().to_string())?);
        f.write_all(&h.bytes)?;
        let mut at = 0u64;
        for (t, &off) in chunk.iter().zip(&h.offsets) {
            f.write_all(&vec![0u8; (off - at) as usize])?;
            let data = src.tensor_data(t);
            f.write_all(data)?;
            at = off + data.len() as u64;
        }
        f.flush()?;
        out.push(path);
    }
    Ok(out)
}
