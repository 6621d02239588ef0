// Gated DeltaNet (Qwen3.5's linear-attention layers) and the sigmoid output gate of its
// attention layers. `x` holds each token's projections in one row of p.x_stride floats:
// [q (k_heads * k_dim) | k (k_heads * k_dim) | v (v_heads * v_dim) | z (v_heads * v_dim) |
//  b (v_heads) | a (v_heads)]; the first three parts (conv_dim channels) go through the causal
// convolution. Each sequence of the step has a record at md[p.off_state + 4 s]: its state slot,
// its first token row, its token count in this step, and whether it starts from a zero state
// (its first token is at position 0). States: the convolution's last kernel - 1 inputs per
// channel ([slot, kernel - 1, conv_dim]) and the delta rule's matrix per value head
// ([slot, v_head, k_dim, v_dim]), both f32.
//
// Entry points, run in this order by a linear-attention layer:
//   conv_main  a thread per (sequence, channel): the depthwise causal convolution + SiLU over the
//              sequence's tokens in order, in place, continuing from (and updating) its state
//   prep_main  a thread per (token, head of k_heads + v_heads): q, k L2-normalised (q also
//              scaled by k_dim^-1/2); per value head the log decay A * softplus(a + dt_bias)
//              into a's column and beta = sigmoid(b) into b's column
//   chunk_main, chunk_state_main (delta_chunk.wgsl): the chunked parallel form, for the
//              sequences of CHUNK_MIN tokens or more in the step
//   delta_main a workgroup per (sequence of fewer than CHUNK_MIN tokens, value head, 64 value
//              columns), a thread per column j: the column S[:, j] of the state in registers,
//              per token in order
//              S = decay * S; S += k (beta (v_j - k . S[:, j])); o_j = q . S[:, j]
//   gnorm_main a thread per (token, value head): RMSNorm of o over v_dim times the norm weight,
//              times silu(z)
// and for attention layers:
//   gate_main  a thread per (token, i < gate_width): out[t, i] *= sigmoid(x[t, i]) (the gate
//              projection written to x with gate_width floats per row)
//
// LOOP_NOTE: llvmpipe (lavapipe) ends every loop of an invocation once 65535 loop iterations
// have run in that invocation in total, silently. A loop over a sequence's tokens with loops over
// k_dim inside (2 * 128 iterations per token) stopped after ~250 tokens: the rest of the outputs
// were whatever the buffer held from earlier steps (another request's), and the state went on
// from there. So the per-token loops below hold no loop: the loops over the state's rows and over
// the convolution's taps are written out when the pipeline is built (ops/sources.rs),
// one loop iteration per token. The chunked form's per-chunk loops are bounded differently
// (ops/delta.rs `max_loop_tokens`).

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: DeltaParams; // declared from Rust (ops/)
@group(0) @binding(2) var<storage, read> md: array<u32>;
// conv weights [conv_dim, kernel], then A (= -exp(A_log)) [v_heads], dt_bias [v_heads], norm [v_dim]
@group(0) @binding(3) var<storage, read> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> x: array<f32>;
@group(0) @binding(5) var<storage, read_write> conv_state: array<f32>;
@group(0) @binding(6) var<storage, read_write> rec_state: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
// The chunked form's per-chunk matrices (delta_chunk.wgsl): [token, v_head, 2 * CH].
@group(0) @binding(8) var<storage, read_write> chunks: array<f32>;

// The state matrix's rows held by one thread (k_dim, fixed per model).
const DK: u32 = {{DK}}u;
// Most taps of the convolution.
const MAX_KERNEL: u32 = 8u;

const NO_SLOT: u32 = 0xffffffffu;

struct SeqRec {
    slot: u32,
    first: u32,
    count: u32,
    reset: u32,
    backup: u32,
    snap: u32,
    snap_at: u32,
    src: u32,
}

fn seq_rec(s: u32) -> SeqRec {
    let b = p.off_state + 8u * s;
    return SeqRec(md[b], md[b + 1u], md[b + 2u], md[b + 3u], md[b + 4u], md[b + 5u], md[b + 6u], md[b + 7u]);
}

// The slot a sequence's state is read from.
fn read_slot(r: SeqRec) -> u32 {
    return select(r.slot, r.src, r.src != NO_SLOT);
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

fn linear_id(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    // The grid may be folded into 2-D (see Gpu::fold): the linear invocation index.
    return gid.x + gid.y * nwg.x * 64u;
}

@compute @workgroup_size(64)
fn conv_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = linear_id(gid, nwg);
    let conv_dim = 2u * p.k_heads * p.k_dim + p.v_heads * p.v_dim;
    let c = id % conv_dim;
    let s = id / conv_dim;
    if (s >= step.n_seqs) {
        return;
    }
    let r = seq_rec(s);
    if (r.count == 0u) {
        return;
    }
    let taps = p.kernel - 1u;
    let sbase = r.slot * taps * conv_dim + c;
    let lbase = read_slot(r) * taps * conv_dim + c;
    let bbase = r.backup * taps * conv_dim + c;
    let reset = r.reset != 0u;
    let backup = r.backup != NO_SLOT;
    // hist[j]: the input j + 1 - kernel positions before the current one (oldest first). The
    // loops over taps are written out (see LOOP_NOTE), each statement of tap j under j < taps.
    var hist: array<f32, MAX_KERNEL>;
{{CONV_LOAD}}
    let wb = c * p.kernel;
    let w_in = w[wb + taps];
    for (var t = r.first; t < r.first + r.count; t++) {
        let xi = t * p.x_stride + c;
        let v = x[xi];
        var acc = w_in * v;
{{CONV_ACC}}
{{CONV_SHIFT}}
        x[xi] = silu(acc);
        if (r.snap != NO_SLOT && t - r.first == r.snap_at) {
            let nb = r.snap * taps * conv_dim + c;
{{CONV_SNAP}}
        }
    }
{{CONV_STORE}}
}

@compute @workgroup_size(64)
fn prep_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = linear_id(gid, nwg);
    let heads = p.k_heads + p.v_heads;
    let h = id % heads;
    let t = id / heads;
    if (t >= step.n_tokens) {
        return;
    }
    let row = t * p.x_stride;
    if (h < p.k_heads) {
        let key_dim = p.k_heads * p.k_dim;
        let qb = row + h * p.k_dim;
        let kb = qb + key_dim;
        var qq = 0.0;
        var kk = 0.0;
        for (var i = 0u; i < p.k_dim; i++) {
            qq += x[qb + i] * x[qb + i];
            kk += x[kb + i] * x[kb + i];
        }
        // FLA's l2norm: x / sqrt(sum x^2 + 1e-6); q also by k_dim^-1/2.
        let rq = inverseSqrt(qq + 1e-6) * inverseSqrt(f32(p.k_dim));
        let rk = inverseSqrt(kk + 1e-6);
        for (var i = 0u; i < p.k_dim; i++) {
            x[qb + i] = x[qb + i] * rq;
            x[kb + i] = x[kb + i] * rk;
        }
        return;
    }
    let vh = h - p.k_heads;
    let bi = row + p.off_b + vh;
    let ai = row + p.off_a + vh;
    let a = x[ai] + w[p.w_dt + vh];
    // softplus with PyTorch's threshold (x > 20: x).
    let sp = select(log(1.0 + exp(a)), a, a > 20.0);
    // The log of the decay (<= 0): the chunked form sums them.
    x[ai] = w[p.w_a + vh] * sp;
    x[bi] = sigmoid(x[bi]);
}

@compute @workgroup_size(64)
fn delta_main(
    @builtin(workgroup_id) wid3: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let wid = wid3.x + wid3.y * nwg.x;
    let col_blocks = (p.v_dim + 63u) / 64u;
    let cb = wid % col_blocks;
    let vh = (wid / col_blocks) % p.v_heads;
    let s = wid / (col_blocks * p.v_heads);
    let j = cb * 64u + lid;
    if (s >= step.n_seqs || j >= p.v_dim) {
        return;
    }
    let r = seq_rec(s);
    // Longer sequences are chunk_state_main's.
    if (r.count == 0u || r.count >= CHUNK_MIN) {
        return;
    }
    let kh = select(vh / (p.v_heads / p.k_heads), vh % p.k_heads, p.tiled != 0u);
    let key_dim = p.k_heads * p.k_dim;
    let value_dim = p.v_heads * p.v_dim;
    let sbase = ((r.slot * p.v_heads + vh) * p.k_dim) * p.v_dim + j;
    let lbase = ((read_slot(r) * p.v_heads + vh) * p.k_dim) * p.v_dim + j;
    let bbase = ((r.backup * p.v_heads + vh) * p.k_dim) * p.v_dim + j;
    var col: array<f32, DK>;
    let reset = r.reset != 0u;
    let backup = r.backup != NO_SLOT;
    // Every loop over the state's DK rows is written out (see LOOP_NOTE): one loop iteration
    // per token.
{{REC_LOAD}}
    for (var t = r.first; t < r.first + r.count; t++) {
        let row = t * p.x_stride;
        let qb = row + kh * p.k_dim;
        let kb = qb + key_dim;
        let decay = exp(x[row + p.off_a + vh]);
        let beta = x[row + p.off_b + vh];
        var kv = 0.0;
{{REC_DECAY}}
        let delta = (x[row + 2u * key_dim + vh * p.v_dim + j] - kv) * beta;
        var o = 0.0;
{{REC_UPDATE}}
        out[t * value_dim + vh * p.v_dim + j] = o;
        if (r.snap != NO_SLOT && t - r.first == r.snap_at) {
            let nb = ((r.snap * p.v_heads + vh) * p.k_dim) * p.v_dim + j;
{{REC_SNAP}}
        }
    }
{{REC_STORE}}
}

@compute @workgroup_size(64)
fn gnorm_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = linear_id(gid, nwg);
    let vh = id % p.v_heads;
    let t = id / p.v_heads;
    if (t >= step.n_tokens) {
        return;
    }
    let ob = t * p.v_heads * p.v_dim + vh * p.v_dim;
    let zb = t * p.x_stride + p.off_z + vh * p.v_dim;
    var ss = 0.0;
    for (var i = 0u; i < p.v_dim; i++) {
        ss += out[ob + i] * out[ob + i];
    }
    let r = inverseSqrt(ss / f32(p.v_dim) + p.eps);
    for (var i = 0u; i < p.v_dim; i++) {
        out[ob + i] = w[p.w_norm + i] * (out[ob + i] * r) * silu(x[zb + i]);
    }
}

@compute @workgroup_size(64)
fn gate_main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = linear_id(gid, nwg);
    let t = id / p.gate_width;
    if (t >= step.n_tokens) {
        return;
    }
    out[id] = out[id] * sigmoid(x[id]);
}
