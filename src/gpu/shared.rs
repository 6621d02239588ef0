//! Structs shared by Rust and WGSL, each defined once: `gpu_struct!` generates a struct's WGSL
//! declaration from its Rust definition (`WGSL`), prepended to the shaders that use it, so the
//! two sides cannot drift apart. Here: the step header every kernel reads; each op family's
//! parameters are declared in its file in ops/.

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
pub(crate) use gpu_struct;

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

/// The largest finite f16 (what an f16 KV cache clamps to).
pub const F16_MAX: f32 = 65504.0;

/// The WGSL declarations every shader gets: the step header and the shared constants.
pub fn wgsl_common() -> String {
    format!("{}const F16_MAX: f32 = {F16_MAX:.1};\n", StepHeader::WGSL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wgsl_declarations_follow_the_rust_fields() {
        assert!(StepHeader::WGSL.starts_with("struct Step {\n    n_tokens: u32,\n    n_sample: u32,\n"));
        assert!(StepHeader::WGSL.ends_with("    _p2: u32,\n}\n"));
        assert_eq!(std::mem::size_of::<StepHeader>(), 48);
    }
}
