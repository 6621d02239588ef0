// GPU profile, decode steps of 2 to 16 tokens per workgroup (TM): y[t, row0 + n] (=|+=)
// sum_k x[t, k] * W[n, k]. The grid is matmul_gpu.wgsl's (one workgroup per NR weight rows x TM
// tokens, the token groups of the same rows next to each other); its 64 invocations form NR
// groups of LANES, one weight row each, and invocation j of a group takes the row's 32-element
// blocks j, j + LANES, ... Per block the scale record and the codes are decoded once (`wscale`,
// `wcodes`, `wterms` of the weight format, as in matmul_gpu.wgsl) and each token's x block is
// loaded and used at once (its sums, for formats with a min, from the same loads).
//
// One row per invocation is what keeps this kernel in registers: TM accumulators, the block's
// 32 codes and one token's 32 x values are live. matmul_gpu.wgsl (one token) shares each x block
// across the NR rows; with TM tokens that keeps TM * 32 x values live (256 registers at 8 tokens,
// 512 at 16: spilled to scratch on every AMD target, see BENCHMARKS.md's compiler report).
//
// Partial sums: LANES per output through workgroup memory, each output summed by one invocation.
// With SWIGLU, the NR rows are NR/2 gate rows and the same up rows (gate rows first in the
// chunk, up rows n_rows later) and y = glu(gate . x) * (up . x).
// The weight format's wfmt_*.wgsl (wq, ws, Sc, wscale, wcodes, wterms, WMIN) is prepended.

@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;

const TM: u32 = {{TM}}u;
const NR: u32 = 4u;
const WG: u32 = 64u;
const LANES: u32 = WG / NR;
const NV: u32 = TM * NR;
const SWIGLU: bool = {{SWIGLU}};

// Partial sums: output k = token * NR + row, lane j at k * LANES + j.
var<workgroup> part: array<f32, NV * LANES>;
// The workgroup's total of output k.
var<workgroup> tot: array<f32, NV>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // The grid may be folded into 2-D (see Gpu::fold): the linear workgroup index.
    let g = wid.x + wid.y * nwg.x;
    let outs = select(NR, NR / 2u, SWIGLU); // output columns per workgroup
    let col_groups = (p.n_rows + outs - 1u) / outs;
    let m = rows_m();
    let t_groups = (m + TM - 1u) / TM;
    if (g >= col_groups * t_groups) {
        return;
    }
    let t0 = (g % t_groups) * TM;
    let n0 = (g / t_groups) * outs;
    let r = lid / LANES;
    var row: u32;
    if (SWIGLU) {
        let c = min(n0 + r % (NR / 2u), p.n_rows - 1u);
        row = select(c, c + p.n_rows, r >= NR / 2u);
    } else {
        row = min(n0 + r, p.n_rows - 1u);
    }
    var acc: array<f32, TM>;
    for (var b = lid % LANES; b < p.k_blocks; b += LANES) {
        let blk = row * p.k_blocks + b;
        let s = wscale(blk);
        let c = wcodes(blk, s);
        let tm = wterms(s);
        for (var i = 0u; i < TM; i++) {
            let xb = min(t0 + i, m - 1u) * p.x_stride4 + b * 8u;
            let x0 = x[xb];
            let x1 = x[xb + 1u];
            let x2 = x[xb + 2u];
            let x3 = x[xb + 3u];
            let x4 = x[xb + 4u];
            let x5 = x[xb + 5u];
            let x6 = x[xb + 6u];
            let x7 = x[xb + 7u];
            let lo = dot(c[0], x0) + dot(c[1], x1) + dot(c[2], x2) + dot(c[3], x3);
            let hi = dot(c[4], x4) + dot(c[5], x5) + dot(c[6], x6) + dot(c[7], x7);
            var v = lo * tm.x + hi * tm.y;
            if (WMIN) {
                let one = vec4<f32>(1.0);
                v += dot(x0 + x1 + x2 + x3, one) * tm.z + dot(x4 + x5 + x6 + x7, one) * tm.w;
            }
            acc[i] += v;
        }
    }
    for (var i = 0u; i < TM; i++) {
        part[(i * NR + r) * LANES + lid % LANES] = acc[i];
    }
    workgroupBarrier();
    if (lid < NV) {
        var s = 0.0;
        for (var j = 0u; j < LANES; j++) {
            s += part[lid * LANES + j];
        }
        tot[lid] = s;
    }
    workgroupBarrier();
    if (SWIGLU) {
        let h = NR / 2u;
        if (lid < TM * h) {
            let i = lid / h;
            let c = lid % h;
            if (t0 + i < m && n0 + c < p.n_rows) {
                let gate = tot[i * NR + c];
                let up = tot[i * NR + c + h];
                y[(t0 + i) * p.y_stride + p.row0 + n0 + c] = glu(gate) * up;
            }
        }
    } else if (lid < NV) {
        let i = lid / NR;
        let rr = lid % NR;
        if (t0 + i < m && n0 + rr < p.n_rows) {
            store(t0 + i, n0 + rr, tot[lid]);
        }
    }
}
