// The activations of an int8 matmul (matmul_gpu_xi8.wgsl): each 32-value block of each row of
// x quantized to signed bytes with one scale, d = max|x| / 127, q = round(x / d), as three
// words of four: the 32 bytes (element order, four to a word), then (d, sum of x over elements
// 0..16, over 16..32, 0) as f32 bits. The sums are of x itself, so the terms that multiply them
// (a format's mins and code offsets) lose nothing to the quantization. One invocation per
// block; in the matmul family's layout (x at 2, the quantized blocks at 6 as `y`).

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: MatParams;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> y: array<vec4<u32>>;

fn quant4(v: vec4<f32>, id: f32) -> u32 {
    return pack4xI8(vec4<i32>(round(v * id)));
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    let m = select(step.n_tokens, step.n_sample, p.m_src == 1u);
    if (i >= m * p.k_blocks) {
        return;
    }
    let at = (i / p.k_blocks) * p.x_stride4 + (i % p.k_blocks) * 8u;
    var v: array<vec4<f32>, 8>;
    var amax = vec4<f32>(0.0);
    for (var j = 0u; j < 8u; j++) {
        v[j] = x[at + j];
        amax = max(amax, abs(v[j]));
    }
    let d = max(max(amax.x, amax.y), max(amax.z, amax.w)) / 127.0;
    let id = select(0.0, 1.0 / d, d > 0.0);
    let lo = v[0] + v[1] + v[2] + v[3];
    let hi = v[4] + v[5] + v[6] + v[7];
    let sums = vec2<f32>(dot(lo, vec4<f32>(1.0)), dot(hi, vec4<f32>(1.0)));
    y[i * 3u] = vec4<u32>(quant4(v[0], id), quant4(v[1], id), quant4(v[2], id), quant4(v[3], id));
    y[i * 3u + 1u] = vec4<u32>(quant4(v[4], id), quant4(v[5], id), quant4(v[6], id), quant4(v[7], id));
    y[i * 3u + 2u] = vec4<u32>(bitcast<u32>(d), bitcast<u32>(sums.x), bitcast<u32>(sums.y), 0u);
}
