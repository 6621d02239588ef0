//! Structs and constants shared by Rust and WGSL, defined once here: each struct's WGSL
//! declaration is generated from its Rust definition (`WGSL`) and prepended to the shaders that
//! use it, so the two sides cannot drift apart.

/// A `#[repr(C)]` plain-data struct of u32/f32 fields and its WGSL declaration (named `wgsl`).
macro_rules! gpu_struct {
    ($(#[$m:meta])* wgsl $wname:ident; $vis:vis struct $name:ident {
        $($(#[$fm:meta])* $fvis:vis $field:ident : $ty:ident),* $(,)?
    }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name {
            $($(#[$fm])* $fvis $field: $ty),*
        }

        impl $name {
            /// The WGSL declaration of this struct.
            pub const WGSL: &'static str = concat!(
                "struct ", stringify!($wname), " {\n",
                $("    ", stringify!($field), ": ", stringify!($ty), ",\n",)*
                "}\n"
            );
        }
    };
}

gpu_struct! {
    /// Per-step header, shared by every kernel of a forward step (uniform, 48 bytes; WGSL
    /// `Step`). The step's small arrays live in one u32 storage buffer `meta`, at the offsets.
    wgsl Step;
    pub struct StepHeader {
        /// Rows of this step's activations.
        pub n_tokens: u32,
        /// Rows whose logits are computed and sampled.
        pub n_sample: u32,
        /// Sequences in this step.
        pub n_seqs: u32,
        /// Block-table row length.
        pub max_blocks: u32,
        /// md[off_pos + t]: position of token t.
        pub off_pos: u32,
        /// md[off_slot + t]: KV slot (block * block_size + offset) of token t.
        pub off_slot: u32,
        /// md[off_seq + t]: sequence index of token t.
        pub off_seq: u32,
        /// md[off_table + s * max_blocks + j]: block j of sequence s.
        pub off_table: u32,
        /// Key ranges per (token, KV head) of the split attention (gpu profile).
        pub n_splits: u32,
        pub _p0: u32,
        pub _p1: u32,
        pub _p2: u32,
    }
}

gpu_struct! {
    /// Parameters of one row-chunk's matmul (matmul*.wgsl; WGSL `MatParams`).
    wgsl MatParams;
    pub struct MatParams {
        /// K / 32.
        pub k_blocks: u32,
        /// Rows of this chunk (for SwiGLU: rows of the gate half).
        pub n_rows: u32,
        /// First output column written by this chunk.
        pub row0: u32,
        /// Floats per output row.
        pub y_stride: u32,
        /// vec4s per input row.
        pub x_stride4: u32,
        /// 0: the step's n_tokens rows, 1: its n_sample rows.
        pub m_src: u32,
        /// MAT_* flags.
        pub flags: u32,
        pub _pad: u32,
    }
}

gpu_struct! {
    /// Parameters of the attention kernels (attention.wgsl, attention_split.wgsl; WGSL
    /// `AttnParams`).
    wgsl AttnParams;
    pub struct AttnParams {
        pub n_heads: u32,
        pub n_kv_heads: u32,
        pub block_size: u32,
        /// vec4s per qkv row.
        pub qkv_stride4: u32,
        pub scale: f32,
        /// Attend to the last `window` positions only (0: all).
        pub window: u32,
        /// vec4s per KV-cache buffer of a layer (when the cache spans several).
        pub kv_chunk4: u32,
        pub _p2: u32,
    }
}

/// MatParams flag: add the bias.
pub const MAT_BIAS: u32 = 1;
/// MatParams flag: add into y.
pub const MAT_ACCUMULATE: u32 = 2;
/// MatParams flag: y = silu(y) * result (the up half of an unfused SwiGLU; y holds the gate).
pub const MAT_SWIGLU_UP: u32 = 4;

/// The WGSL declarations every shader gets: the step header.
pub fn wgsl_common() -> String {
    StepHeader::WGSL.to_string()
}

/// The WGSL declarations of the matmul shaders: MatParams and its flags.
pub fn wgsl_matmul() -> String {
    format!(
        "{}const MAT_BIAS: u32 = {MAT_BIAS}u;\nconst MAT_ACCUMULATE: u32 = {MAT_ACCUMULATE}u;\n\
         const MAT_SWIGLU_UP: u32 = {MAT_SWIGLU_UP}u;\n",
        MatParams::WGSL
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wgsl_declarations_follow_the_rust_fields() {
        assert!(StepHeader::WGSL.starts_with("struct Step {\n    n_tokens: u32,\n    n_sample: u32,\n"));
        assert!(StepHeader::WGSL.ends_with("    _p2: u32,\n}\n"));
        assert_eq!(std::mem::size_of::<StepHeader>(), 48);
        assert_eq!(MatParams::WGSL.lines().count(), 2 + 8);
        assert!(wgsl_matmul().contains("const MAT_SWIGLU_UP: u32 = 4u;"));
    }
}
