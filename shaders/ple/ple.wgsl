// Gemma 4's per-layer input gate: y[t, i] = gelu_tanh(y[t, i]) * ple[t * p.stride + p.off + i]
// for i < p.width: the gate projection of the residual (y, rows of width floats) times the layer's
// per-layer input (columns off.. of the per-layer embeddings' rows of stride floats). A thread per
// (token, element).

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: PleParams; // declared from Rust (ops/)
@group(0) @binding(2) var<storage, read> ple: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    // The grid may be folded into 2-D (see Gpu::fold): the linear invocation index.
    let id = gid.x + gid.y * nwg.x * 64u;
    let t = id / p.width;
    if (t >= step.n_tokens) {
        return;
    }
    let i = id % p.width;
    y[id] = gelu_tanh(y[id]) * ple[t * p.stride + p.off + i];
}
