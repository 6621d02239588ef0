//! Host side of sampling: per-request parameters and the seeded generator whose draws the GPU
//! sampler consumes (one uniform number per sampled token).
//!
//! Owns: sampling parameters, the seeded generator, the per-row sample record.
//! May use: nothing.
//! Never uses: every other room (anyone may use sampling).

pub mod row;
pub use row::{Adjust, SampleParams, Sampled, MAX_LOGIT_BIAS};

/// A request's sampling settings. temperature 0 means greedy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = no top-k cut.
    pub top_k: u32,
    /// After temperature, drop tokens whose probability is below min_p times the largest
    /// (vLLM's and llama.cpp's min_p); 0 = off.
    pub min_p: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, min_p: 0.0, seed: None }
    }
}

/// SplitMix64: small, fast, and the same sequence on every platform for a given seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A seed from the clock, for requests that give none.
    pub fn from_entropy() -> Rng {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Rng(t.as_nanos() as u64 ^ (std::process::id() as u64) << 32)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), with 24 bits so it is exact in f32.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}
