// The mixture-of-experts router (ops/moe.rs): per token, the top_k experts and their weights,
// into `y`, the route buffer (y[2p] = expert, y[2p + 1] = weight bits, for pair p = t * top_k + j;
// read by moe.wgsl); then, for prefill-sized steps, the pairs grouped by expert: a count per
// expert (each pair's rank among its expert's pairs), where each expert's run starts (runs
// padded to multiples of TG with NONE; and the tiles of MT pairs before each expert's), and each
// pair put at its place. The order of pairs within
// a run depends on the atomics, but a pair's result does not depend on its neighbours.
// MoeParams precedes this file.

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: MoeParams;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(6) var<storage, read_write> y: array<atomic<u32>>;
// Each expert's scale (MOE_SCALED: Gemma 4's per_expert_scale), in the bias binding.
@group(0) @binding(7) var<storage, read> bias: array<f32>;

const TG: u32 = {{TG}}u;
const MT: u32 = {{MT}}u;
const NONE: u32 = 0xffffffffu;

// Router: one thread per token. x = the router's logits [n_tokens, n_experts] (with the
// router's bias, where it has one). The top_k largest (lowest index first among equals), with
// weights softmax(all logits)[e], renormalised over the chosen ones with MOE_NORM (which is also
// gpt-oss's softmax over the chosen logits).
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = gid.x + gid.y * nwg.x * 64u;
    if (t == 0u) {
        // The counts start from 0 for the grouping that follows.
        for (var e = 0u; e < p.n_experts; e++) {
            atomicStore(&y[p.off_counts + e], 0u);
        }
    }
    if (t >= step.n_tokens) {
        return;
    }
    let ne = p.n_experts;
    let base = t * ne;
    var mx = -3.0e38;
    for (var e = 0u; e < ne; e++) {
        mx = max(mx, x[base + e]);
    }
    var z = 0.0;
    for (var e = 0u; e < ne; e++) {
        z += exp(x[base + e] - mx);
    }
    var taken: array<u32, 16>;
    var chosen_sum = 0.0;
    for (var j = 0u; j < p.top_k; j++) {
        var best = 0u;
        var bv = -3.4e38;
        var found = false;
        for (var e = 0u; e < ne; e++) {
            let free = (taken[e / 32u] & (1u << (e % 32u))) == 0u;
            let v = x[base + e];
            if (free && (!found || v > bv)) {
                best = e;
                bv = v;
                found = true;
            }
        }
        taken[best / 32u] |= 1u << (best % 32u);
        let w = exp(bv - mx) / z;
        chosen_sum += w;
        atomicStore(&y[2u * (t * p.top_k + j)], best);
        atomicStore(&y[2u * (t * p.top_k + j) + 1u], bitcast<u32>(w));
    }
    if ((p.flags & MOE_NORM) != 0u) {
        for (var j = 0u; j < p.top_k; j++) {
            let i = 2u * (t * p.top_k + j) + 1u;
            atomicStore(&y[i], bitcast<u32>(bitcast<f32>(atomicLoad(&y[i])) / chosen_sum));
        }
    }
    if ((p.flags & MOE_SCALED) != 0u) {
        for (var j = 0u; j < p.top_k; j++) {
            let i = 2u * (t * p.top_k + j) + 1u;
            let e = atomicLoad(&y[i - 1u]);
            atomicStore(&y[i], bitcast<u32>(bitcast<f32>(atomicLoad(&y[i])) * bias[e]));
        }
    }
}

// A thread per pair: its rank among its expert's pairs.
@compute @workgroup_size(64)
fn count_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let pair = gid.x + gid.y * nwg.x * 64u;
    if (pair >= step.n_tokens * p.top_k) {
        return;
    }
    let e = atomicLoad(&y[2u * pair]);
    atomicStore(&y[p.off_rank + pair], atomicAdd(&y[p.off_counts + e], 1u));
}

// One thread: where each expert's run starts (runs padded to multiples of TG), the end of all runs
// at n_experts, and the padding slots set to NONE; and, from p.off_tiles, the tiles of MT pairs
// the runs before each expert take (moe_tiled.wgsl), all of them at n_experts.
@compute @workgroup_size(1)
fn offsets_main() {
    let ne = p.n_experts;
    var at = 0u;
    var tiles = 0u;
    for (var e = 0u; e < ne; e++) {
        atomicStore(&y[p.off_counts + ne + e], at);
        atomicStore(&y[p.off_tiles + e], tiles);
        let c = atomicLoad(&y[p.off_counts + e]);
        let end = at + (c + TG - 1u) / TG * TG;
        for (var s = at + c; s < end; s++) {
            atomicStore(&y[p.off_order + s], NONE);
        }
        at = end;
        tiles += (c + MT - 1u) / MT;
    }
    atomicStore(&y[p.off_counts + 2u * ne], at);
    atomicStore(&y[p.off_tiles + ne], tiles);
}

// A thread per pair: into its expert's run, at its rank.
@compute @workgroup_size(64)
fn scatter_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let pair = gid.x + gid.y * nwg.x * 64u;
    if (pair >= step.n_tokens * p.top_k) {
        return;
    }
    let e = atomicLoad(&y[2u * pair]);
    let at = atomicLoad(&y[p.off_counts + p.n_experts + e]) + atomicLoad(&y[p.off_rank + pair]);
    atomicStore(&y[p.off_order + at], pair);
}
