//! Whether a model's memory plan fits where it is about to be loaded, checked before anything is
//! allocated: the device's memory on a GPU that reports it, and the host's available memory
//! (Linux's MemAvailable): all of the plan on a CPU adapter (llvmpipe/lavapipe: device memory is
//! host memory), the one layer read at a time plus the upload staging elsewhere.
//!
//! `TORUS_HOST_MEMORY` overrides the host's available memory: bytes, or a number with a K, M, G
//! or T suffix (powers of 1024), e.g. `512M`; for tests, and for hosts where MemAvailable says
//! more than the process may use (a cgroup limit).

use super::plan::MemoryPlan;
use crate::gpu::Gpu;
use anyhow::{bail, Result};
use std::path::Path;

/// The environment variable that overrides the host's available memory.
pub const HOST_MEMORY_ENV: &str = "TORUS_HOST_MEMORY";

/// Host bytes a load may hold beyond the weights it reads: allocator slack, the compiled
/// kernels, small buffers' staging copies until a layer is done.
pub const UPLOAD_SLACK: u64 = 256 << 20;

/// The host's available memory: `TORUS_HOST_MEMORY`, else /proc/meminfo's MemAvailable; None
/// where neither is known.
pub fn host_available() -> Result<Option<u64>> {
    if let Some(v) = std::env::var_os(HOST_MEMORY_ENV) {
        let v = v.to_string_lossy();
        return match parse_bytes(&v) {
            Some(b) => Ok(Some(b)),
            None => bail!("{HOST_MEMORY_ENV}={v}: expected bytes, or a number with a K, M, G or T suffix"),
        };
    }
    Ok(std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| mem_available(&s)))
}

/// `512M`, `2G`, `1048576`: bytes (suffixes are powers of 1024; a trailing `B` or `iB` is allowed).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let s = s.strip_suffix("iB").or_else(|| s.strip_suffix('B')).unwrap_or(s);
    let (num, shift) = match s.char_indices().last()? {
        (i, 'K' | 'k') => (&s[..i], 10),
        (i, 'M' | 'm') => (&s[..i], 20),
        (i, 'G' | 'g') => (&s[..i], 30),
        (i, 'T' | 't') => (&s[..i], 40),
        _ => (s, 0),
    };
    let v: f64 = num.trim().parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| (v * (1u64 << shift) as f64) as u64)
}

/// MemAvailable of a /proc/meminfo text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Checks that a stage with memory plan `plan`, whose weights come from `source` with host
/// copies of at most `host_read` bytes at a time (the largest layer when layers are read as they
/// are uploaded; 0 when they are all in host memory already, counted as used), fits on `gpu`
/// and the host; an error names the model, what it needs and what there is. Uploading a tensor
/// holds up to twice its bytes more (the chunk being copied and its staging copy).
pub fn check(source: &Path, gpu: &Gpu, plan: &MemoryPlan, host_read: u64) -> Result<()> {
    let mib = |b: u64| b >> 20;
    if let Some(mem) = gpu.memory_limit.filter(|&m| plan.total() > m) {
        bail!(
            "{}: the model does not fit on {}: it needs {plan}, the device has {} MiB; lower total_cache_size \
             (the KV cache, now {} MiB) or max_num_batched_tokens / max_decode_batch_size (the scratch{}), use a \
             smaller quantization, or split the layers over pipeline stages",
            source.display(),
            gpu.describe(),
            mib(mem),
            mib(plan.kv_cache),
            if plan.state > 0 { "; and the recurrent states: a slot per sequence of a step" } else { "" }
        );
    }
    let Some(avail) = host_available()? else { return Ok(()) };
    let cpu = gpu.info.device_type == wgpu::DeviceType::Cpu;
    // On a CPU adapter every device buffer is host memory.
    let needed = if cpu { plan.total() } else { 0 } + 3 * host_read + UPLOAD_SLACK;
    if needed > avail {
        let parts = match cpu {
            true => format!("{plan} on {}, whose device memory is host memory; ", gpu.describe()),
            false => String::new(),
        };
        let given = match std::env::var_os(HOST_MEMORY_ENV) {
            Some(_) => format!(" (as {HOST_MEMORY_ENV} says)"),
            None => String::new(),
        };
        bail!(
            "{}: not enough host memory to load the model: it needs {} MiB ({parts}{} MiB to read and upload a layer \
             (or the embedding or LM head) at a time; {} MiB of slack), the host has {} MiB available{given}; lower total_cache_size \
             (the KV cache, now {} MiB), use a smaller quantization, or split the layers over pipeline stages",
            source.display(),
            mib(needed),
            mib(3 * host_read),
            mib(UPLOAD_SLACK),
            mib(avail),
            mib(plan.kv_cache),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_with_suffixes() {
        assert_eq!(parse_bytes("1048576"), Some(1 << 20));
        assert_eq!(parse_bytes("512M"), Some(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Some(2 << 30));
        assert_eq!(parse_bytes("1.5k"), Some(1536));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("-1"), None);
    }

    #[test]
    fn mem_available_is_read_from_meminfo() {
        let m = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(m), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }
}
