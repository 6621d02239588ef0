// The mixture-of-experts expert kernels' shared part (moe.wgsl, moe_tiled.wgsl): their bindings
// but x (moe.wgsl binds x[] as vec4s, moe_tiled.wgsl through matmul_tile_load.wgsl), the gated
// activations and the per-expert biases. MoeParams precedes it.

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: MoeParams;
@group(0) @binding(5) var<storage, read> route: array<u32>;
@group(0) @binding(6) var<storage, read_write> y: array<f32>;
// Per-expert biases of the projection (MOE_BIAS; gpt-oss): bias[e * p.rows_per_expert + row].
@group(0) @binding(7) var<storage, read> bias: array<f32>;

const NONE: u32 = 0xffffffffu;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

// The expert's activation of (gate, up): SwiGLU, GeGLU (MOE_GELU), or gpt-oss's clamped SwiGLU
// (MOE_CLAMPED: gate clamped above at limit, up to [-limit, limit], gate * sigmoid(alpha * gate)
// * (up + 1)).
fn act(g: f32, u: f32) -> f32 {
    if ((p.flags & MOE_CLAMPED) != 0u) {
        let gc = min(g, p.limit);
        let uc = clamp(u, -p.limit, p.limit);
        return gc / (1.0 + exp(-p.alpha * gc)) * (uc + 1.0);
    }
    if ((p.flags & MOE_GELU) != 0u) {
        return gelu_tanh(g) * u;
    }
    return silu(g) * u;
}

fn bias_of(e: u32, row: u32) -> f32 {
    if ((p.flags & MOE_BIAS) != 0u) {
        return bias[e * p.rows_per_expert + row];
    }
    return 0.0;
}

// The linear invocation index of a grid folded into 2-D (see Gpu::fold).
fn linear(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * 64u;
}

