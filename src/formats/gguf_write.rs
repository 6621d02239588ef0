//! Writing GGUF version 3 headers (the synthetic models, split files and tests write their
//! files through `encode_header`); the reader (`gguf`) parses what this writes.

use super::gguf::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use super::gguf_types::{GgmlType, GgufValue};
use anyhow::{anyhow, bail, Result};

/// One tensor of a GGUF file to be written: its name, ggml dims (innermost first) and type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
}

impl GgufTensorSpec {
    /// Bytes of the tensor's data; `None` when the type is unknown or the row length is not a
    /// whole number of blocks.
    pub fn n_bytes(&self) -> Option<u64> {
        let block = self.ggml_type.block_size()? as u64;
        if !self.dims.first().copied().unwrap_or(1).is_multiple_of(block) {
            return None;
        }
        self.ggml_type.bytes_for(self.dims.iter().product())
    }
}

/// A GGUF header: everything before the tensor data.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    /// Magic, version 3, counts, metadata and tensor descriptions, zero-padded to the alignment
    /// (so the tensor data starts right after these bytes).
    pub bytes: Vec<u8>,
    /// Each tensor's data offset from the start of the data section (aligned), in `tensors`
    /// order.
    pub offsets: Vec<u64>,
    /// Size of the data section: every tensor's data with the padding between them.
    pub data_len: u64,
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl GgufValue {
    /// The GGUF value type code.
    fn type_code(&self) -> u32 {
        match self {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::Str(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    /// Appends the value (without its type code) as GGUF stores it. Every element of an array
    /// must have the first element's type.
    fn encode(&self, out: &mut Vec<u8>) -> Result<(), String> {
        match self {
            GgufValue::U8(v) => out.push(*v),
            GgufValue::I8(v) => out.push(*v as u8),
            GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::Bool(v) => out.push(*v as u8),
            GgufValue::Str(s) => put_string(out, s),
            GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
            GgufValue::Array(items) => {
                let ty = items.first().map_or(0, GgufValue::type_code);
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for (i, v) in items.iter().enumerate() {
                    if v.type_code() != ty {
                        return Err(format!(
                            "array element {i} is a {}, not a {}",
                            v.type_name(),
                            items[0].type_name()
                        ));
                    }
                    v.encode(out)?;
                }
            }
        }
        Ok(())
    }
}

/// Encodes a GGUF version 3 header for `metadata` (in order) and `tensors`, whose data will
/// follow in `tensors` order, each at a multiple of the default alignment (32 bytes). The
/// reader above parses what this writes.
pub fn encode_header(metadata: &[(String, GgufValue)], tensors: &[GgufTensorSpec]) -> Result<GgufHeader> {
    let mut out = Vec::new();
    out.extend_from_slice(GGUF_MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        put_string(&mut out, key);
        out.extend_from_slice(&value.type_code().to_le_bytes());
        value.encode(&mut out).map_err(|e| anyhow!("metadata key {key}: {e}"))?;
    }
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut at = 0u64;
    for t in tensors {
        if t.dims.len() > MAX_DIMS as usize {
            bail!("tensor {}: {} dimensions (at most {MAX_DIMS})", t.name, t.dims.len());
        }
        let n = t.n_bytes().ok_or_else(|| {
            anyhow!(
                "tensor {}: type {} cannot hold shape {:?} (unknown type or partial block)",
                t.name,
                t.ggml_type,
                t.dims
            )
        })?;
        put_string(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ggml_type.code().to_le_bytes());
        out.extend_from_slice(&at.to_le_bytes());
        offsets.push(at);
        at = (at + n).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
    }
    out.resize((out.len() as u64).div_ceil(DEFAULT_ALIGNMENT) as usize * DEFAULT_ALIGNMENT as usize, 0);
    let data_len = match (tensors.last(), offsets.last()) {
        (Some(t), Some(&o)) => o + t.n_bytes().unwrap_or(0),
        _ => 0,
    };
    Ok(GgufHeader { bytes: out, offsets, data_len })
}
