// The activations of an int8 matmul (matmul_gpu_xi8.wgsl), quantized as llama.cpp quantizes
// them for the weights' format (`WFormat::int8_x`), per 32-value block of each row of x. GROUP
// 32 (llama.cpp's Q8_0 and Q8_1): d = max|x| / 127 rounded to f16 (the scale llama.cpp stores
// and multiplies with), q = round(x * 127 / max|x|). GROUP 256 (its Q8_K, for the K-quants and
// IQ4_XS): one scale per 256 values, from the value of largest |x| (the first on ties), v:
// q = min(127, round(x * -127 / v)), d = 1 / (-127 / v) in f32. Rounding ties to even, as
// llama.cpp's x86 quantizations round. Stored as three words of four: the 32 bytes (element
// order, four to a word), then (d, d * the sum of q over elements 0..16, over 16..32, 0) as f32
// bits; with WHOLE (Q8_1, for Q4_1 and Q5_1, whose offset is one per block) the block's sum in
// the first and 0 in the second, d * sum(q) over all 32 rounded to f16 (with d before its
// rounding) as Q8_1 holds it. The sums are of the quantized values, so that every format's
// product (offsets and mins included, through the sums) is exactly the dequantized weights
// times the quantized x: for centred weights that error is smaller than with the sums of x
// itself, and every format gives llama.cpp's one-token logits to float error (BENCHMARKS.md).
// One invocation per block (a 256-value group's 8 blocks are in one workgroup: rows of x are
// whole groups); in the matmul family's layout (x at 2, the quantized blocks at 6 as `y`).

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: MatParams;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> y: array<vec4<u32>>;

const GROUP: u32 = {{GROUP}}u;
const WHOLE: bool = {{WHOLE}};

// Each block's value of largest |x| (GROUP 256: shared by the group's 8 blocks).
var<workgroup> big: array<f32, 64>;

fn pack4(q: vec4<f32>) -> u32 {
    return pack4xI8(vec4<i32>(q));
}

// Of a and b (a first), the one of larger |value|, a on ties.
fn larger(a: f32, b: f32) -> f32 {
    return select(a, b, abs(b) > abs(a));
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    let m = select(step.n_tokens, step.n_sample, p.m_src == 1u);
    let inside = i < m * p.k_blocks;
    let at = (i / p.k_blocks) * p.x_stride4 + (i % p.k_blocks) * 8u;
    var v: array<vec4<f32>, 8>;
    var top = 0.0;
    if (inside) {
        for (var j = 0u; j < 8u; j++) {
            v[j] = x[at + j];
            top = larger(larger(larger(larger(top, v[j].x), v[j].y), v[j].z), v[j].w);
        }
    }
    if (GROUP == 256u) {
        big[lid] = top;
        workgroupBarrier();
        let g0 = lid & ~7u;
        top = 0.0;
        for (var j = 0u; j < 8u; j++) {
            top = larger(top, big[g0 + j]);
        }
    }
    if (!inside) {
        return;
    }
    let am = abs(top);
    var d: f32;
    var q: array<vec4<f32>, 8>;
    if (GROUP == 256u) {
        let iscale = select(0.0, -127.0 / top, am > 0.0);
        d = select(0.0, 1.0 / iscale, am > 0.0);
        for (var j = 0u; j < 8u; j++) {
            q[j] = min(round(v[j] * iscale), vec4<f32>(127.0));
        }
    } else {
        d = quantizeToF16(am / 127.0);
        let id = select(0.0, 127.0 / am, am > 0.0);
        for (var j = 0u; j < 8u; j++) {
            q[j] = round(v[j] * id);
        }
    }
    let lo = q[0] + q[1] + q[2] + q[3];
    let hi = q[4] + q[5] + q[6] + q[7];
    let qs = vec2<f32>(dot(lo, vec4<f32>(1.0)), dot(hi, vec4<f32>(1.0)));
    var sums = d * qs;
    if (WHOLE) {
        sums = vec2<f32>(quantizeToF16((am / 127.0) * (qs.x + qs.y)), 0.0);
    }
    y[i * 3u] = vec4<u32>(pack4(q[0]), pack4(q[1]), pack4(q[2]), pack4(q[3]));
    y[i * 3u + 1u] = vec4<u32>(pack4(q[4]), pack4(q[5]), pack4(q[6]), pack4(q[7]));
    y[i * 3u + 2u] = vec4<u32>(bitcast<u32>(d), bitcast<u32>(sums.x), bitcast<u32>(sums.y), 0u);
}
