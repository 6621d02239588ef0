// Repetition / frequency / presence penalties and logit bias, applied to the sampled rows'
// logits before sampling. One workgroup per row; the row's entries (unique token ids) are
// adj[start .. start + len], each (id, generated count, 1 if in the prompt, bias f32 bits).
// Per-row words in md at off_params + PARAMS_STRIDE * r: [4] repetition penalty, [5] frequency penalty,
// [6] presence penalty (f32 bits), [8] start, [9] len, [11] the row's token mask (structured
// outputs): NO_MASK, or the entry where its vocab.div_ceil(32) words start in adj (bit i % 32 of
// word i / 32 allows token i). Tokens the mask does not allow get MASKED_LOGIT, after the
// adjustments, so no penalty or bias can lift them.

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: SamplerParams; // declared from Rust (ops/sample.rs)
@group(0) @binding(2) var<storage, read> md: array<u32>;
@group(0) @binding(3) var<storage, read> adj: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> logits: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // One workgroup per row; the grid may be folded into 2-D (see Gpu::fold).
    let r = wid.x + wid.y * nwg.x;
    if (r >= step.n_sample) {
        return;
    }
    let pb = p.off_params + PARAMS_STRIDE * r;
    let rep = bitcast<f32>(md[pb + W_REPETITION]);
    let freq = bitcast<f32>(md[pb + W_FREQUENCY]);
    let pres = bitcast<f32>(md[pb + W_PRESENCE]);
    let start = md[pb + W_ADJ_START];
    let len = md[pb + W_ADJ_LEN];
    for (var e = lid; e < len; e += 64u) {
        let a = adj[start + e];
        let idx = r * p.vocab + a.x;
        var l = logits[idx];
        if (rep != 1.0 && (a.y > 0u || a.z != 0u)) {
            l = select(l * rep, l / rep, l > 0.0);
        }
        l -= freq * f32(a.y) + select(0.0, pres, a.y > 0u);
        l += bitcast<f32>(a.w);
        logits[idx] = l;
    }
    // The mask below may write the logits another thread adjusted above.
    storageBarrier();
    let moff = md[pb + W_MASK];
    if (moff == NO_MASK) {
        return;
    }
    // One token per thread per iteration, neighbouring lanes on neighbouring tokens (they
    // share the mask word). Every lane stores (the logit or MASKED_LOGIT): on llvmpipe a store
    // under a partial lane mask is much slower than a load and a full store.
    let row = r * p.vocab;
    for (var t = lid; t < p.vocab; t += 64u) {
        let bits = adj[moff + t / 128u][(t / 32u) % 4u];
        let i = row + t;
        logits[i] = select(logits[i], MASKED_LOGIT, ((bits >> (t % 32u)) & 1u) == 0u);
    }
}
