//! The parts every kernel family's WGSL shares: what every shader starts with (the shared
//! declarations of gpu/shared.rs and shaders/common.wgsl), the subgroup builtins of a
//! reduction and loops written out for llvmpipe's loop-iteration limit (the KV cache's
//! accessors are kv_cache.rs'). Each family assembles its own programs from
//! these and its files in shaders/<family>/.

const COMMON: &str = include_str!("../../shaders/common.wgsl");

/// What every shader starts with: the shared declarations (src/gpu/shared.rs) and common.wgsl.
pub(crate) fn common() -> String {
    format!("{}\n{COMMON}", crate::gpu::shared::wgsl_common())
}

/// The builtins of a subgroup reduction.
pub(super) const SG_ARGS: &str =
    "@builtin(subgroup_invocation_id) sid: u32,\n    @builtin(subgroup_id) sg: u32,\n    @builtin(num_subgroups) nsg: u32,";

/// `line` written out `n` times, `{i}` and `{i+1}` replaced by the copy's index (and the next)
/// as u32 literals, each indented by `depth` levels: a loop with no loop iteration, for the
/// kernels that must stay within llvmpipe's loop-iteration limit (65535 iterations per
/// invocation in total, after which every loop stops silently).
pub(crate) fn unrolled(n: u32, depth: usize, line: &str) -> String {
    let indent = "    ".repeat(depth);
    (0..n)
        .map(|i| {
            format!("{indent}{}\n", line.replace("{i}", &format!("{i}u")).replace("{i+1}", &format!("{}u", i + 1)))
        })
        .collect()
}
