// The chunked parallel form of the gated delta rule (appended to delta.wgsl), for sequences of
// CHUNK_MIN tokens or more in a step (prefill). Within a chunk of L <= CH tokens, with G_t the
// cumulative log decay from the chunk's start (gamma_t = exp(G_t)) and S0 the state before it,
// the per-token recurrence unrolls to
//   u_s = beta_s (v_s - gamma_s S0^T k_s) - sum_{r<s} A[s][r] u_r,
//         A[s][r] = beta_s exp(G_s - G_r) (k_s . k_r)
//   o_t = gamma_t S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s
//   S_L = gamma_L S0 + sum_s exp(G_L - G_s) k_s u_s^T
// so with T = (I + A)^-1 (unit lower triangular), U' = T diag(beta) V and y_r = k_r . S0:
//   u = U' - T diag(beta gamma) y.
// chunk_main computes what does not depend on S0 for every chunk at once: T and the decayed
// q.k products into `chunks` (rows of the chunk's tokens), U' in place of v. chunk_state_main
// then carries the state across a sequence's chunks (delta_main leaves such sequences alone).
//
// A sequence's chunks start at its first token, except that with a snapshot request one chunk
// ends after token snap_at (the snapshot is a state between chunks): the first chunk is then
// (snap_at + 1) % CH tokens long.

const CH: u32 = {{CH}}u;
const CHUNK_MIN: u32 = {{CHUNK_MIN}}u;

// Where the sequence's first full chunk starts (0, or the short first chunk's length).
fn chunk_off(r: SeqRec) -> u32 {
    return select(0u, (r.snap_at + 1u) % CH, r.snap != NO_SLOT);
}

fn n_chunks(r: SeqRec) -> u32 {
    let o = chunk_off(r);
    return select(0u, 1u, o > 0u) + (r.count - o + CH - 1u) / CH;
}

// Chunk c's token range [lo, hi), counted from the sequence's first token.
fn chunk_range(r: SeqRec, c: u32) -> vec2<u32> {
    let o = chunk_off(r);
    if (o > 0u && c == 0u) {
        return vec2<u32>(0u, o);
    }
    let lo = select(c * CH, o + (c - 1u) * CH, o > 0u);
    return vec2<u32>(lo, min(lo + CH, r.count));
}

// The chunk's row of T (then its q.k row at + CH) for token row t.
fn chunk_row(t: u32, vh: u32) -> u32 {
    return (t * p.v_heads + vh) * 2u * CH;
}

var<workgroup> sg: array<f32, CH>;
var<workgroup> sb: array<f32, CH>;
var<workgroup> sa: array<f32, CH * CH>;
var<workgroup> st: array<f32, CH * CH>;

// The chunk's cumulative log decays into sg and its betas into sb (one thread).
fn chunk_decays(t0: u32, n: u32, vh: u32) {
    var g = 0.0;
    for (var s = 0u; s < n; s++) {
        let row = (t0 + s) * p.x_stride;
        g += x[row + p.off_a + vh];
        sg[s] = g;
        sb[s] = x[row + p.off_b + vh];
    }
}

// A workgroup per (chunk slot, value head): chunk slots number the chunks of the step's
// sequences of CHUNK_MIN tokens or more in order; slots beyond them have nothing to do.
@compute @workgroup_size(64)
fn chunk_main(
    @builtin(workgroup_id) wid3: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let wid = wid3.x + wid3.y * nwg.x;
    let vh = wid % p.v_heads;
    var slot = wid / p.v_heads;
    var found = false;
    var r: SeqRec;
    for (var s = 0u; s < step.n_seqs; s++) {
        let rs = seq_rec(s);
        if (rs.count < CHUNK_MIN) {
            continue;
        }
        let n = n_chunks(rs);
        if (slot < n) {
            r = rs;
            found = true;
            break;
        }
        slot -= n;
    }
    if (!found) {
        return;
    }
    let range = chunk_range(r, slot);
    let n = range.y - range.x;
    let t0 = r.first + range.x;
    let kh = select(vh / (p.v_heads / p.k_heads), vh % p.k_heads, p.tiled != 0u);
    let key_dim = p.k_heads * p.k_dim;
    if (lid == 0u) {
        chunk_decays(t0, n, vh);
    }
    workgroupBarrier();
    // A (strictly lower) and the decayed q.k products (lower, with the diagonal).
    for (var e = lid; e < CH * CH; e += 64u) {
        let s = e / CH;
        let c = e % CH;
        var a = 0.0;
        if (s < n && c <= s) {
            let ks = (t0 + s) * p.x_stride + key_dim + kh * p.k_dim;
            let kc = (t0 + c) * p.x_stride + key_dim + kh * p.k_dim;
            let qs = (t0 + s) * p.x_stride + kh * p.k_dim;
            var kk = 0.0;
            var qk = 0.0;
            for (var i = 0u; i < DK; i++) {
                let kci = x[kc + i];
                kk += x[ks + i] * kci;
                qk += x[qs + i] * kci;
            }
            let dec = exp(sg[s] - sg[c]);
            a = select(sb[s] * dec * kk, 0.0, c == s);
            chunks[chunk_row(t0 + s, vh) + CH + c] = dec * qk;
        }
        sa[e] = a;
    }
    workgroupBarrier();
    // T = (I + A)^-1 by forward substitution, a column per thread.
    if (lid < n) {
        let c = lid;
        st[c * CH + c] = 1.0;
        for (var s = c + 1u; s < n; s++) {
            var acc = 0.0;
            for (var m = c; m < s; m++) {
                acc -= sa[s * CH + m] * st[m * CH + c];
            }
            st[s * CH + c] = acc;
        }
    }
    workgroupBarrier();
    for (var e = lid; e < CH * CH; e += 64u) {
        let s = e / CH;
        let c = e % CH;
        if (s < n && c <= s) {
            chunks[chunk_row(t0 + s, vh) + c] = st[e];
        }
    }
    // U' = T diag(beta) V in place of v, a value column per thread.
    let vbase = 2u * key_dim + vh * p.v_dim;
    for (var j = lid; j < p.v_dim; j += 64u) {
        var bv: array<f32, CH>;
        for (var s = 0u; s < n; s++) {
            bv[s] = sb[s] * x[(t0 + s) * p.x_stride + vbase + j];
        }
        for (var s = 0u; s < n; s++) {
            var acc = 0.0;
            for (var c = 0u; c <= s; c++) {
                acc += st[s * CH + c] * bv[c];
            }
            x[(t0 + s) * p.x_stride + vbase + j] = acc;
        }
    }
}

// Value columns per workgroup of chunk_state_main, and its threads.
const CB: u32 = {{CB}}u;
const CS_THREADS: u32 = 256u;

var<workgroup> ss: array<f32, DK * CB>;
var<workgroup> sy: array<f32, CH * CB>;
var<workgroup> sq: array<f32, CH * CB>;
var<workgroup> su: array<f32, CH * CB>;
// u_s exp(G_L - G_s): the state update's weights.
var<workgroup> sw: array<f32, CH * CB>;

// The state's rows i of columns cb * CB + jj, at i * CB + jj of `ss`, to or from slot `slot`.
fn state_index(slot: u32, vh: u32, i: u32, j: u32) -> u32 {
    return ((slot * p.v_heads + vh) * p.k_dim + i) * p.v_dim + j;
}

// A workgroup per (sequence of CHUNK_MIN tokens or more, value head, CB value columns): the
// state block in workgroup memory, carried across the sequence's chunks in order; within a
// chunk every step is parallel over tokens and columns (or rows and columns):
//   y = beta gamma (K S0), qS = gamma (Q S0); u = U' - T y; o = qS + (decayed QK^T) u;
//   S = gamma_L S0 + K^T diag(exp(G_L - G)) u.
@compute @workgroup_size(256)
fn chunk_state_main(
    @builtin(workgroup_id) wid3: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let wid = wid3.x + wid3.y * nwg.x;
    let col_blocks = (p.v_dim + CB - 1u) / CB;
    let cb = wid % col_blocks;
    let vh = (wid / col_blocks) % p.v_heads;
    let seq = wid / (col_blocks * p.v_heads);
    if (seq >= step.n_seqs) {
        return;
    }
    let r = seq_rec(seq);
    if (r.count < CHUNK_MIN) {
        return;
    }
    let kh = select(vh / (p.v_heads / p.k_heads), vh % p.k_heads, p.tiled != 0u);
    let key_dim = p.k_heads * p.k_dim;
    let value_dim = p.v_heads * p.v_dim;
    for (var e = lid; e < DK * CB; e += CS_THREADS) {
        let i = e / CB;
        let j = cb * CB + e % CB;
        var v = 0.0;
        if (j < p.v_dim) {
            v = select(rec_state[state_index(read_slot(r), vh, i, j)], 0.0, r.reset != 0u);
            if (r.backup != NO_SLOT) {
                rec_state[state_index(r.backup, vh, i, j)] = v;
            }
        }
        ss[e] = v;
    }
    let nc = n_chunks(r);
    for (var c = 0u; c < nc; c++) {
        let range = chunk_range(r, c);
        let n = range.y - range.x;
        let t0 = r.first + range.x;
        if (lid == 0u) {
            chunk_decays(t0, n, vh);
        }
        workgroupBarrier();
        // y and qS: a k_dim-long product per (token, column), for k and for q.
        for (var e = lid; e < 2u * CH * CB; e += CS_THREADS) {
            let rem = e % (CH * CB);
            let s = rem / CB;
            if (s < n) {
                let is_q = e >= CH * CB;
                let vb = (t0 + s) * p.x_stride + select(key_dim, 0u, is_q) + kh * p.k_dim;
                let jj = rem % CB;
                var acc = 0.0;
                for (var i = 0u; i < DK; i++) {
                    acc += ss[i * CB + jj] * x[vb + i];
                }
                if (is_q) {
                    sq[rem] = acc * exp(sg[s]);
                } else {
                    sy[rem] = acc * sb[s] * exp(sg[s]);
                }
            }
        }
        workgroupBarrier();
        // u = U' - T y
        let gn = sg[n - 1u];
        for (var e = lid; e < CH * CB; e += CS_THREADS) {
            let s = e / CB;
            let jj = e % CB;
            let j = cb * CB + jj;
            if (s < n && j < p.v_dim) {
                let tr = chunk_row(t0 + s, vh);
                var acc = x[(t0 + s) * p.x_stride + 2u * key_dim + vh * p.v_dim + j];
                for (var m = 0u; m <= s; m++) {
                    acc -= chunks[tr + m] * sy[m * CB + jj];
                }
                su[e] = acc;
                sw[e] = acc * exp(gn - sg[s]);
            }
        }
        workgroupBarrier();
        // The outputs.
        for (var e = lid; e < CH * CB; e += CS_THREADS) {
            let t = e / CB;
            let jj = e % CB;
            let j = cb * CB + jj;
            if (t < n && j < p.v_dim) {
                let qr = chunk_row(t0 + t, vh) + CH;
                var o = sq[e];
                for (var s = 0u; s <= t; s++) {
                    o += chunks[qr + s] * su[s * CB + jj];
                }
                out[(t0 + t) * value_dim + vh * p.v_dim + j] = o;
            }
        }
        // The state after the chunk (ss is read above only before the last barrier).
        let dn = exp(gn);
        for (var e = lid; e < DK * CB; e += CS_THREADS) {
            let i = e / CB;
            let jj = e % CB;
            var acc = ss[e] * dn;
            for (var s = 0u; s < n; s++) {
                let k = x[(t0 + s) * p.x_stride + key_dim + kh * p.k_dim + i];
                acc += k * sw[s * CB + jj];
            }
            ss[e] = acc;
        }
        workgroupBarrier();
        if (r.snap != NO_SLOT && range.y == r.snap_at + 1u) {
            for (var e = lid; e < DK * CB; e += CS_THREADS) {
                let j = cb * CB + e % CB;
                if (j < p.v_dim) {
                    rec_state[state_index(r.snap, vh, e / CB, j)] = ss[e];
                }
            }
        }
    }
    for (var e = lid; e < DK * CB; e += CS_THREADS) {
        let j = cb * CB + e % CB;
        if (j < p.v_dim) {
            rec_state[state_index(r.slot, vh, e / CB, j)] = ss[e];
        }
    }
}
