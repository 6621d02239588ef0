//! Bind-group layouts and compute pipelines, wgpu only: a family of pipelines shares one
//! layout, so one bind group serves every variant.

use super::Gpu;
use anyhow::Result;

/// How a shader binds a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    Uniform,
    /// A uniform bound with a dynamic offset.
    UniformDyn,
    Read,
    ReadWrite,
}

pub fn layout(gpu: &Gpu, slots: &[(u32, Slot)]) -> wgpu::BindGroupLayout {
    let entries: Vec<wgpu::BindGroupLayoutEntry> = slots
        .iter()
        .map(|&(binding, s)| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: match s {
                Slot::Uniform | Slot::UniformDyn => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: matches!(s, Slot::UniformDyn),
                    min_binding_size: None,
                },
                Slot::Read | Slot::ReadWrite => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: matches!(s, Slot::Read) },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
            },
            count: None,
        })
        .collect();
    gpu.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: None, entries: &entries })
}

/// A buffer bound whole, or its first max-storage-binding bytes where it is larger (an
/// activation buffer's padding for uniform windows; its rows were sized to fit).
pub fn whole<'a>(gpu: &Gpu, buf: &'a wgpu::Buffer) -> wgpu::BindingResource<'a> {
    let cap = gpu.device.limits().max_storage_buffer_binding_size & !15;
    if buf.size() > cap && buf.usage().contains(wgpu::BufferUsages::STORAGE) {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: buf,
            offset: 0,
            size: std::num::NonZeroU64::new(cap),
        })
    } else {
        buf.as_entire_binding()
    }
}

/// The runtime checks wgpu's shader translation adds to every kernel (TORUS_SHADER_CHECKS).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShaderChecks {
    /// wgpu's default (`full`): every index clamped into its buffer, every loop bounded.
    Full,
    /// `loops`, the default: indices clamped, loops as written. Every loop in shaders/ counts
    /// up to a bound the host computed (or advances a cursor that ends at one), so the
    /// iteration counter naga adds to each only costs: 25-35% of the cpu profile's decode and
    /// prefill on lavapipe (BENCHMARKS.md, issue 48).
    Loops,
    /// `off`: neither (for measurements: an index out of range would read or write past its
    /// buffer).
    Off,
}

/// TORUS_SHADER_CHECKS (`loops`, the default; `full`; `off`), read once: what the checks cost
/// is measured by running the same benchmark under each (BENCHMARKS.md, issue 48). An unknown
/// value is `full`.
pub fn shader_checks() -> ShaderChecks {
    static CHECKS: std::sync::OnceLock<ShaderChecks> = std::sync::OnceLock::new();
    *CHECKS.get_or_init(|| match std::env::var("TORUS_SHADER_CHECKS").as_deref() {
        Err(_) | Ok("" | "loops") => ShaderChecks::Loops,
        Ok("off") => ShaderChecks::Off,
        Ok(_) => ShaderChecks::Full,
    })
}

/// `TORUS_PRINT_PIPELINES=1`: every pipeline's label is written to stderr just before the
/// driver builds it, so that what the driver prints while compiling it (RADV_DEBUG=shaderstats,
/// scripts/gpu-compiler-report.sh) can be told apart by kernel. Pipelines are built one at a
/// time.
fn print_pipelines() -> bool {
    static PRINT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PRINT.get_or_init(|| std::env::var("TORUS_PRINT_PIPELINES").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// A pipeline family sharing one bind group layout, so one bind group serves every variant.
pub struct Family {
    pub layout: wgpu::BindGroupLayout,
    pipeline_layout: wgpu::PipelineLayout,
}

impl Family {
    pub fn new(gpu: &Gpu, slots: &[(u32, Slot)]) -> Family {
        let layout = layout(gpu, slots);
        let pipeline_layout = gpu.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: None,
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        Family { layout, pipeline_layout }
    }

    pub fn pipeline(&self, gpu: &Gpu, label: &str, source: &str, entry: &str) -> Result<wgpu::ComputePipeline> {
        super::validate_wgsl(label, source)?;
        let desc = wgpu::ShaderModuleDescriptor { label: Some(label), source: wgpu::ShaderSource::Wgsl(source.into()) };
        let module = match shader_checks() {
            ShaderChecks::Full => gpu.device.create_shader_module(desc),
            // SAFETY: `loops` (the default) keeps every index clamped into its buffer and drops
            // only the bound on loop iterations (every kernel loop counts to a bound the host
            // computed); `off` (only on request, for measurements) drops both, and is right
            // only while every index a kernel computes is in range.
            ShaderChecks::Loops => unsafe {
                let checks =
                    wgpu::ShaderRuntimeChecks { force_loop_bounding: false, ..wgpu::ShaderRuntimeChecks::checked() };
                gpu.device.create_shader_module_trusted(desc, checks)
            },
            ShaderChecks::Off => unsafe {
                gpu.device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            },
        };
        if print_pipelines() {
            eprintln!("torus-wgpu pipeline: {label}");
        }
        Ok(gpu.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: Some(&self.pipeline_layout),
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: gpu.pipeline_cache.as_ref(),
        }))
    }

    /// Like `bind`, with some entries bound as windows placed by dynamic offsets: an entry
    /// whose binding is in `windows` binds its buffer's first `bytes`, and each `extra` entry
    /// (binding, buffer, bytes) is added as such a window.
    pub fn bind_windows(
        &self,
        gpu: &Gpu,
        entries: &[(u32, &wgpu::Buffer)],
        windows: &[(u32, u64)],
        extra: &[(u32, &wgpu::Buffer, u64)],
    ) -> wgpu::BindGroup {
        let window = |buffer, bytes| {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer,
                offset: 0,
                size: std::num::NonZeroU64::new(bytes),
            })
        };
        let entries: Vec<wgpu::BindGroupEntry> = entries
            .iter()
            .map(|&(b, buf)| wgpu::BindGroupEntry {
                binding: b,
                resource: match windows.iter().find(|w| w.0 == b) {
                    Some(&(_, bytes)) => window(buf, bytes),
                    None => whole(gpu, buf),
                },
            })
            .chain(
                extra.iter().map(|&(b, buf, bytes)| wgpu::BindGroupEntry { binding: b, resource: window(buf, bytes) }),
            )
            .collect();
        gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &self.layout,
            entries: &entries,
        })
    }

    pub fn bind(&self, gpu: &Gpu, entries: &[(u32, &wgpu::Buffer)]) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> =
            entries.iter().map(|(b, buf)| wgpu::BindGroupEntry { binding: *b, resource: whole(gpu, buf) }).collect();
        gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &self.layout,
            entries: &entries,
        })
    }
}
