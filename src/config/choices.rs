//! Two choices made once per device: the KV cache's element type and the kernel profile.

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// Two halves per u32 (half the memory of f32).
    #[default]
    F16,
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }

    /// Parses `f16` / `f32` (also `float16`/`half`, `float32`/`float`).
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s.to_ascii_lowercase().as_str() {
            "f16" | "float16" | "half" | "fp16" => Some(KvDtype::F16),
            "f32" | "float32" | "float" | "fp32" => Some(KvDtype::F32),
            _ => None,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        KvDtype::parse(s).ok_or_else(|| format!("unknown KV-cache dtype '{s}' (expected f16 or f32)"))
    }
}

/// Which kernel shapes a model runs: `cpu` (llvmpipe, SwiftShader: one invocation per output,
/// no workgroup memory) or `gpu` (integrated and discrete GPUs: coalesced weight reads,
/// workgroup reductions, split-key attention). `auto` picks by the adapter's device type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelProfile {
    #[default]
    Auto,
    Cpu,
    Gpu,
}

impl KernelProfile {
    pub fn name(self) -> &'static str {
        match self {
            KernelProfile::Auto => "auto",
            KernelProfile::Cpu => "cpu",
            KernelProfile::Gpu => "gpu",
        }
    }

    /// The profile for an adapter: `auto` becomes `cpu` on CPU adapters, `gpu` elsewhere.
    /// `auto` as the adapter makes it: `cpu` on a software adapter (`cpu_adapter`), else `gpu`.
    pub fn resolve(self, cpu_adapter: bool) -> KernelProfile {
        match self {
            KernelProfile::Auto if cpu_adapter => KernelProfile::Cpu,
            KernelProfile::Auto => KernelProfile::Gpu,
            p => p,
        }
    }
}

impl std::str::FromStr for KernelProfile {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(KernelProfile::Auto),
            "cpu" => Ok(KernelProfile::Cpu),
            "gpu" => Ok(KernelProfile::Gpu),
            _ => Err(format!("unknown kernel profile '{s}' (expected auto, cpu or gpu)")),
        }
    }
}
