// GPU profile paged attention, split over keys (flash-decoding). One workgroup per (token, KV
// head, split): the G query heads sharing the KV head are handled together, so every K/V row is
// loaded once for all of them. The token's keys (causal, within the sliding window) are cut into
// step.n_splits equal ranges; each workgroup walks its range in tiles of KT keys: invocation j
// scores key j against the G heads, the tile's softmax statistics update per head, then the
// invocations, one per (head, dim vec4), accumulate the tile's values (consecutive invocations
// read consecutive V words). The tile's softmax statistics (the max and the sum of exponentials
// per head) are workgroup reductions: subgroupMax/subgroupAdd and one value per subgroup where
// the adapter has subgroups, else G invocations each walk their head's scores (the SOFTMAX
// snippet of sources.rs). With one split the output is written directly; with several, each
// writes (unnormalised acc, max, sum) to `part` and `combine` merges them.
// HD4, KT, G and the KV snippet (load_k / load_v) are substituted when the pipeline is built.

// AttnParams (src/gpu/shared.rs) is prepended.

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: AttnParams;
@group(0) @binding(2) var<storage, read> md: array<u32>;
@group(0) @binding(3) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> out: array<vec4<f32>>;
// Per (token, head, split): HD4 vec4s of acc, then vec4(max, sum, 0, 0).
@group(0) @binding(7) var<storage, read_write> part: array<vec4<f32>>;

const HD4: u32 = {{HD4}}u;
const G: u32 = {{G}}u;
const KT: u32 = {{KT}}u;
const WG: u32 = 64u;
// (head, dim vec4) accumulators per invocation.
const NA: u32 = (G * HD4 + WG - 1u) / WG;

var<workgroup> qs: array<vec4<f32>, G * HD4>;
var<workgroup> kbase: array<u32, KT>;
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
    let ns = step.n_splits;
    let sp = g % ns;
    let kvh = (g / ns) % p.n_kv_heads;
    let t = g / (ns * p.n_kv_heads);
    if (t >= step.n_tokens) {
        return;
    }
    let pos = md[step.off_pos + t];
    let table = step.off_table + md[step.off_seq + t] * step.max_blocks;
    let j0 = select(0u, pos + 1u - p.window, p.window > 0u && pos + 1u > p.window);
    let len = pos + 1u - j0;
    let chunk = (len + ns - 1u) / ns;
    let ks = min(j0 + sp * chunk, pos + 1u);
    let ke = min(ks + chunk, pos + 1u);
    for (var i = lid; i < G * HD4; i += WG) {
        let h = kvh * G + i / HD4;
        qs[i] = qkv[t * p.qkv_stride4 + h * HD4 + i % HD4] * p.scale;
    }
    if (lid < G) {
        mstat[lid] = -3.0e38;
        lstat[lid] = 0.0;
    }
    var acc: array<vec4<f32>, NA>;
    workgroupBarrier();
    for (var tile = ks; tile < ke; tile += KT) {
        let j = tile + lid;
        // This invocation's key's score against each head (-3e38 past the range).
        var sh: array<f32, G>;
        if (j < ke) {
            let blk = md[table + j / p.block_size];
            let kb = ((blk * p.block_size + j % p.block_size) * p.n_kv_heads + kvh) * HD4;
            kbase[lid] = kb;
            var s: array<vec4<f32>, G>;
            for (var d = 0u; d < HD4; d++) {
                let k = load_k(kb + d);
                for (var h = 0u; h < G; h++) {
                    s[h] += qs[h * HD4 + d] * k;
                }
            }
            for (var h = 0u; h < G; h++) {
                sh[h] = capped(s[h].x + s[h].y + s[h].z + s[h].w);
            }
        } else {
            for (var h = 0u; h < G; h++) {
                sh[h] = -3.0e38;
            }
        }
        // sc[h * KT + i] = exp(score - new max) of the tile's keys; corr, lstat, mstat updated.
{{SOFTMAX}}
        let n = min(KT, ke - tile);
        for (var a = 0u; a < NA; a++) {
            let i = lid + a * WG;
            if (i < G * HD4) {
                let h = i / HD4;
                let d = i % HD4;
                var v = acc[a] * corr[h];
                for (var jj = 0u; jj < n; jj++) {
                    v += sc[h * KT + jj] * load_v(kbase[jj] + d);
                }
                acc[a] = v;
            }
        }
        workgroupBarrier();
    }
    for (var a = 0u; a < NA; a++) {
        let i = lid + a * WG;
        if (i < G * HD4) {
            let h = kvh * G + i / HD4;
            let d = i % HD4;
            let hl = i / HD4;
            if (ns == 1u) {
                out[(t * p.n_heads + h) * HD4 + d] = acc[a] * normaliser(h, mstat[hl], lstat[hl]);
            } else {
                let rec = ((t * p.n_heads + h) * ns + sp) * (HD4 + 1u);
                part[rec + d] = acc[a];
                if (d == 0u) {
                    part[rec + HD4] = vec4<f32>(mstat[hl], lstat[hl], 0.0, 0.0);
                }
            }
        }
    }
}

// Merges the splits of each (token, head): one invocation per output vec4.
@compute @workgroup_size(64)
fn combine(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = gid.x + gid.y * nwg.x * 64u;
    let d = id % HD4;
    let th = id / HD4; // token * n_heads + head
    if (th >= step.n_tokens * p.n_heads) {
        return;
    }
    let ns = step.n_splits;
    let base = th * ns * (HD4 + 1u);
    var mx = -3.0e38;
    for (var s = 0u; s < ns; s++) {
        mx = max(mx, part[base + s * (HD4 + 1u) + HD4].x);
    }
    var num = vec4<f32>(0.0);
    var den = 0.0;
    for (var s = 0u; s < ns; s++) {
        let rec = base + s * (HD4 + 1u);
        let st = part[rec + HD4];
        let w = select(exp(st.x - mx), 0.0, st.y == 0.0);
        num += part[rec + d] * w;
        den += st.y * w;
    }
    out[th * HD4 + d] = num * normaliser(th % p.n_heads, mx, den);
}
