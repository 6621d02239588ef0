// GPU profile paged attention for prefill-sized steps, tiled over queries and keys (flash-attention
// style). One workgroup per (tile of QT consecutive tokens of the step, KV head): its rows are the
// tile's tokens times the GQ query heads sharing the KV head, so every K/V row of a key tile is
// loaded once for all of them (the split kernel shares it among GQ rows only). The tile's tokens
// are walked in segments of one sequence (tokens of a sequence are adjacent in a step, so a tile
// has one segment or a few); a segment's key range is the union of its tokens' causal ranges
// (within the sliding window), walked in tiles of KT keys: invocation j scores key j against every
// row (masked where the key is outside that row's range), the tile's softmax statistics update
// per row (the SOFTMAX snippet of sources.rs, over G = rows), then the invocations, one per (row,
// dim vec4), accumulate the tile's values. No key splits: prefill steps have workgroups enough.
// HD4, KT, GQ, QT and the KV snippet (load_k / load_v) are substituted when the pipeline is built.

// AttnParams (src/gpu/shared.rs) is prepended.

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: AttnParams;
@group(0) @binding(2) var<storage, read> md: array<u32>;
@group(0) @binding(3) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> out: array<vec4<f32>>;

const HD4: u32 = {{HD4}}u;
// Query heads per KV head, tokens per tile.
const GQ: u32 = {{GQ}}u;
const QT: u32 = {{QT}}u;
// Rows (token, query head) of a workgroup: the name the SOFTMAX snippet uses.
const G: u32 = QT * GQ;
const KT: u32 = {{KT}}u;
const WG: u32 = 64u;
// (row, dim vec4) accumulators per invocation.
const NA: u32 = (G * HD4 + WG - 1u) / WG;
const MASKED: f32 = -3.0e38;

var<workgroup> qs: array<vec4<f32>, G * HD4>;
var<workgroup> kbase: array<u32, KT>;
// The segment's tokens: first attended key and position.
var<workgroup> tfirst: array<u32, QT>;
var<workgroup> tpos: array<u32, QT>;
// The tile softmax's state (sc, mstat, lstat, corr) and reductions.
{{SOFTMAX_DECL}}

{{KV}}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
    let g = wid.x + wid.y * nwg.x;
    let kvh = g % p.n_kv_heads;
    let t0 = (g / p.n_kv_heads) * QT;
    if (t0 >= step.n_tokens) {
        return;
    }
    let t_end = min(t0 + QT, step.n_tokens);
    var s0 = t0;
    // Segments of one sequence; every value here is the same in all invocations.
    loop {
        if (s0 >= t_end) {
            break;
        }
        let seq = md[step.off_seq + s0];
        var s1 = s0 + 1u;
        while (s1 < t_end && md[step.off_seq + s1] == seq) {
            s1++;
        }
        let table = step.off_table + seq * step.max_blocks;
        var lo = 0xffffffffu;
        var ke = 0u;
        for (var t = s0; t < s1; t++) {
            let pos = md[step.off_pos + t];
            let j0 = select(0u, pos + 1u - p.window, p.window > 0u && pos + 1u > p.window);
            lo = min(lo, j0);
            ke = max(ke, pos + 1u);
            if (lid == t - s0) {
                tfirst[lid] = j0;
                tpos[lid] = pos;
            }
        }
        let nrow = (s1 - s0) * GQ;
        for (var i = lid; i < G * HD4; i += WG) {
            let r = i / HD4;
            var q = vec4<f32>(0.0);
            if (r < nrow) {
                let h = kvh * GQ + r % GQ;
                q = qkv[(s0 + r / GQ) * p.qkv_stride4 + h * HD4 + i % HD4] * p.scale;
            }
            qs[i] = q;
        }
        for (var r = lid; r < G; r += WG) {
            mstat[r] = MASKED;
            lstat[r] = 0.0;
        }
        var acc: array<vec4<f32>, NA>;
        workgroupBarrier();
        for (var tile = lo; tile < ke; tile += KT) {
            let j = tile + lid;
            // This invocation's key's score against each row (MASKED outside the row's range).
            var sh: array<f32, G>;
            for (var r = 0u; r < G; r++) {
                sh[r] = MASKED;
            }
            if (j < ke) {
                let blk = md[table + j / p.block_size];
                let kb = ((blk * p.block_size + j % p.block_size) * p.n_kv_heads + kvh) * HD4;
                kbase[lid] = kb;
                var s: array<vec4<f32>, G>;
                for (var d = 0u; d < HD4; d++) {
                    let k = load_k(kb + d);
                    for (var r = 0u; r < G; r++) {
                        s[r] += qs[r * HD4 + d] * k;
                    }
                }
                for (var r = 0u; r < nrow; r++) {
                    let tt = r / GQ;
                    if (j >= tfirst[tt] && j <= tpos[tt]) {
                        sh[r] = capped(s[r].x + s[r].y + s[r].z + s[r].w);
                    }
                }
            }
            // sc[r * KT + i] = exp(score - new max) of the tile's keys (0 where masked); corr,
            // lstat, mstat updated.
{{SOFTMAX}}
            let n = min(KT, ke - tile);
            for (var a = 0u; a < NA; a++) {
                let i = lid + a * WG;
                if (i < G * HD4) {
                    let r = i / HD4;
                    let d = i % HD4;
                    var v = acc[a] * corr[r];
                    for (var jj = 0u; jj < n; jj++) {
                        v += sc[r * KT + jj] * load_v(kbase[jj] + d);
                    }
                    acc[a] = v;
                }
            }
            workgroupBarrier();
        }
        for (var a = 0u; a < NA; a++) {
            let i = lid + a * WG;
            let r = i / HD4;
            if (i < G * HD4 && r < nrow) {
                let h = kvh * GQ + r % GQ;
                out[((s0 + r / GQ) * p.n_heads + h) * HD4 + i % HD4] = acc[a] * normaliser(h, mstat[r], lstat[r]);
            }
        }
        // The next segment reuses the workgroup's arrays.
        workgroupBarrier();
        s0 = s1;
    }
}
