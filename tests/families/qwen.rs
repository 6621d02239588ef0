//! Qwen2, Qwen3 and their mixtures of experts (model/families/qwen.rs): the tiny models of
//! scripts/fixtures/gen_tiny_models.py and gen_tiny_moe.py against transformers' float32
//! references: YaRN (Qwen2), Qwen3's per-head q/k norms from the HF directory and llama.cpp's
//! layout; Qwen3-MoE and Qwen2-MoE (with its gated shared expert; a dense layer between two
//! sparse ones) from their directories and GGUF conversions, in both kernel profiles and split
//! over 2 pipeline stages, and the engine's properties on them: a prompt alone and inside a busy
//! batch gives the same greedy tokens, prefix cache on == off, preemption.

use crate::common::tiny::{self, local, reference};
use torus_wgpu::config::KernelProfile;
use torus_wgpu::gpu::Gpu;
use torus_wgpu::model::config::{Arch, RopeScaling};
use torus_wgpu::model::loader::read_config;

#[test]
fn yarn_rope_scaling() {
    let cfg = read_config(&local("tiny-yarn")).unwrap();
    let RopeScaling::Yarn { attention_factor, .. } = cfg.rope_scaling else { panic!("{:?}", cfg.rope_scaling) };
    let r = reference("tiny-yarn-reference.json");
    let want = r["rope"]["attention_scaling"].as_f64().unwrap();
    assert!((attention_factor - want).abs() < 1e-6, "attention factor {attention_factor} vs {want}");
    tiny::assert_matches_reference("tiny-yarn", &r, KernelProfile::Cpu);
}

#[test]
fn qwen3_qk_norm() {
    let cfg = read_config(&local("tiny-qwen3")).unwrap();
    assert!(cfg.qk_norm && cfg.arch == Arch::Qwen3 && cfg.head_dim * cfg.heads != cfg.hidden);
    let r = reference("tiny-qwen3-reference.json");
    tiny::assert_matches_reference("tiny-qwen3", &r, KernelProfile::Cpu);
    // llama.cpp's form (arch qwen3: attn_q_norm / attn_k_norm, rows not permuted, tied head).
    let g = read_config(&local("tiny-qwen3.gguf")).unwrap();
    assert!(g.qk_norm && g.arch == Arch::Qwen3 && g.head_dim == cfg.head_dim);
    tiny::assert_matches_reference("tiny-qwen3.gguf", &r, KernelProfile::Cpu);
    // Every 1-D grid (the head norm's included) folded into 2-D at 2 workgroups per dimension.
    let mut gpu = Gpu::new(None).unwrap();
    gpu.max_grid = 2;
    tiny::assert_matches_reference_on(gpu, "tiny-qwen3", &r, KernelProfile::Cpu);
}

#[test]
fn qwen3_moe_config_from_hf_and_gguf() {
    for f in ["tiny-qwen3moe", "tiny-qwen3moe.gguf"] {
        let c = read_config(&local(f)).unwrap();
        assert_eq!(c.arch, Arch::Qwen3Moe, "{f}");
        assert!(c.qk_norm, "{f}");
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_topk), (8, 2, 32, true), "{f}");
        assert_eq!(m.sparse_layers, [true, false, true], "{f}");
        assert_eq!(c.act_width(), 128, "{f}");
    }
    // The GGUF holds what the reference says it holds.
    let r = reference("tiny-qwen3moe-reference.json");
    let len = std::fs::metadata(local("tiny-qwen3moe.gguf")).unwrap().len();
    assert_eq!(len, r["gguf"]["size"].as_u64().unwrap());
}

#[test]
fn qwen2_moe_config_from_hf_and_gguf() {
    for f in ["tiny-qwen2moe", "tiny-qwen2moe.gguf"] {
        let c = read_config(&local(f)).unwrap_or_else(|e| panic!("{f}: {e:#}"));
        assert_eq!(c.arch, Arch::Qwen2Moe, "{f}");
        assert!(c.qkv_bias && !c.qk_norm, "{f}");
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.experts, m.top_k, m.ffn, m.norm_topk, m.shared_ffn), (8, 2, 32, false, 64), "{f}");
        assert_eq!(m.sparse_layers, [true, false, true], "{f}");
    }
}

/// Every prompt's last-position logits within 1e-3 of transformers and its 20 greedy tokens, from
/// the HF directory and the GGUF, in both kernel profiles.
#[test]
fn qwen3_moe_matches_transformers() {
    let r = reference("tiny-qwen3moe-reference.json");
    for f in ["tiny-qwen3moe", "tiny-qwen3moe.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
}

/// Newer llama.cpp converters write an MoE layer's gate and up experts fused
/// (`ffn_gate_up_exps`: per expert its gate rows, then its up rows); the one expert loader reads
/// either layout into the same matrices: the Qwen3-MoE GGUF rewritten fused meets the same
/// transformers reference, and its logits are bit-identical to the file's with them apart.
#[test]
fn qwen3_moe_gguf_with_fused_gate_up_experts() {
    use std::io::Write;
    use torus_wgpu::formats::gguf::GgufFile;
    use torus_wgpu::formats::gguf_write::{encode_header, GgufTensorSpec};
    let src = GgufFile::open(&local("tiny-qwen3moe.gguf")).unwrap();
    // Each tensor's data, the gate/up pairs fused in the gate's place.
    let mut tensors: Vec<(GgufTensorSpec, Vec<u8>)> = Vec::new();
    let mut fused = 0;
    for t in &src.tensors {
        let spec = GgufTensorSpec { name: t.name.clone(), dims: t.dims.clone(), ggml_type: t.ggml_type };
        if t.name.ends_with("ffn_up_exps.weight") {
            continue;
        }
        let Some(layer) = t.name.strip_suffix("ffn_gate_exps.weight") else {
            tensors.push((spec, src.tensor_data(t).to_vec()));
            continue;
        };
        let up = src.tensor(&format!("{layer}ffn_up_exps.weight")).unwrap();
        assert_eq!(up.dims, t.dims);
        let (gate, up) = (src.tensor_data(t), src.tensor_data(up));
        let experts = t.dims[2] as usize;
        let per = gate.len() / experts;
        let data: Vec<u8> = (0..experts)
            .flat_map(|x| [&gate[x * per..(x + 1) * per], &up[x * per..(x + 1) * per]])
            .flatten()
            .copied()
            .collect();
        let dims = vec![t.dims[0], 2 * t.dims[1], t.dims[2]];
        tensors.push((
            GgufTensorSpec { name: format!("{layer}ffn_gate_up_exps.weight"), dims, ggml_type: t.ggml_type },
            data,
        ));
        fused += 1;
    }
    assert!(fused >= 2, "the fixture has {fused} MoE layers");
    let meta: Vec<_> = src
        .metadata
        .iter()
        .filter(|(k, _)| k.as_str() != "general.alignment")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let specs: Vec<GgufTensorSpec> = tensors.iter().map(|(s, _)| s.clone()).collect();
    let h = encode_header(&meta, &specs).unwrap();
    let path = std::env::temp_dir().join(format!("torus-fused-experts-{}.gguf", std::process::id()));
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    f.write_all(&h.bytes).unwrap();
    let mut at = 0u64;
    for ((_, data), &off) in tensors.iter().zip(&h.offsets) {
        f.write_all(&vec![0u8; (off - at) as usize]).unwrap();
        f.write_all(data).unwrap();
        at = off + data.len() as u64;
    }
    drop(f);
    let r = reference("tiny-qwen3moe-reference.json");
    let p = path.to_str().unwrap();
    tiny::assert_matches_reference(p, &r, KernelProfile::Cpu);
    let input = crate::common::ids(&r["prompts"][0]["input_ids"]);
    let logits = |file: &std::path::Path| {
        let gpu = std::sync::Arc::new(Gpu::new(None).unwrap());
        let (mut m, _) = torus_wgpu::engine::load_model(file, &tiny::cfg(KernelProfile::Cpu), gpu, &|_, _| {}).unwrap();
        crate::common::logits_steps(&mut m, &input, &[1, 2])
    };
    assert!(logits(&path) == logits(&local("tiny-qwen3moe.gguf")), "fused and apart experts give different logits");
    std::fs::remove_file(&path).unwrap();
}

/// The shared expert (its gate/up, the sigmoid of its gate, its down projection added beside
/// the routed experts'), from the HF directory and the GGUF, in both kernel profiles.
#[test]
fn qwen2_moe_matches_transformers() {
    let r = reference("tiny-qwen2moe-reference.json");
    for f in ["tiny-qwen2moe", "tiny-qwen2moe.gguf"] {
        for profile in [KernelProfile::Cpu, KernelProfile::Gpu] {
            tiny::assert_matches_reference(f, &r, profile);
        }
    }
    tiny::assert_stages_match_reference("tiny-qwen2moe.gguf", &r, &[(0, 2), (2, 3)]);
}

/// Two in-process pipeline stages (a sparse layer, then the dense and the other sparse one): the
/// last-position logits of every prompt within 1e-3 of transformers.
#[test]
fn qwen3_moe_in_two_pipeline_stages() {
    tiny::assert_stages_match_reference(
        "tiny-qwen3moe.gguf",
        &reference("tiny-qwen3moe-reference.json"),
        &[(0, 1), (1, 3)],
    );
}

/// Batching invariance and prefix cache on == off: the experts a token is routed to do not
/// depend on the other tokens of its step.
#[test]
fn qwen3_moe_batched_equals_alone_and_prefix_cache_on_equals_off() {
    tiny::assert_batched_equals_alone_and_prefix_cache_on_equals_off("tiny-qwen3moe");
}

#[test]
fn qwen3_moe_preemption() {
    // One 16-token block of K+V over 3 layers: 3 * 2 * 16 * 32 * 2 bytes (f16) = 6 KiB.
    tiny::assert_preemption_keeps_outputs("tiny-qwen3moe", 12, 6144);
}
