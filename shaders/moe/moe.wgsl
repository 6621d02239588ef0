// The mixture-of-experts FFN's expert projections (ops/moe.rs), reading only the rows of the
// experts each token was routed to (ggml's mul_mat_id). The weight format's snippet (wq, ws, Sc,
// wscale, wpart) and MoeParams precede this file; routing and grouping are moe_route.wgsl.
//
// `route` holds, per (token t, choice j) pair p = t * top_k + j: route[2p] = the expert,
// route[2p + 1] = its weight (f32 bits); from p.off_order, the pairs grouped by expert (each
// expert's run padded to a multiple of TG with NONE; p.off_counts + n_experts + e: where expert
// e's run starts, + n_experts: the end of all runs). The experts of one tensor are split over
// chunks of whole experts (e0 <= e < e1 here; expert e's rows start at (e - e0) * rows_per_expert).
//
// Decode-sized steps run a thread per (pair, TN outputs); prefill-sized ones a thread per (TG
// pairs of one expert, TN outputs), each weight part loaded once for TG tokens. Both sum in the
// same order, so a token's result does not depend on the path. Gate/up writes act(gate, up) per
// pair; down writes each pair's projection, and the combine adds the weighted pairs of a token
// into the residual.

// moe_common.wgsl (the bindings but x, act, bias_of, linear) precedes this file.

@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

const TN: u32 = {{TN}}u;
const TG: u32 = {{TG}}u;

// Dot products of TN consecutive weight rows from `row` (clamped to `last`) with x row `xr`.
fn dots(row: u32, last: u32, xr: u32) -> array<f32, TN> {
    var acc: array<f32, TN>;
    for (var b = 0u; b < p.k_blocks; b++) {
        var sc: array<Sc, TN>;
        for (var j = 0u; j < TN; j++) {
            sc[j] = wscale(min(row + j, last) * p.k_blocks + b);
        }
        for (var q = 0u; q < 4u; q++) {
            let xb = xr * p.x_stride4 + b * 8u + q;
            let xl = x[xb];
            let xh = x[xb + 4u];
            for (var j = 0u; j < TN; j++) {
                let w = wpart(min(row + j, last) * p.k_blocks + b, q, sc[j]);
                acc[j] += dot(w.lo, xl) + dot(w.hi, xh);
            }
        }
    }
    return acc;
}

// The same for TG x rows at once (`xr[i]` = NONE: row i is padding, computed on row 0).
fn group_dots(row: u32, last: u32, xr: array<u32, TG>) -> array<array<f32, TN>, TG> {
    var acc: array<array<f32, TN>, TG>;
    for (var b = 0u; b < p.k_blocks; b++) {
        var sc: array<Sc, TN>;
        for (var j = 0u; j < TN; j++) {
            sc[j] = wscale(min(row + j, last) * p.k_blocks + b);
        }
        for (var q = 0u; q < 4u; q++) {
            var w: array<Part, TN>;
            for (var j = 0u; j < TN; j++) {
                w[j] = wpart(min(row + j, last) * p.k_blocks + b, q, sc[j]);
            }
            for (var i = 0u; i < TG; i++) {
                let xb = select(xr[i], 0u, xr[i] == NONE) * p.x_stride4 + b * 8u + q;
                let xl = x[xb];
                let xh = x[xb + 4u];
                for (var j = 0u; j < TN; j++) {
                    acc[i][j] += dot(w[j].lo, xl) + dot(w[j].hi, xh);
                }
            }
        }
    }
    return acc;
}

// Writes one pair's TN outputs from n0: gate/up (`gu`: the up dots in `u`) or down.
fn store(pair: u32, e: u32, n0: u32, g: array<f32, TN>, u: array<f32, TN>, gu: bool) {
    for (var j = 0u; j < TN; j++) {
        let n = n0 + j;
        if (n < p.n_out) {
            if (gu) {
                y[pair * p.y_stride + n] = act(g[j] + bias_of(e, n), u[j] + bias_of(e, p.n_out + n));
            } else {
                y[pair * p.y_stride + n] = g[j] + bias_of(e, n);
            }
        }
    }
}

// A thread per (pair, TN outputs), for the pairs routed to this chunk. Gate/up: x row = the
// pair's token, rows_per_expert = 2 * n_out (gate rows, then up rows). Down: x row = the pair.
fn per_pair(inv: u32, gu: bool) {
    let groups = (p.n_out + TN - 1u) / TN;
    let pair = inv / groups;
    let n0 = (inv % groups) * TN;
    if (pair >= step.n_tokens * p.top_k) {
        return;
    }
    let e = route[2u * pair];
    if (e < p.e0 || e >= p.e1) {
        return;
    }
    let r0 = (e - p.e0) * p.rows_per_expert;
    let xr = select(pair, pair / p.top_k, gu);
    let g = dots(r0 + n0, r0 + p.n_out - 1u, xr);
    var u: array<f32, TN>;
    if (gu) {
        u = dots(r0 + p.n_out + n0, r0 + 2u * p.n_out - 1u, xr);
    }
    store(pair, e, n0, g, u, gu);
}

// A thread per (TG grouped pairs of one expert, TN outputs).
fn grouped(inv: u32, gu: bool) {
    let groups = (p.n_out + TN - 1u) / TN;
    let s0 = (inv / groups) * TG;
    let n0 = (inv % groups) * TN;
    if (s0 >= route[p.off_counts + 2u * p.n_experts]) {
        return;
    }
    let first = route[p.off_order + s0];
    if (first == NONE) {
        return;
    }
    let e = route[2u * first];
    if (e < p.e0 || e >= p.e1) {
        return;
    }
    var pairs: array<u32, TG>;
    var xr: array<u32, TG>;
    for (var i = 0u; i < TG; i++) {
        pairs[i] = route[p.off_order + s0 + i];
        xr[i] = select(select(pairs[i], pairs[i] / p.top_k, gu), NONE, pairs[i] == NONE);
    }
    let r0 = (e - p.e0) * p.rows_per_expert;
    let g = group_dots(r0 + n0, r0 + p.n_out - 1u, xr);
    var u: array<array<f32, TN>, TG>;
    if (gu) {
        u = group_dots(r0 + p.n_out + n0, r0 + 2u * p.n_out - 1u, xr);
    }
    for (var i = 0u; i < TG; i++) {
        if (pairs[i] != NONE) {
            store(pairs[i], e, n0, g[i], u[i], gu);
        }
    }
}

@compute @workgroup_size(64)
fn gate_up_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    per_pair(linear(gid, nwg), true);
}

@compute @workgroup_size(64)
fn down_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    per_pair(linear(gid, nwg), false);
}

@compute @workgroup_size(64)
fn gate_up_grouped(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    grouped(linear(gid, nwg), true);
}

@compute @workgroup_size(64)
fn down_grouped(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    grouped(linear(gid, nwg), false);
}

// y (the residual) [t, n] += sum over t's choices j, in order, of w_j * x[t * top_k + j, n] (x:
// the down projections of the pairs, n_out floats each). A thread per (token, output).
@compute @workgroup_size(64)
fn combine_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let inv = linear(gid, nwg);
    let t = inv / p.n_out;
    let n = inv % p.n_out;
    if (t >= step.n_tokens) {
        return;
    }
    var acc = 0.0;
    for (var j = 0u; j < p.top_k; j++) {
        let pair = t * p.top_k + j;
        let i = pair * p.n_out + n;
        acc += bitcast<f32>(route[2u * pair + 1u]) * x[i / 4u][i % 4u];
    }
    // MOE_SCALED: the sum is written (Gemma 4 norms it before it joins the residual).
    if ((p.flags & MOE_SCALED) != 0u) {
        y[t * p.y_stride + n] = acc;
    } else {
        y[t * p.y_stride + n] += acc;
    }
}

// The shared expert's gate (Qwen2-MoE): y (the shared expert's activations, p.n_out wide) [t, n]
// *= sigmoid(x[t * p.y_stride]) (x: the router logits' buffer, where the gate's logit of token t
// was written at column 0). A thread per (token, activation).
@compute @workgroup_size(64)
fn shared_gate_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let inv = linear(gid, nwg);
    let t = inv / p.n_out;
    if (t >= step.n_tokens) {
        return;
    }
    let i = t * p.y_stride;
    y[inv] = y[inv] / (1.0 + exp(-x[i / 4u][i % 4u]));
}
