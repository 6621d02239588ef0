// GGUF Q8_0: 32 signed bytes (2 vec4 words) and one scale per block; x = q * d.
@group(0) @binding(3) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> ws: array<f32>;

fn sbytes(v: u32) -> vec4<f32> {
    let s = bitcast<vec4<i32>>(vec4<u32>(v << 24u, v << 16u, v << 8u, v)) >> vec4<u32>(24u);
    return vec4<f32>(s);
}

fn wdeq(blk: u32, w: ptr<function, array<vec4<f32>, 8>>) {
    let d = ws[blk];
    let a = wq[2u * blk];
    let b = wq[2u * blk + 1u];
    (*w)[0] = sbytes(a.x) * d;
    (*w)[1] = sbytes(a.y) * d;
    (*w)[2] = sbytes(a.z) * d;
    (*w)[3] = sbytes(a.w) * d;
    (*w)[4] = sbytes(b.x) * d;
    (*w)[5] = sbytes(b.y) * d;
    (*w)[6] = sbytes(b.z) * d;
    (*w)[7] = sbytes(b.w) * d;
}
