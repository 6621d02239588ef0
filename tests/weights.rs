//! One layer-loading loop over two weight sources: the tiny Llama 3 of tests/fixtures as a
//! Hugging Face directory and as llama.cpp's GGUF (same weights, all F32; the GGUF's q/k rows
//! permuted for interleaved RoPE) load to the same shapes, formats and values.

use std::path::Path;
use torus_wgpu::model::loader::HostModel;
use torus_wgpu::weights::tensor::QTensor;

fn fixtures() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures"))
}

fn same_matrix(what: &str, a: &QTensor, b: &QTensor) {
    assert_eq!((a.rows, a.cols, a.format), (b.rows, b.cols, b.format), "{what}: shape and format");
    for r in 0..a.rows {
        assert_eq!(a.dequant_row(r), b.dequant_row(r), "{what}: row {r}");
    }
}

#[test]
fn hf_and_gguf_tiny_llama3_load_the_same() {
    let hf = HostModel::load(&fixtures().join("tiny-llama3"), &|_, _| {}).expect("the HF directory loads");
    let gguf = HostModel::load(&fixtures().join("tiny-llama3.gguf"), &|_, _| {}).expect("the GGUF loads");
    let (c1, c2) = (&hf.cfg, &gguf.cfg);
    assert_eq!(
        (c1.layers, c1.hidden, c1.heads, c1.kv_heads, c1.head_dim, c1.intermediate, c1.vocab),
        (c2.layers, c2.hidden, c2.heads, c2.kv_heads, c2.head_dim, c2.intermediate, c2.vocab)
    );
    assert_eq!(hf.layers.len(), c1.layers);
    assert_eq!((hf.tied, gguf.tied), (false, false), "untied: both load lm_head");
    same_matrix("embed", hf.embed.as_ref().unwrap(), gguf.embed.as_ref().unwrap());
    same_matrix("lm_head", hf.lm_head().unwrap(), gguf.lm_head().unwrap());
    assert_eq!(hf.final_norm, gguf.final_norm);
    for (l, (a, b)) in hf.layers.iter().zip(&gguf.layers).enumerate() {
        // q and k come back in Hugging Face row order.
        for (name, x, y) in [
            ("q", &a.q, &b.q),
            ("k", &a.k, &b.k),
            ("v", &a.v, &b.v),
            ("o", &a.o, &b.o),
            ("gate", &a.gate, &b.gate),
            ("up", &a.up, &b.up),
            ("down", &a.down, &b.down),
        ] {
            same_matrix(&format!("layer {l} {name}"), x, y);
        }
        assert_eq!(a.attn_norm, b.attn_norm, "layer {l} attn_norm");
        assert_eq!(a.ffn_norm, b.ffn_norm, "layer {l} ffn_norm");
        assert_eq!((a.qkv_bias.is_some(), a.qk_norm.is_some()), (false, false));
        assert_eq!((b.qkv_bias.is_some(), b.qk_norm.is_some()), (false, false));
    }
    assert_eq!(hf.formats(), gguf.formats());
}
