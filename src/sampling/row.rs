//! One sampled row's parameters as the GPU sampler reads them (`SampleParams::words`, the
//! 16-word row of sample.wgsl), its logit adjustments, and what it returns (`Sampled`).

/// u32 words of one row's sampling parameters in the step metadata.
pub const SAMPLE_PARAMS_STRIDE: usize = 16;
/// The words of a row, by name: `SampleParams::words` writes them at these indices, and the
/// sampler's shaders read them by the same names (`wgsl_constants`), e.g. `md[pb + W_TOP_P]`.
pub const W_TEMPERATURE: usize = 0;
pub const W_TOP_P: usize = 1;
pub const W_TOP_K: usize = 2;
pub const W_U: usize = 3;
pub const W_REPETITION: usize = 4;
pub const W_FREQUENCY: usize = 5;
pub const W_PRESENCE: usize = 6;
pub const W_N_TOP: usize = 7;
pub const W_ADJ_START: usize = 8;
pub const W_ADJ_LEN: usize = 9;
pub const W_MIN_P: usize = 10;
pub const W_MASK: usize = 11;
pub const W_FORCE: usize = 12;
/// Every named word, for the WGSL declarations.
pub const ROW_WORDS: [(&str, usize); 13] = [
    ("W_TEMPERATURE", W_TEMPERATURE),
    ("W_TOP_P", W_TOP_P),
    ("W_TOP_K", W_TOP_K),
    ("W_U", W_U),
    ("W_REPETITION", W_REPETITION),
    ("W_FREQUENCY", W_FREQUENCY),
    ("W_PRESENCE", W_PRESENCE),
    ("W_N_TOP", W_N_TOP),
    ("W_ADJ_START", W_ADJ_START),
    ("W_ADJ_LEN", W_ADJ_LEN),
    ("W_MIN_P", W_MIN_P),
    ("W_MASK", W_MASK),
    ("W_FORCE", W_FORCE),
];
/// The logit a token mask gives every token it does not allow (structured outputs): below any
/// real logit, so neither the argmax nor a draw ever picks it (its probability is exp(-3e38)).
pub const MASKED_LOGIT: f32 = -3.0e38;
/// W_MASK of a row without a token mask.
pub const NO_MASK: u32 = u32::MAX;
/// W_FORCE of a row that samples (otherwise the token it reports).
pub const NO_FORCE: u32 = u32::MAX;
/// Most top log-probabilities the sampler returns per row.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// u32 words the sampler writes per row: id, logprob, MAX_TOP_LOGPROBS (id, logprob) pairs.
pub const SAMPLE_RESULT_STRIDE: usize = 2 + 2 * MAX_TOP_LOGPROBS;

/// The constants above as WGSL, put before sample.wgsl and logit_adjust.wgsl.
pub fn wgsl_constants() -> String {
    let mut s = format!(
        "const MASKED_LOGIT: f32 = {MASKED_LOGIT:e};\nconst NO_MASK: u32 = {NO_MASK}u;\nconst NO_FORCE: u32 = {NO_FORCE}u;\n\
         const PARAMS_STRIDE: u32 = {SAMPLE_PARAMS_STRIDE}u;\nconst MAX_TOP: u32 = {MAX_TOP_LOGPROBS}u;\n"
    );
    for (name, i) in ROW_WORDS {
        s += &format!("const {name}: u32 = {i}u;\n");
    }
    s
}

/// Most logit-bias entries one request may carry.
pub const MAX_LOGIT_BIAS: usize = 300;

/// Per-row sampling parameters; `u` is a uniform draw in [0, 1) from the request's generator.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    /// 0 = off; otherwise tokens whose probability (after temperature) is below min_p times the
    /// largest are dropped before top-p.
    pub min_p: f32,
    pub u: f32,
    /// 1.0 = off. Divides positive (multiplies negative) logits of tokens seen in prompt or output.
    pub repetition_penalty: f32,
    /// Subtracted once per occurrence in the output.
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurs in the output.
    pub presence_penalty: f32,
    /// Top log-probabilities to return (at most MAX_TOP_LOGPROBS).
    pub n_top: u32,
    /// Tokens whose logits the penalties or a bias change; each id at most once.
    pub adjust: Vec<Adjust>,
    /// Structured outputs: the tokens this row may pick, one bit per vocabulary id (bit `i % 32`
    /// of word `i / 32`; `vocab.div_ceil(32)` words). Every other token's logit becomes
    /// [`MASKED_LOGIT`] before sampling (greedy too), so it is never picked. None: no mask.
    pub mask: Option<Vec<u32>>,
    /// Prompt log-probabilities: this row reports `force` as its token (with its log-probability
    /// and the top ones) instead of sampling one. None: sample.
    pub force: Option<u32>,
}

impl Default for SampleParams {
    fn default() -> Self {
        SampleParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            u: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            n_top: 0,
            adjust: vec![],
            mask: None,
            force: None,
        }
    }
}

impl SampleParams {
    /// Entries (16 bytes each) this row takes in the adjustment buffer: its logit adjustments,
    /// then its token mask padded to whole entries.
    pub(crate) fn adjust_entries(&self) -> usize {
        self.adjust.len() + self.mask.as_ref().map_or(0, |m| m.len().div_ceil(4))
    }

    /// Appends this row's entries to the adjustment buffer's words; `words()` takes the start.
    pub(crate) fn push_adjust(&self, adjust: &mut Vec<u32>) {
        adjust.extend(self.adjust.iter().flat_map(|a| a.words()));
        if let Some(m) = &self.mask {
            adjust.extend_from_slice(m);
            adjust.resize(adjust.len().div_ceil(4) * 4, 0);
        }
    }

    /// The per-row words of the step metadata (layout in sample.wgsl / logit_adjust.wgsl).
    /// `adj_start`: the entry where this row's adjustments start in the adjustment buffer (its
    /// mask, if any, follows them).
    pub(crate) fn words(&self, adj_start: u32) -> [u32; SAMPLE_PARAMS_STRIDE] {
        let mut w = [0u32; SAMPLE_PARAMS_STRIDE];
        w[W_TEMPERATURE] = self.temperature.to_bits();
        w[W_TOP_P] = self.top_p.to_bits();
        w[W_TOP_K] = self.top_k;
        w[W_U] = self.u.to_bits();
        w[W_REPETITION] = self.repetition_penalty.to_bits();
        w[W_FREQUENCY] = self.frequency_penalty.to_bits();
        w[W_PRESENCE] = self.presence_penalty.to_bits();
        w[W_N_TOP] = self.n_top.min(MAX_TOP_LOGPROBS as u32);
        w[W_ADJ_START] = adj_start;
        w[W_ADJ_LEN] = self.adjust.len() as u32;
        w[W_MIN_P] = self.min_p.to_bits();
        w[W_MASK] = match self.mask {
            Some(_) => adj_start + self.adjust.len() as u32,
            None => NO_MASK,
        };
        w[W_FORCE] = self.force.unwrap_or(NO_FORCE);
        w
    }
}

/// One logit change: token id, times generated so far, whether it is in the prompt, bias.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjust {
    pub id: u32,
    pub count: u32,
    pub in_prompt: bool,
    pub bias: f32,
}

impl Adjust {
    pub(crate) fn words(&self) -> [u32; 4] {
        [self.id, self.count, self.in_prompt as u32, self.bias.to_bits()]
    }
}

/// A sampled token: id, log-probability, and the most likely alternatives when asked.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl Sampled {
    pub(crate) fn parse(words: &[u32], n_top: u32) -> Sampled {
        let top = (0..n_top.min(MAX_TOP_LOGPROBS as u32) as usize)
            .map(|j| (words[2 + 2 * j], f32::from_bits(words[3 + 2 * j])))
            .collect();
        Sampled { id: words[0], logprob: f32::from_bits(words[1]), top }
    }
}
