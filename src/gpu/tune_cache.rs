//! The tuner's choices per adapter (`torus-wgpu tune`, ops/tune.rs), kept in one JSON file:
//! `$TORUS_TUNE_CACHE` (a path, or `off`), else `$XDG_CACHE_HOME/torus-wgpu/tune.json`, else
//! `~/.cache/torus-wgpu/tune.json`. An entry is keyed by the adapter (name, vendor and device
//! ids, driver, backend) and by this binary's kernels (its version and the tuned kernels' hash,
//! which ops::matmul::gemm gives: `tuned_kernels`), so a driver update or a kernel change is tuned again
//! rather than misread; a new tune of an adapter replaces its entries for other kernels. A file
//! that cannot be read or parsed is ignored with a log line (the next tune replaces it): the
//! defaults run then, never an error.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The environment variable naming the cache file (`off`: no cache).
pub const TUNE_CACHE_ENV: &str = "TORUS_TUNE_CACHE";
/// Largest cache file read (a file written by the tuner is a few KiB).
const MAX_BYTES: u64 = 4 << 20;

/// One weight format's GEMM plan (ops::matmul::gemm::GemmPlan, its kernels by name).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GemmRecord {
    pub min_rows: u32,
    pub small: String,
    pub large: String,
}

/// What the tuner chose on one adapter.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AdapterTuning {
    /// The adapter's name and driver, for people reading the file.
    pub adapter: String,
    /// Unix seconds of the last tune.
    pub tuned_at: u64,
    /// GEMM plans by weight-format name.
    pub gemm: BTreeMap<String, GemmRecord>,
    /// The prefill-sized expert kernels by weight-format name (ops::moe: "tiled" or "grouped").
    #[serde(default)]
    pub moe: BTreeMap<String, String>,
    /// Whether one-token matmuls run on int8 activations, by weight-format name.
    #[serde(default)]
    pub int8: BTreeMap<String, bool>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TuneCache {
    /// By `TuneCache::key`.
    pub adapters: BTreeMap<String, AdapterTuning>,
}

/// FNV-1a, 64 bits, of `parts` (each followed by a zero byte): how the tuned kernels' sources
/// are hashed into their key.
pub fn fnv(parts: &[&str]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in parts.iter().flat_map(|p| p.bytes().chain([0])) {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

impl TuneCache {
    /// The cache file: TUNE_CACHE_ENV, else under XDG_CACHE_HOME or ~/.cache; None when off.
    pub fn path() -> Option<PathBuf> {
        match std::env::var_os(TUNE_CACHE_ENV) {
            Some(p) if p == "off" => None,
            Some(p) => Some(PathBuf::from(p)),
            None => std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .map(|d| d.join("torus-wgpu/tune.json")),
        }
    }

    /// The cache a run reads (None when there is none or it cannot be read).
    pub fn for_run() -> Option<TuneCache> {
        let path = Self::path()?;
        if !path.exists() {
            return None;
        }
        match Self::read(&path) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!("ignoring the tuner's cache: {e:#}");
                None
            }
        }
    }

    /// Reads `path` (an empty cache when it does not exist).
    pub fn read(path: &Path) -> Result<TuneCache> {
        let meta = match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(TuneCache::default()),
            m => m.with_context(|| format!("{}", path.display()))?,
        };
        anyhow::ensure!(meta.len() <= MAX_BYTES, "{}: larger than {MAX_BYTES} bytes", path.display());
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: not a tuner cache", path.display()))
    }

    /// Writes the cache to `path` (a temporary file renamed over it: a reader sees the old file
    /// or the new one).
    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, serde_json::to_string_pretty(self)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
    }

    /// The key of an adapter: what names it, then ` / kernels ` and the hash of the kernels
    /// tuned on it (`kernels`, with this binary's version).
    pub fn key(info: &wgpu::AdapterInfo, kernels: u64) -> String {
        format!("{}{kernels:016x}", Self::adapter_prefix(info))
    }

    /// The part of the key that names the adapter.
    fn adapter_prefix(info: &wgpu::AdapterInfo) -> String {
        format!(
            "{} [{:04x}:{:04x}] {:?} {} {} / kernels ",
            info.name, info.vendor, info.device, info.backend, info.driver, info.driver_info
        )
    }

    /// What was tuned on this adapter for these kernels.
    pub fn adapter(&self, info: &wgpu::AdapterInfo, kernels: u64) -> Option<&AdapterTuning> {
        self.adapters.get(&Self::key(info, kernels))
    }

    /// The GEMM plan tuned for `format` (by name) on this adapter.
    pub fn gemm(&self, info: &wgpu::AdapterInfo, kernels: u64, format: &str) -> Option<&GemmRecord> {
        self.adapter(info, kernels)?.gemm.get(format)
    }

    /// Whether a plan tuned on this adapter runs the cooperative-matrix GEMM (the device is then
    /// opened with the feature). The device is opened before any kernel is built, so this reads
    /// the adapter's entry whatever kernels it was tuned for (a tune keeps one per adapter).
    pub fn wants_coop(&self, info: &wgpu::AdapterInfo) -> bool {
        let prefix = Self::adapter_prefix(info);
        self.adapters
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .any(|(_, a)| a.gemm.values().any(|r| r.small == "coop" || r.large == "coop"))
    }

    /// The prefill-sized expert kernel tuned for `format` on this adapter.
    pub fn moe(&self, info: &wgpu::AdapterInfo, kernels: u64, format: &str) -> Option<&str> {
        self.adapter(info, kernels)?.moe.get(format).map(|s| s.as_str())
    }

    /// Whether the one-token matmuls of `format` were faster on int8 activations on this adapter.
    pub fn int8(&self, info: &wgpu::AdapterInfo, kernels: u64, format: &str) -> Option<bool> {
        self.adapter(info, kernels)?.int8.get(format).copied()
    }

    /// This adapter's entry for `kernels`, stamped now; its entries for other kernels go.
    fn entry(&mut self, info: &wgpu::AdapterInfo, kernels: u64) -> &mut AdapterTuning {
        let (prefix, key) = (Self::adapter_prefix(info), Self::key(info, kernels));
        self.adapters.retain(|k, _| !k.starts_with(&prefix) || *k == key);
        let a = self.adapters.entry(key).or_default();
        a.adapter = format!("{} ({} {})", info.name, info.driver, info.driver_info);
        a.tuned_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        a
    }

    /// Records the plan of `format` on this adapter.
    pub fn set_gemm(&mut self, info: &wgpu::AdapterInfo, kernels: u64, format: &str, record: GemmRecord) {
        self.entry(info, kernels).gemm.insert(format.to_string(), record);
    }

    /// Records the prefill-sized expert kernel of `format` on this adapter.
    pub fn set_moe(&mut self, info: &wgpu::AdapterInfo, kernels: u64, format: &str, kernel: &str) {
        self.entry(info, kernels).moe.insert(format.to_string(), kernel.to_string());
    }

    /// Records whether `format`'s one-token matmuls run on int8 activations on this adapter.
    pub fn set_int8(&mut self, info: &wgpu::AdapterInfo, kernels: u64, format: &str, on: bool) {
        self.entry(info, kernels).int8.insert(format.to_string(), on);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(driver: &str) -> wgpu::AdapterInfo {
        wgpu::AdapterInfo {
            name: "Test GPU".into(),
            vendor: 0x10de,
            device: 0x2330,
            device_type: wgpu::DeviceType::DiscreteGpu,
            driver: driver.into(),
            driver_info: "1.0".into(),
            backend: wgpu::Backend::Vulkan,
            ..wgpu::AdapterInfo::new(wgpu::DeviceType::DiscreteGpu, wgpu::Backend::Vulkan)
        }
    }

    #[test]
    fn plans_are_kept_per_adapter_and_driver() {
        let dir = std::env::temp_dir().join(format!("torus-tune-cache-{}", std::process::id()));
        let path = dir.join("sub/tune.json");
        let rec = GemmRecord { min_rows: 8, small: "tile32h".into(), large: "coop".into() };
        let mut c = TuneCache::default();
        c.set_gemm(&info("nvidia"), 1, "q4_k", rec.clone());
        c.write(&path).unwrap();
        let back = TuneCache::read(&path).unwrap();
        assert_eq!(back.gemm(&info("nvidia"), 1, "q4_k"), Some(&rec));
        assert!(back.wants_coop(&info("nvidia")));
        // Another driver, format or kernels hash has no plan: it is tuned again, not misread.
        assert_eq!(back.gemm(&info("nvidia 2"), 1, "q4_k"), None);
        assert!(!back.wants_coop(&info("nvidia 2")));
        assert_eq!(back.gemm(&info("nvidia"), 1, "q8_0"), None);
        assert_eq!(back.gemm(&info("nvidia"), 2, "q4_k"), None);
        // A tune for other kernels replaces the adapter's entry; other adapters' stay.
        let mut c = back.clone();
        c.set_gemm(&info("nvidia 2"), 1, "q4_k", rec.clone());
        c.set_int8(&info("nvidia"), 2, "q4_k", true);
        assert_eq!(c.adapters.len(), 2);
        assert_eq!(c.gemm(&info("nvidia"), 1, "q4_k"), None);
        assert_eq!(c.int8(&info("nvidia"), 2, "q4_k"), Some(true));
        assert_eq!(c.gemm(&info("nvidia 2"), 1, "q4_k"), Some(&rec));
        // A missing file is an empty cache; a file that is not one is an error naming it.
        assert!(TuneCache::read(&dir.join("none.json")).unwrap().adapters.is_empty());
        std::fs::write(&path, "{ not json").unwrap();
        let e = format!("{:#}", TuneCache::read(&path).unwrap_err());
        assert!(e.contains("not a tuner cache") && e.contains("tune.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
