//! Every family's bindings, by name and access, against the shaders as they are assembled: a
//! binding the shader declares must be the struct's field of that name and access, and every
//! field must be declared by one of the family's shaders (the KV cache's chunks are checked
//! by binding number).

use super::attention::{AttnBinds, ATTN_KV};
use super::matmul::{EmbedBinds, MatmulBinds};
use super::moe::MoeBinds;
use super::norm::{HeadNormBinds, NormBinds};
use super::rope::{RopeBinds, ROPE_KV};
use super::sample::{AdjustBinds, SampleBinds};
use super::sources::*;
use crate::gpu::family::Slot;
use crate::gpu::{KvDtype, WFormat};
use std::collections::BTreeMap;

/// binding -> (variable, access) of `@group(0) @binding(N) var<...> name:` lines.
fn declared(src: &str) -> BTreeMap<u32, (String, Slot)> {
    let mut out = BTreeMap::new();
    for line in src.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("@group(0) @binding(") else { continue };
        let (n, rest) = rest.split_once(')').unwrap();
        let rest = rest.trim().strip_prefix("var<").unwrap();
        let (access, rest) = rest.split_once('>').unwrap();
        let name = rest.trim().split(':').next().unwrap().trim().to_string();
        let slot = match access.replace(' ', "").as_str() {
            "uniform" => Slot::Uniform,
            "storage,read" => Slot::Read,
            "storage,read_write" => Slot::ReadWrite,
            other => panic!("unknown access {other} in {line}"),
        };
        out.insert(n.parse().unwrap(), (name, slot));
    }
    out
}

/// Checks `slots` against the family's shaders; `kv`: its first K and V cache bindings.
fn check(family: &str, slots: &[(u32, &str, Slot)], sources: &[String], kv: Option<(u32, u32)>) {
    let mut seen = vec![false; slots.len()];
    for src in sources {
        for (b, (name, slot)) in declared(src) {
            if name.starts_with("k_cache") || name.starts_with("v_cache") {
                let (k0, v0) = kv.unwrap_or_else(|| panic!("{family}: no KV cache expected, got {name}"));
                let first = if name.starts_with('k') { k0 } else { v0 };
                assert!(name.ends_with('0') == (b == first), "{family}: {name} at binding {b}");
                continue;
            }
            let i = slots
                .iter()
                .position(|s| s.0 == b)
                .unwrap_or_else(|| panic!("{family}: binding {b} ({name}) has no field"));
            assert_eq!((slots[i].1, slots[i].2), (name.as_str(), slot), "{family}: binding {b}");
            seen[i] = true;
        }
    }
    for (s, seen) in slots.iter().zip(seen) {
        assert!(seen || s.1 == "unused", "{family}: no shader declares {} (binding {})", s.1, s.0);
    }
}

#[test]
fn bindings_match_the_shaders() {
    for f in WFormat::ALL {
        let mut matmul = vec![super::gemm::matmul_tiled_source(f, true, 32, true).unwrap()];
        matmul.extend([1, 8].map(|tm| matmul_gpu_source(f, tm, false, true).unwrap()));
        matmul.push(matmul_source(f, 1, 4, false).unwrap());
        let shape = crate::gpu::coop::CoopShape { side: 16, f16: true, subgroup: 32 };
        matmul.push(matmul_coop_source(f, true, shape).unwrap());
        if f.has_int8() {
            matmul.push(matmul_gpu_i8_source(f, true, true).unwrap());
        }
        matmul.extend(crate::gpu::wformat::XQuant::ALL.map(|xq| quantize_x8_source(xq).unwrap()));
        check("matmul", MatmulBinds::SLOTS, &matmul, None);
        check("embed", EmbedBinds::SLOTS, &[embed_source(f).unwrap()], None);
        check("moe", MoeBinds::SLOTS, &[moe_source(f).unwrap(), moe_route_source().unwrap()], None);
        // The uniform-x variant: x is a uniform, plus the window entry.
        let ux = declared(&matmul_source(f, 1, 4, true).unwrap());
        assert_eq!(ux[&2], ("x".to_string(), Slot::Uniform));
        assert_eq!(ux[&7], ("win".to_string(), Slot::Uniform));
    }
    check("rmsnorm", NormBinds::SLOTS, &[rmsnorm_source().unwrap()], None);
    check("head_norm", HeadNormBinds::SLOTS, &[head_norm_source().unwrap()], None);
    check("delta", super::delta::DeltaBinds::SLOTS, &[delta_source(32, true).unwrap()], None);
    for kv in [KvDtype::F16, KvDtype::F32] {
        for chunks in [1, MAX_KV_CHUNKS] {
            check("rope_kv", RopeBinds::SLOTS, &[rope_kv_source(kv, chunks).unwrap()], Some(ROPE_KV));
            let attn = [
                attention_source(64, kv, chunks).unwrap(),
                attention_split_source(64, 4, kv, chunks, true).unwrap(),
                attention_tiled_source(64, 4, 3, kv, chunks, true).unwrap(),
            ];
            check("attention", AttnBinds::SLOTS, &attn, Some(ATTN_KV));
        }
    }
    check("logit_adjust", AdjustBinds::SLOTS, &[logit_adjust_source().unwrap()], None);
    check("sample", SampleBinds::SLOTS, &[sample_source().unwrap()], None);
    // The two sampler kernels share one layout.
    let access = |s: &[(u32, &str, Slot)]| s.iter().map(|x| (x.0, x.2)).collect::<Vec<_>>();
    assert_eq!(access(AdjustBinds::SLOTS), access(SampleBinds::SLOTS));
}

#[test]
fn a_misnamed_binding_is_caught() {
    let src = rmsnorm_source().unwrap().replace("var<storage, read> weight:", "var<storage, read> w:");
    let r = std::panic::catch_unwind(|| check("rmsnorm", NormBinds::SLOTS, &[src], None));
    assert!(r.is_err());
}
