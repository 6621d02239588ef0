//! GGUF (llama.cpp) file reader, versions 2 and 3, little-endian.
//!
//! The file is memory-mapped; metadata and tensor descriptions are parsed eagerly, tensor bytes
//! are borrowed from the map on demand ([`GgufFile::tensor_data`]).
//!
//! Every malformed input is reported as an error (one line: `<path>: <problem>`), never a panic:
//! lengths and counts read from the file are checked against the bytes actually left before
//! anything is allocated for them, nested arrays are depth-limited, and every tensor's data must
//! lie inside the file.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};
use memmap2::Mmap;

pub use super::gguf_types::{GgmlType, GgufValue};
pub use super::gguf_write::{encode_header, GgufHeader, GgufTensorSpec};

pub(super) const GGUF_MAGIC: &[u8; 4] = b"GGUF";
pub(super) const DEFAULT_ALIGNMENT: u64 = 32;
pub(super) const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal in GGUF but never used in practice; bound the recursion.
const MAX_ARRAY_NESTING: usize = 4;

/// Where one tensor lives in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (innermost) row length. A PyTorch `[out, in]`
    /// weight is stored as `dims = [in, out]`.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: u64,
    /// Size of the tensor's data in bytes; 0 when the type code is unknown to ggml (so the size
    /// cannot be computed).
    pub n_bytes: u64,
    /// The part of a split file it is in (0: the first, or an unsplit file; see `gguf_split`).
    pub part: usize,
}

impl GgufTensorInfo {
    /// Number of elements (product of dims; 1 for a 0-d tensor).
    pub fn n_elements(&self) -> u64 {
        // Overflow was ruled out when the file was opened.
        self.dims.iter().product()
    }

    /// Dims in PyTorch order (outermost first), e.g. `[out, in]` for a linear weight.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// An opened GGUF file: metadata, tensor table and a read-only memory map of the whole file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    /// Absolute offset where tensor data begins (aligned to `alignment`).
    pub data_offset: u64,
    pub alignment: u64,
    mmap: Mmap,
    /// The other parts of a split file, in order (empty for one file).
    parts: Vec<Mmap>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("data_offset", &self.data_offset)
            .field("alignment", &self.alignment)
            .field("file_len", &self.mmap.len())
            .finish()
    }
}

/// Bounds-checked little-endian reader over the mapped bytes. Errors are problem descriptions
/// without the path (the caller adds it).
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "truncated file: {} needs {} bytes at offset {}, but the file is {} bytes",
                what(),
                n,
                self.pos,
                self.buf.len()
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], String> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &dyn Fn() -> String) -> Result<u8, String> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &dyn Fn() -> String) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length (u64) that must be satisfiable by the bytes left, given each item takes at
    /// least `min_item_bytes`.
    fn count(&mut self, min_item_bytes: usize, what: &dyn Fn() -> String) -> Result<usize, String> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_item_bytes.max(1)))
            .is_some_and(|need| need <= self.remaining());
        if !fits {
            return Err(format!(
                "{} is {} but only {} bytes are left in the file (corrupt or truncated)",
                what(),
                n,
                self.remaining()
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, String> {
        let len = self.count(1, &|| format!("length of {}", what()))?;
        let bytes = self.take(len, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: u32, depth: usize, what: &dyn Fn() -> String) -> Result<GgufValue, String> {
        Ok(match ty {
            0 => GgufValue::U8(self.u8(what)?),
            1 => GgufValue::I8(self.u8(what)? as i8),
            2 => GgufValue::U16(self.u16(what)?),
            3 => GgufValue::I16(self.u16(what)? as i16),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(self.u32(what)? as i32),
            6 => GgufValue::F32(f32::from_bits(self.u32(what)?)),
            7 => match self.u8(what)? {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("{} is a bool with invalid byte {b}", what())),
            },
            8 => GgufValue::Str(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(format!("{} nests arrays more than {MAX_ARRAY_NESTING} deep", what()));
                }
                let elem_ty = self.u32(&|| format!("element type of {}", what()))?;
                let min =
                    min_value_bytes(elem_ty).ok_or_else(|| format!("{} has unknown element type {elem_ty}", what()))?;
                let n = self.count(min, &|| format!("element count of {}", what()))?;
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(self.value(elem_ty, depth + 1, &|| format!("{}[{i}]", what()))?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(self.u64(what)? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64(what)?)),
            t => return Err(format!("{} has unknown value type {t}", what())),
        })
    }
}

/// Fewest bytes a value of this GGUF type can occupy (for bounding counts before allocating).
fn min_value_bytes(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,     // u64 length
        9 => 4 + 8, // element type + count
        10..=12 => 8,
        _ => return None,
    })
}

impl GgufFile {
    /// Open and parse a GGUF file, with the other parts of a split one (`gguf_split`: opening
    /// the first part joins them). The tensor bytes are not read (they are memory-mapped).
    pub fn open(path: &Path) -> Result<Self> {
        let mut g = Self::open_one(path)?;
        let count = super::gguf_split::split_count(&g)?;
        for i in 1..count {
            let part = Self::open_one(&super::gguf_split::part_path(path, i, count)?)?;
            let tensors = super::gguf_split::part_tensors(&part, i, count)?;
            g.tensors.extend(tensors);
            g.parts.push(part.mmap);
        }
        if count > 1 {
            super::gguf_split::check_joined(&g, &g.tensors)?;
        }
        Ok(g)
    }

    fn open_one(path: &Path) -> Result<Self> {
        let p = path.display();
        let file = File::open(path).map_err(|e| anyhow!("{p}: cannot open GGUF file: {e}"))?;
        let len = file.metadata().map_err(|e| anyhow!("{p}: cannot stat GGUF file: {e}"))?.len();
        if len < 4 {
            bail!("{p}: not a GGUF file (only {len} bytes)");
        }
        // SAFETY: the map is read-only and private to this struct; like every mmap-based model
        // loader we assume the file is not modified while it is open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| anyhow!("{p}: cannot memory-map file: {e}"))?;
        let parsed = parse(&mmap).map_err(|problem| anyhow!("{p}: {problem}"))?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            data_offset: parsed.data_offset,
            alignment: parsed.alignment,
            mmap,
            parts: vec![],
        })
    }

    /// Size of the file in bytes (of every part of a split file).
    pub fn file_len(&self) -> u64 {
        self.mmap.len() as u64 + self.parts.iter().map(|m| m.len() as u64).sum::<u64>()
    }

    /// The map holding part `i`'s bytes.
    fn map(&self, part: usize) -> Option<&Mmap> {
        if part == 0 {
            Some(&self.mmap)
        } else {
            self.parts.get(part - 1)
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's raw bytes (`n_bytes` of them; empty for a tensor whose type layout is
    /// unknown). Bounds were checked at open; a `GgufTensorInfo` from another file (or edited
    /// by hand) that does not fit yields an empty slice rather than a panic.
    pub fn tensor_data(&self, t: &GgufTensorInfo) -> &[u8] {
        let start = t.offset as usize;
        let end = t.offset.saturating_add(t.n_bytes) as usize;
        self.map(t.part).and_then(|m| m.get(start..end)).unwrap_or(&[])
    }

    /// Lets go of the pages of the map read so far (see `formats::release_pages`).
    pub fn release_pages(&self) {
        super::release_pages(&self.mmap);
        for m in &self.parts {
            super::release_pages(m);
        }
    }

    /// Lets go of the pages of one tensor's data (a large tensor once copied out).
    pub fn release_tensor_pages(&self, t: &GgufTensorInfo) {
        if let Some(m) = self.map(t.part).filter(|m| t.offset.saturating_add(t.n_bytes) <= m.len() as u64) {
            super::release_range(m, t.offset as usize, t.n_bytes as usize);
        }
    }

    /// The whole mapped file (the first part of a split one).
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// Any integer type whose value fits in u32.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.get(key)?.as_u32()
    }

    /// Any integer type whose value fits in u64.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// f32, f64 or any integer.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    pub fn get_array(&self, key: &str) -> Option<&[GgufValue]> {
        self.get(key)?.as_array()
    }

    /// An array whose every element is a string.
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get_array(key)?.iter().map(|v| v.as_str()).collect()
    }

    /// An array whose every element is an integer fitting in i32.
    pub fn get_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.get_array(key)?.iter().map(|v| v.as_i32()).collect()
    }

    /// An array whose every element is a number (f32/f64/int).
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get_array(key)?.iter().map(|v| v.as_f32()).collect()
    }

    fn require<'a, T>(&'a self, key: &str, want: &str, f: impl FnOnce(&'a GgufValue) -> Option<T>) -> Result<T> {
        match self.get(key) {
            None => bail!("{}: missing metadata key {key}", self.path.display()),
            Some(v) => f(v).ok_or_else(|| {
                anyhow!(
                    "{}: metadata key {key} should be {want}, found {} {}",
                    self.path.display(),
                    v.type_name(),
                    truncate_for_message(&v.to_string())
                )
            }),
        }
    }

    pub fn require_u32(&self, key: &str) -> Result<u32> {
        self.require(key, "an integer fitting in u32", GgufValue::as_u32)
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.require(key, "a non-negative integer", GgufValue::as_u64)
    }

    pub fn require_f32(&self, key: &str) -> Result<f32> {
        self.require(key, "a number", GgufValue::as_f32)
    }

    pub fn require_bool(&self, key: &str) -> Result<bool> {
        self.require(key, "a bool", GgufValue::as_bool)
    }

    pub fn require_str(&self, key: &str) -> Result<&str> {
        self.require(key, "a string", GgufValue::as_str)
    }

    pub fn require_str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.require(key, "an array of strings", |v| v.as_array()?.iter().map(|x| x.as_str()).collect())
    }

    pub fn require_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.require(key, "an array of integers", |v| v.as_array()?.iter().map(|x| x.as_i32()).collect())
    }

    /// `general.architecture` (e.g. "llama", "qwen2").
    pub fn architecture(&self) -> Result<String> {
        self.require_str("general.architecture").map(str::to_string)
    }

    /// `<architecture>.<suffix>`, e.g. `arch_key("block_count")` -> `llama.block_count`.
    pub fn arch_key(&self, suffix: &str) -> Result<String> {
        Ok(format!("{}.{suffix}", self.architecture()?))
    }
}

fn truncate_for_message(s: &str) -> String {
    const MAX: usize = 80;
    let one_line = s.replace('\n', "\\n");
    if one_line.chars().count() <= MAX {
        one_line
    } else {
        let cut: String = one_line.chars().take(MAX).collect();
        format!("{cut}...")
    }
}

struct Parsed {
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    data_offset: u64,
    alignment: u64,
}

fn parse(buf: &[u8]) -> Result<Parsed, String> {
    let mut r = Reader { buf, pos: 0 };
    let magic = r.array::<4>(&|| "magic".into())?;
    if &magic != GGUF_MAGIC {
        return Err(format!("not a GGUF file (magic bytes {:02x?}, expected \"GGUF\")", magic));
    }
    let version = r.u32(&|| "version".into())?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 is not supported (only versions 2 and 3)".into()),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => return Err("big-endian GGUF files are not supported".into()),
        v => return Err(format!("unsupported GGUF version {v} (only versions 2 and 3)")),
    }
    // Minimum size of one tensor description: name length, n_dims, type, offset.
    let n_tensors = r.count(8 + 4 + 4 + 8, &|| "tensor count".into())?;
    // Minimum size of one key/value: key length, value type, one byte of value.
    let n_kv = r.count(8 + 4 + 1, &|| "metadata count".into())?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = r.string(&|| format!("key of metadata entry {i}"))?;
        let ty = r.u32(&|| format!("type of metadata key {key}"))?;
        let value = r.value(ty, 0, &|| format!("metadata key {key}"))?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(format!("duplicate metadata key {key}"));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => return Err(format!("general.alignment must be a power of two, found {v}")),
        },
    };

    struct RawTensor {
        name: String,
        dims: Vec<u64>,
        ty: GgmlType,
        rel_offset: u64,
    }
    let mut raw = Vec::with_capacity(n_tensors);
    let mut names = std::collections::HashSet::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = r.string(&|| format!("name of tensor {i}"))?;
        let n_dims = r.u32(&|| format!("dimension count of tensor {name}"))?;
        if n_dims > MAX_DIMS {
            return Err(format!("tensor {name} has {n_dims} dimensions (at most {MAX_DIMS} supported)"));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(r.u64(&|| format!("dimension {d} of tensor {name}"))?);
        }
        let ty = GgmlType::from_code(r.u32(&|| format!("type of tensor {name}"))?);
        let rel_offset = r.u64(&|| format!("data offset of tensor {name}"))?;
        if !names.insert(name.clone()) {
            return Err(format!("duplicate tensor name {name}"));
        }
        raw.push(RawTensor { name, dims, ty, rel_offset });
    }

    let header_end = r.pos as u64;
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    let mut tensors = Vec::with_capacity(raw.len());
    for t in raw {
        let name = t.name;
        let n_elements = t
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("tensor {name} has an impossibly large shape {:?}", t.dims))?;
        let n_bytes = match t.ty.block_size() {
            None => 0,
            Some(block) => {
                let row = t.dims.first().copied().unwrap_or(1);
                if !row.is_multiple_of(block as u64) {
                    return Err(format!(
                        "tensor {name} of type {} has row length {row}, not a multiple of its block size {block}",
                        t.ty
                    ));
                }
                t.ty.bytes_for(n_elements)
                    .ok_or_else(|| format!("tensor {name} has an impossibly large shape {:?}", t.dims))?
            }
        };
        if !t.rel_offset.is_multiple_of(alignment) {
            return Err(format!(
                "tensor {name} data offset {} is not a multiple of the alignment {alignment}",
                t.rel_offset
            ));
        }
        let offset = data_offset
            .checked_add(t.rel_offset)
            .ok_or_else(|| format!("tensor {name} has an impossible data offset {}", t.rel_offset))?;
        let end = offset.checked_add(n_bytes);
        if end.is_none_or(|end| end > file_len) || offset > file_len {
            return Err(format!(
                "tensor {name} extends past end of file (truncated?): its data spans bytes {offset}..{} but the file is {file_len} bytes",
                end.map_or_else(|| "overflow".to_string(), |e| e.to_string())
            ));
        }
        tensors.push(GgufTensorInfo { name, dims: t.dims, ggml_type: t.ty, offset, n_bytes, part: 0 });
    }

    Ok(Parsed { version, metadata, tensors, data_offset, alignment })
}
