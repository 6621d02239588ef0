// Per-head RMSNorm of this step's q and k heads (Qwen3's q_norm / k_norm), in place, before
// RoPE: x = w * (x / sqrt(mean(x^2) + eps)) over each head's head_dim values. One thread per
// (token, head of the n_heads q heads then n_kv_heads k heads, then n_v_heads v heads: Gemma 4's
// v_norm, whose weights the caller passes as ones).

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: HeadNormParams; // declared from Rust (ops/)
@group(0) @binding(2) var<storage, read> weight: array<f32>; // q weights, then k weights (then v's)
@group(0) @binding(3) var<storage, read_write> qkv: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    // The grid may be folded into 2-D (see Gpu::fold): the linear invocation index.
    let id = gid.x + gid.y * nwg.x * 64u;
    let heads = p.n_heads + p.n_kv_heads + p.n_v_heads;
    let h = id % heads;
    let t = id / heads;
    if (t >= step.n_tokens) {
        return;
    }
    let base = t * p.qkv_stride + h * p.head_dim;
    // q heads use the first weights, k heads the second, v heads (n_v_heads > 0) the third: ones.
    let w0 = select(select(0u, p.head_dim, h >= p.n_heads), 2u * p.head_dim, h >= p.n_heads + p.n_kv_heads);
    var ss = 0.0;
    for (var d = 0u; d < p.head_dim; d++) {
        let v = qkv[base + d];
        ss += v * v;
    }
    let r = inverseSqrt(ss / f32(p.head_dim) + p.eps);
    for (var d = 0u; d < p.head_dim; d++) {
        qkv[base + d] = weight[w0 + d] * (qkv[base + d] * r);
    }
}
