// hidden[t, :] = dequantized row tokens[t] of the embedding chunk holding rows [row0, row0 + n_rows),
// times p.scale (Gemma's sqrt(hidden); else 1); with p.accumulate added into it instead.
// One thread per (token, 32-element block). wfmt_*.wgsl is prepended.

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: EmbedParams; // declared from Rust (ops/)
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(6) var<storage, read_write> hidden: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    // The grid may be folded into 2-D (see Gpu::fold): the linear invocation index.
    let inv = gid.x + gid.y * nwg.x * 64u;
    let b = inv % p.k_blocks;
    let t = inv / p.k_blocks;
    if (t >= step.n_tokens) {
        return;
    }
    let id = tokens[t];
    if (id < p.row0 || id >= p.row0 + p.n_rows) {
        return;
    }
    let blk = (id - p.row0) * p.k_blocks + b;
    let base = (t * p.k_blocks + b) * 8u;
    let s = wscale(blk);
    for (var q = 0u; q < 4u; q++) {
        let w = wpart(blk, q, s);
        var lo = w.lo * p.scale;
        var hi = w.hi * p.scale;
        if (p.accumulate == 1u) {
            lo += hidden[base + q];
            hi += hidden[base + 4u + q];
        }
        hidden[base + q] = lo;
        hidden[base + 4u + q] = hi;
    }
}
