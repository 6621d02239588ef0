// Paged attention with online softmax and GQA. One thread per (token, query head): the token at
// position pos attends causally to keys 0..=pos of its sequence (cached prefix and this step's
// chunk alike), read from the KV cache through the sequence's block table; with AttnParams.sinks,
// the head's sink logit joins the softmax's denominator (gpt-oss).
// HD4 (head_dim / 4) and the KV cache's bindings and loads (the KV snippet: load_k / load_v return
// elements 4i..4i+4, whether the cache holds f32 or f16) are substituted when the pipeline is built.

// AttnParams (src/gpu/shared.rs) is prepended.

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: AttnParams;
@group(0) @binding(2) var<storage, read> md: array<u32>;
@group(0) @binding(3) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> out: array<vec4<f32>>;

const HD4: u32 = {{HD4}}u;

{{KV}}

@compute @workgroup_size(32)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    // The grid may be folded into 2-D (see Gpu::fold): the linear invocation index.
    let id = gid.x + gid.y * nwg.x * 32u;
    let h = id % p.n_heads;
    let t = id / p.n_heads;
    if (t >= step.n_tokens) {
        return;
    }
    let kvh = h / (p.n_heads / p.n_kv_heads);
    let pos = md[step.off_pos + t];
    let table = step.off_table + md[step.off_seq + t] * step.max_blocks;
    var q: array<vec4<f32>, HD4>;
    var acc: array<vec4<f32>, HD4>;
    let qb = t * p.qkv_stride4 + h * HD4;
    for (var d = 0u; d < HD4; d++) {
        q[d] = qkv[qb + d] * p.scale;
        acc[d] = vec4<f32>(0.0);
    }
    var mx = -3.0e38;
    var l = 0.0;
    // Mistral's sliding window: keys pos - window + 1 ..= pos.
    let j0 = select(0u, pos + 1u - p.window, p.window > 0u && pos + 1u > p.window);
    for (var j = j0; j <= pos; j++) {
        let blk = md[table + j / p.block_size];
        let kb = ((blk * p.block_size + j % p.block_size) * p.n_kv_heads + kvh) * HD4;
        var s4 = vec4<f32>(0.0);
        // The head's HD4 terms, written out (no inner loop): llvmpipe stops every loop of an
        // invocation once 65535 iterations have run in total, so with loops over head_dim
        // here (2 * 65 per key at head_dim 256) a token past ~500 keys lost its last keys.
{{SCORE}}
        let s = capped(s4.x + s4.y + s4.z + s4.w);
        let mn = max(mx, s);
        let corr = exp(mx - mn);
        let e = exp(s - mn);
        l = l * corr + e;
{{ACCUM}}
        mx = mn;
    }
    let ob = (t * p.n_heads + h) * HD4;
    let inv = normaliser(h, mx, l);
    for (var d = 0u; d < HD4; d++) {
        out[ob + d] = acc[d] * inv;
    }
}
