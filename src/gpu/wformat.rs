//! The weight formats the matmul kernels read, and each one's WGSL snippet (shaders/wfmt/wfmt_*.wgsl).

/// How a weight matrix is stored on the GPU. Quantized formats keep GGUF's quantized values
/// (never dequantized at load); each format's blocks are re-packed at load into two arrays (see
/// `QTensor::from_gguf_blocks`): `q`, the quant codes of every 32-element block in a fixed
/// number of u32 words, and `s`, the scales, one record of `scale_words` words per
/// `scale_group` elements (32 for the legacy formats, 256 for the K-quants' super-blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[allow(non_camel_case_types)] // ggml's names (Q4_K, ...)
pub enum WFormat {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    IQ2_XXS,
    IQ2_XS,
    IQ2_S,
    IQ3_XXS,
    IQ3_S,
    IQ1_S,
    IQ1_M,
}

/// IQ4_NL's and IQ4_XS's non-linear 4-bit code values (ggml's kvalues_iq4nl).
pub const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];
/// MXFP4's e2m1 code values, doubled (the scale is stored halved, as ggml does).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// How the int8 path quantizes a matmul's x (quantize_x8.wgsl), named for llama.cpp's
/// activation types it reproduces: Q8_0 (an f16 scale per 32 values, the halves' sums of the
/// quantized values), Q8_1 (the same, but the offset's sum is the whole block's, rounded to
/// f16: Q4_1 and Q5_1) and Q8K (an f32 scale per 256 values: the K-quants and IQ4_XS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XQuant {
    Q8_0 = 0,
    Q8_1 = 1,
    Q8K = 2,
}

impl XQuant {
    pub const ALL: [XQuant; 3] = [XQuant::Q8_0, XQuant::Q8_1, XQuant::Q8K];

    /// Values per scale.
    pub fn group(self) -> u32 {
        if self == XQuant::Q8K {
            256
        } else {
            32
        }
    }
}

impl WFormat {
    pub const ALL: [WFormat; 22] = [
        WFormat::F32,
        WFormat::F16,
        WFormat::Q8_0,
        WFormat::Q4_0,
        WFormat::Q4_1,
        WFormat::Q5_0,
        WFormat::Q5_1,
        WFormat::Q2_K,
        WFormat::Q3_K,
        WFormat::Q4_K,
        WFormat::Q5_K,
        WFormat::Q6_K,
        WFormat::IQ4_NL,
        WFormat::IQ4_XS,
        WFormat::MXFP4,
        WFormat::IQ2_XXS,
        WFormat::IQ2_XS,
        WFormat::IQ2_S,
        WFormat::IQ3_XXS,
        WFormat::IQ3_S,
        WFormat::IQ1_S,
        WFormat::IQ1_M,
    ];

    /// u32 quant words per 32-element block.
    pub fn words_per_block(self) -> usize {
        match self {
            WFormat::F32 => 32,
            WFormat::F16 => 16,
            WFormat::Q8_0 => 8,
            WFormat::Q4_0 | WFormat::Q4_1 | WFormat::Q4_K => 4,
            WFormat::IQ4_NL | WFormat::IQ4_XS | WFormat::MXFP4 => 4,
            WFormat::Q5_0 | WFormat::Q5_1 | WFormat::Q5_K => 5,
            WFormat::Q6_K => 6,
            WFormat::Q3_K | WFormat::IQ3_XXS | WFormat::IQ3_S => 3,
            WFormat::Q2_K | WFormat::IQ2_XXS | WFormat::IQ2_XS | WFormat::IQ2_S => 2,
            WFormat::IQ1_S | WFormat::IQ1_M => 1,
        }
    }

    /// Elements covered by one scale record (a row length must be a multiple of it).
    pub fn scale_group(self) -> usize {
        if self.is_k_quant() || self.is_grid() || self == WFormat::IQ4_XS {
            256
        } else {
            32
        }
    }

    /// u32 words of one scale record.
    pub fn scale_words(self) -> usize {
        match self {
            WFormat::F32 | WFormat::F16 => 0,
            WFormat::Q8_0 | WFormat::Q4_0 | WFormat::Q5_0 | WFormat::IQ4_NL | WFormat::MXFP4 => 1,
            // d and eight signed sub-block scales as bytes.
            WFormat::IQ4_XS => 3,
            WFormat::Q4_1 | WFormat::Q5_1 => 2,
            // d, dmin and eight 6-bit scales and mins as bytes.
            WFormat::Q4_K | WFormat::Q5_K => 6,
            // d, dmin and sixteen 4-bit scale/min pairs as bytes.
            WFormat::Q2_K => 6,
            // d and sixteen signed scales as bytes.
            WFormat::Q3_K | WFormat::Q6_K => 5,
            // The grid formats (src/weights/grids.rs): d, then their sub-block scales and
            // index high bits.
            WFormat::IQ2_XXS | WFormat::IQ3_XXS => 1,
            WFormat::IQ2_XS => 3,
            WFormat::IQ3_S => 4,
            WFormat::IQ2_S | WFormat::IQ1_S => 5,
            WFormat::IQ1_M => 7,
        }
    }

    /// The grid formats (IQ1_*, IQ2_*, IQ3_*): values looked up in a fixed grid, which is
    /// uploaded in front of each chunk's scale records.
    pub fn is_grid(self) -> bool {
        matches!(
            self,
            WFormat::IQ2_XXS
                | WFormat::IQ2_XS
                | WFormat::IQ2_S
                | WFormat::IQ3_XXS
                | WFormat::IQ3_S
                | WFormat::IQ1_S
                | WFormat::IQ1_M
        )
    }

    /// u32 words of the grid in front of the scale records (0 for formats without one).
    pub fn grid_words(self) -> usize {
        match self {
            WFormat::IQ2_XXS => 512,
            WFormat::IQ2_XS => 1024,
            WFormat::IQ2_S => 2048,
            WFormat::IQ3_XXS => 256,
            WFormat::IQ3_S => 512,
            WFormat::IQ1_S | WFormat::IQ1_M => 4096,
            _ => 0,
        }
    }

    /// u32 scale words of a row of `cols` elements.
    pub fn scale_words_per_row(self, cols: usize) -> usize {
        cols / self.scale_group() * self.scale_words()
    }

    /// Bytes of a row of `cols` elements on the GPU (quant words and scale records).
    pub fn row_bytes(self, cols: usize) -> usize {
        (cols / 32 * self.words_per_block() + self.scale_words_per_row(cols)) * 4
    }

    /// The 4-bit codes' values of the table formats (IQ4_NL, IQ4_XS, MXFP4): value = d * table[code].
    pub fn table(self) -> Option<&'static [i8; 16]> {
        match self {
            WFormat::IQ4_NL | WFormat::IQ4_XS => Some(&KVALUES_IQ4NL),
            WFormat::MXFP4 => Some(&KVALUES_MXFP4),
            _ => None,
        }
    }

    /// Whether the one-token matmuls of this format run on int8 activations: integer codes of
    /// at most 8 bits with per-block (or per-half) scales. The integer-coded formats' snippets
    /// have the int8 path's codes (`wcodes8`, `wterms8`); the table formats (IQ4_NL, IQ4_XS,
    /// MXFP4), whose table values are integers of at most 8 bits, take theirs from
    /// wfmt_table_codes8.wgsl. The float formats and the grid formats (IQ1-IQ3) have none.
    pub fn has_int8(self) -> bool {
        self.table().is_some()
            || matches!(
                self,
                WFormat::Q8_0
                    | WFormat::Q4_0
                    | WFormat::Q4_1
                    | WFormat::Q5_0
                    | WFormat::Q5_1
                    | WFormat::Q2_K
                    | WFormat::Q3_K
                    | WFormat::Q4_K
                    | WFormat::Q5_K
                    | WFormat::Q6_K
            )
    }

    /// How the int8 path quantizes x for this format (quantize_x8.wgsl): as llama.cpp's CPU
    /// backend does for it.
    pub fn int8_x(self) -> XQuant {
        if self.is_k_quant() || self == WFormat::IQ4_XS {
            XQuant::Q8K
        } else if matches!(self, WFormat::Q4_1 | WFormat::Q5_1) {
            XQuant::Q8_1
        } else {
            XQuant::Q8_0
        }
    }

    /// The K-quants: 256-element super-blocks.
    pub fn is_k_quant(self) -> bool {
        matches!(self, WFormat::Q2_K | WFormat::Q3_K | WFormat::Q4_K | WFormat::Q5_K | WFormat::Q6_K)
    }

    pub(crate) fn snippet(self) -> String {
        let own = match self {
            WFormat::F32 => include_str!("../../shaders/wfmt/wfmt_f32.wgsl"),
            WFormat::F16 => include_str!("../../shaders/wfmt/wfmt_f16.wgsl"),
            WFormat::Q8_0 => include_str!("../../shaders/wfmt/wfmt_q8_0.wgsl"),
            WFormat::Q4_0 => include_str!("../../shaders/wfmt/wfmt_q4_0.wgsl"),
            WFormat::Q4_1 => include_str!("../../shaders/wfmt/wfmt_q4_1.wgsl"),
            WFormat::Q5_0 => include_str!("../../shaders/wfmt/wfmt_q5_0.wgsl"),
            WFormat::Q5_1 => include_str!("../../shaders/wfmt/wfmt_q5_1.wgsl"),
            WFormat::Q2_K => include_str!("../../shaders/wfmt/wfmt_q2_k.wgsl"),
            WFormat::Q3_K => include_str!("../../shaders/wfmt/wfmt_q3_k.wgsl"),
            WFormat::Q4_K => include_str!("../../shaders/wfmt/wfmt_q4_k.wgsl"),
            WFormat::Q5_K => include_str!("../../shaders/wfmt/wfmt_q5_k.wgsl"),
            WFormat::Q6_K => include_str!("../../shaders/wfmt/wfmt_q6_k.wgsl"),
            WFormat::IQ4_NL | WFormat::MXFP4 => include_str!("../../shaders/wfmt/wfmt_table4.wgsl"),
            WFormat::IQ4_XS => include_str!("../../shaders/wfmt/wfmt_iq4_xs.wgsl"),
            WFormat::IQ2_XXS => include_str!("../../shaders/wfmt/wfmt_iq2_xxs.wgsl"),
            WFormat::IQ2_XS => include_str!("../../shaders/wfmt/wfmt_iq2_xs.wgsl"),
            WFormat::IQ2_S => include_str!("../../shaders/wfmt/wfmt_iq2_s.wgsl"),
            WFormat::IQ3_XXS => include_str!("../../shaders/wfmt/wfmt_iq3_xxs.wgsl"),
            WFormat::IQ3_S => include_str!("../../shaders/wfmt/wfmt_iq3_s.wgsl"),
            WFormat::IQ1_S => include_str!("../../shaders/wfmt/wfmt_iq1_s.wgsl"),
            WFormat::IQ1_M => include_str!("../../shaders/wfmt/wfmt_iq1_m.wgsl"),
        };
        if self.is_grid() {
            return format!(
                "{own}\n{}\nconst GRID_WORDS: u32 = {}u;",
                include_str!("../../shaders/wfmt/wfmt_grid.wgsl"),
                self.grid_words()
            );
        }
        if let Some(t) = self.table() {
            let v: Vec<String> = t.iter().map(|k| format!("{k}.0")).collect();
            let decl = format!(
                "// The 4-bit codes' values (WFormat::table).\nvar<private> KTAB: array<f32, 16> = array<f32, 16>({});\n\
                 fn ktab(c: vec4<u32>) -> vec4<f32> {{\n    return vec4<f32>(KTAB[c.x], KTAB[c.y], KTAB[c.z], KTAB[c.w]);\n}}",
                v.join(", ")
            );
            return format!("{own}\n{}\n{decl}", include_str!("../../shaders/wfmt/wfmt_table_codes.wgsl"));
        }
        // The K-quants' scale records share their decoding.
        let shared = if matches!(self, WFormat::Q3_K | WFormat::Q4_K | WFormat::Q5_K | WFormat::Q6_K) {
            include_str!("../../shaders/wfmt/wfmt_k_scales.wgsl")
        } else {
            ""
        };
        format!("{own}\n{shared}")
    }

    pub fn name(self) -> &'static str {
        match self {
            WFormat::F32 => "f32",
            WFormat::F16 => "f16",
            WFormat::Q8_0 => "q8_0",
            WFormat::Q4_0 => "q4_0",
            WFormat::Q4_1 => "q4_1",
            WFormat::Q5_0 => "q5_0",
            WFormat::Q5_1 => "q5_1",
            WFormat::Q2_K => "q2_k",
            WFormat::Q3_K => "q3_k",
            WFormat::Q4_K => "q4_k",
            WFormat::Q5_K => "q5_k",
            WFormat::Q6_K => "q6_k",
            WFormat::IQ4_NL => "iq4_nl",
            WFormat::IQ4_XS => "iq4_xs",
            WFormat::MXFP4 => "mxfp4",
            WFormat::IQ2_XXS => "iq2_xxs",
            WFormat::IQ2_XS => "iq2_xs",
            WFormat::IQ2_S => "iq2_s",
            WFormat::IQ3_XXS => "iq3_xxs",
            WFormat::IQ3_S => "iq3_s",
            WFormat::IQ1_S => "iq1_s",
            WFormat::IQ1_M => "iq1_m",
        }
    }
}
