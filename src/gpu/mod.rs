//! wgpu device and adapter choice, buffers, shader assembly and the pipelines of every kernel.
//!
//! Owns: the wgpu device, limits, error scopes and faults, buffers, bind-group families and pipelines, the shader builder, timestamp queries, the Rust<->WGSL struct macro and the weight formats' snippets.
//! May use: config, sampling.
//! Never uses: ops, model, engine, server.

pub mod coop;
pub mod counters;
pub mod family;
pub mod shader;
pub mod shared;
mod staging;
pub mod timing;
pub mod tune_cache;
pub mod wformat;

pub use crate::config::{KernelProfile, KvDtype};

/// vec4s of the activation window a uniform-x matmul reads (64 KiB, the usual uniform limit).
pub const UNIFORM_X_VEC4: u32 = 4096;
/// Most buffers one layer's K (or V) cache may span.
pub const MAX_KV_CHUNKS: usize = 4;
pub const UNIFORM_X_BYTES: u64 = UNIFORM_X_VEC4 as u64 * 16;
pub use wformat::WFormat;

use anyhow::{anyhow, Context, Result};
use wgpu::util::DeviceExt;

/// llvmpipe's limit on the loop iterations of one shader invocation, all loops together (Mesa's
/// LP_MAX_TGSI_LOOP_ITERATIONS): past it every loop ends at its next test.
pub const LLVMPIPE_LOOP_LIMIT: usize = 65535;

/// One wgpu device with the limits and facts the kernels are sized by.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    /// Largest storage binding the kernels may use (bytes); tensors larger than this are chunked.
    pub max_binding: u64,
    /// Device-local memory, where the backend tells it (Vulkan); pipeline splits use it.
    pub memory: Option<u64>,
    /// Memory the model's allocations are checked against before loading: the device-local
    /// memory of a GPU; None for CPU adapters (llvmpipe's reported heap is host memory it does
    /// not bound) and where unknown.
    pub memory_limit: Option<u64>,
    /// The driver's pipeline cache, kept on disk (see `pipeline_cache_path`), where the adapter
    /// supports it: a restart skips shader compilation.
    pub pipeline_cache: Option<wgpu::PipelineCache>,
    pipeline_cache_path: Option<std::path::PathBuf>,
    /// Largest workgroup count per grid dimension the dispatches use (the device's
    /// max_compute_workgroups_per_dimension; tests lower it to exercise folding).
    pub max_grid: u32,
    /// Whether the device was opened with subgroup operations (the gpu profile's matmuls reduce
    /// with subgroupAdd then; tests turn it off to check the workgroup-memory reduction).
    pub subgroups: bool,
    /// Whether the device was opened with shader-f16 (the GEMM's f16 tile variants).
    pub f16: bool,
    /// The cooperative-matrix shape the GEMMs are built for, where something wants them and the
    /// adapter has one (see `coop`); None by default.
    pub coop: Option<coop::CoopShape>,
    /// How kernels can be timed on this device (the per-kernel profile).
    pub timestamps: timing::TimestampMode,
    /// What the device-lost and uncaptured-error handlers saw.
    pub faults: std::sync::Arc<GpuFaults>,
    /// Submits, passes, dispatches, readbacks and the host time around them (bench-model).
    pub counters: counters::StepCounters,
    /// Bytes given to buffers created with contents since their staging copies were last
    /// released (see staging.rs).
    staged_bytes: std::sync::atomic::AtomicU64,
}

/// A GPU failure of one step (`Error`) or of the whole device (`Lost`): the engine fails the
/// step's requests for the first, and stops serving (health 503) for the second.
#[derive(Debug, thiserror::Error)]
pub enum GpuFault {
    #[error("the GPU device was lost: {0}")]
    Lost(String),
    #[error("GPU error: {0}")]
    Error(String),
}

/// Filled by the handlers wgpu calls from any thread: the device-lost callback and the
/// handler for errors raised outside an error scope.
#[derive(Debug, Default)]
pub struct GpuFaults {
    lost: std::sync::Mutex<Option<String>>,
    uncaptured: std::sync::Mutex<Vec<String>>,
}

impl GpuFaults {
    /// Why the device was lost, once it was.
    pub fn lost(&self) -> Option<String> {
        self.lost.lock().map(|g| g.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    fn set_lost(&self, why: String) {
        let mut g = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        g.get_or_insert(why);
    }

    /// Errors raised outside any error scope since the last call (at most 16 kept).
    pub fn take_uncaptured(&self) -> Vec<String> {
        std::mem::take(&mut *self.uncaptured.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn push_uncaptured(&self, e: String) {
        let mut g = self.uncaptured.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() < 16 {
            g.push(e);
        }
    }
}

/// What `torus-wgpu adapters` prints for each adapter.
pub struct AdapterReport {
    pub index: usize,
    pub info: wgpu::AdapterInfo,
    pub features: wgpu::Features,
    pub limits: wgpu::Limits,
    pub memory: Option<u64>,
}

/// Where the pipeline cache of this adapter lives: `$TORUS_PIPELINE_CACHE_DIR` (`off` disables
/// it), else `$XDG_CACHE_HOME/torus-wgpu/pipelines` or `~/.cache/torus-wgpu/pipelines`, one file
/// per wgpu cache key (backend, vendor and device).
fn pipeline_cache_path(info: &wgpu::AdapterInfo) -> Option<std::path::PathBuf> {
    let key = wgpu::util::pipeline_cache_key(info)?;
    let dir = match std::env::var_os("TORUS_PIPELINE_CACHE_DIR") {
        Some(d) if d == "off" => return None,
        Some(d) => std::path::PathBuf::from(d),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(std::path::PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))?
            .join("torus-wgpu/pipelines"),
    };
    Some(dir.join(format!("{key}.bin")))
}

/// The largest device-local memory heap of a Vulkan adapter (wgpu itself does not report
/// adapter memory); None on other backends.
#[cfg(not(any(target_vendor = "apple", target_arch = "wasm32")))]
fn adapter_memory(adapter: &wgpu::Adapter) -> Option<u64> {
    // SAFETY: the hal adapter is only read (its physical device's memory properties), and the
    // guard is dropped before this function returns.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let instance = hal.shared_instance().raw_instance();
    // SAFETY: the physical device belongs to this live instance.
    let props = unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
    let heaps = &props.memory_heaps[..props.memory_heap_count as usize];
    heaps.iter().filter(|h| h.flags.contains(ash::vk::MemoryHeapFlags::DEVICE_LOCAL)).map(|h| h.size).max()
}

#[cfg(any(target_vendor = "apple", target_arch = "wasm32"))]
fn adapter_memory(_adapter: &wgpu::Adapter) -> Option<u64> {
    None
}

fn instance() -> wgpu::Instance {
    // Mesa complains on stderr when XDG_RUNTIME_DIR is unset; point it at a private temp dir.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        let dir = std::env::temp_dir().join(format!("torus-wgpu-xdg-{}", std::process::id()));
        if std::fs::create_dir_all(&dir).is_ok() {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
            }
            // SAFETY: called before any other thread of ours reads the environment.
            unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
        }
    }
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    desc.backends = wgpu::Backends::PRIMARY;
    wgpu::Instance::new(desc)
}

pub fn list_adapters() -> Vec<AdapterReport> {
    let inst = instance();
    let adapters = pollster::block_on(inst.enumerate_adapters(wgpu::Backends::PRIMARY));
    adapters
        .into_iter()
        .enumerate()
        .map(|(index, a)| AdapterReport {
            index,
            info: a.get_info(),
            features: a.features(),
            limits: a.limits(),
            memory: adapter_memory(&a),
        })
        .collect()
}

fn no_adapter() -> anyhow::Error {
    anyhow!(
        "no usable GPU adapter found (Vulkan, Metal or DX12); on Linux without a GPU, install \
         mesa-vulkan-drivers for software Vulkan (lavapipe)"
    )
}

impl Gpu {
    /// Opens a device on the adapter named by `selector` (index or name substring, as
    /// `torus-wgpu adapters` prints), or the best adapter when None: discrete, then integrated,
    /// then anything else (lavapipe).
    pub fn new(selector: Option<&str>) -> Result<Gpu> {
        Self::open(selector, false)
    }

    fn open(selector: Option<&str>, tuning: bool) -> Result<Gpu> {
        let inst = instance();
        let adapters = pollster::block_on(inst.enumerate_adapters(wgpu::Backends::PRIMARY));
        if adapters.is_empty() {
            return Err(no_adapter());
        }
        let adapter = match selector {
            Some(sel) => {
                let by_index = sel.parse::<usize>().ok();
                adapters
                    .into_iter()
                    .enumerate()
                    .find(|(i, a)| {
                        Some(*i) == by_index || a.get_info().name.to_lowercase().contains(&sel.to_lowercase())
                    })
                    .map(|(_, a)| a)
                    .ok_or_else(|| anyhow!("no adapter matches '{sel}' (see `torus-wgpu adapters`)"))?
            }
            None => {
                let rank = |a: &wgpu::Adapter| match a.get_info().device_type {
                    wgpu::DeviceType::DiscreteGpu => 0,
                    wgpu::DeviceType::IntegratedGpu => 1,
                    wgpu::DeviceType::VirtualGpu => 2,
                    wgpu::DeviceType::Cpu => 3,
                    wgpu::DeviceType::Other => 4,
                };
                adapters.into_iter().min_by_key(rank).ok_or_else(no_adapter)?
            }
        };
        Self::from_adapter(adapter, tuning)
    }

    /// A device as `new` opens it, with everything the tuner may measure (cooperative matrices
    /// where the adapter has them).
    pub fn for_tuning(selector: Option<&str>) -> Result<Gpu> {
        Self::open(selector, true)
    }

    fn from_adapter(adapter: wgpu::Adapter, tuning: bool) -> Result<Gpu> {
        let info = adapter.get_info();
        let memory = adapter_memory(&adapter);
        let al = adapter.limits();
        let mut limits = wgpu::Limits::downlevel_defaults();
        limits.max_storage_buffer_binding_size = al.max_storage_buffer_binding_size;
        limits.max_buffer_size = al.max_buffer_size;
        limits.max_uniform_buffer_binding_size = al.max_uniform_buffer_binding_size;
        // 16 where the adapter allows (every native backend does): room for a KV cache split over
        // several buffers per layer.
        limits.max_storage_buffers_per_shader_stage = al.max_storage_buffers_per_shader_stage.min(16);
        limits.max_compute_workgroups_per_dimension = al.max_compute_workgroups_per_dimension;
        limits.max_compute_invocations_per_workgroup = al.max_compute_invocations_per_workgroup.min(256);
        limits.max_compute_workgroup_size_x = al.max_compute_workgroup_size_x.min(256);
        limits.max_compute_workgroup_storage_size = al.max_compute_workgroup_storage_size;
        let cache_path =
            pipeline_cache_path(&info).filter(|_| adapter.features().contains(wgpu::Features::PIPELINE_CACHE));
        let mut features = if cache_path.is_some() { wgpu::Features::PIPELINE_CACHE } else { wgpu::Features::empty() };
        // Subgroup operations for the gpu profile's reductions, where the adapter has them.
        let subgroups = adapter.features().contains(wgpu::Features::SUBGROUP);
        if subgroups {
            features |= wgpu::Features::SUBGROUP;
        }
        // Timestamp queries where the adapter has them (only the per-kernel profile writes any).
        features |= timing::TimestampMode::wanted(adapter.features());
        // f16 where the adapter has it (the GEMM's f16 tile variants).
        let f16 = adapter.features().contains(wgpu::Features::SHADER_F16);
        if f16 {
            features |= wgpu::Features::SHADER_F16;
        }
        let wanted = if coop::opted_out() {
            None
        } else if coop::opted_in() {
            Some(format!("{}=1", coop::COOP_ENV))
        } else if tuning {
            Some("the tuner measures them".to_string())
        } else if tune_cache::TuneCache::for_run().is_some_and(|c| c.wants_coop(&info)) {
            Some("the tuner chose them for this adapter".to_string())
        } else {
            None
        };
        let coop = if subgroups { coop::for_adapter(&adapter, wanted.as_deref()) } else { None };
        features |= coop::features(coop);
        let experimental_features = if coop.is_some() {
            // SAFETY: only the cooperative-matrix feature is experimental here, asked for only
            // when something wants it (see `coop`); its kernel uses the shapes the adapter lists.
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("torus-wgpu"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features,
            ..Default::default()
        }))
        .with_context(|| format!("cannot open a device on adapter '{}'", info.name))?;
        let max_grid = limits.max_compute_workgroups_per_dimension;
        let pipeline_cache = cache_path.as_ref().map(|p| {
            let data = std::fs::read(p).ok();
            // SAFETY: the data was written by `save_pipeline_cache` from `PipelineCache::get_data`
            // for an adapter with the same cache key (the file name); wgpu checks its header and,
            // with `fallback`, starts an empty cache when the data does not fit this device.
            unsafe {
                device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
                    label: Some("torus-wgpu"),
                    data: data.as_deref(),
                    fallback: true,
                })
            }
        });
        let memory_limit = memory.filter(|_| info.device_type != wgpu::DeviceType::Cpu);
        let faults = std::sync::Arc::new(GpuFaults::default());
        let f = faults.clone();
        device.set_device_lost_callback(move |reason, message| {
            tracing::error!("GPU device lost ({reason:?}): {message}");
            f.set_lost(format!("{reason:?}: {message}"));
        });
        let f = faults.clone();
        device.on_uncaptured_error(std::sync::Arc::new(move |e: wgpu::Error| {
            tracing::error!("GPU error outside a step: {e}");
            f.push_uncaptured(e.to_string());
        }));
        Ok(Gpu {
            device,
            queue,
            info,
            max_binding: limits.max_storage_buffer_binding_size,
            memory,
            memory_limit,
            pipeline_cache,
            pipeline_cache_path: cache_path,
            max_grid,
            subgroups,
            f16,
            coop,
            timestamps: timing::TimestampMode::of(features),
            faults,
            counters: Default::default(),
            staged_bytes: Default::default(),
        })
    }

    /// Runs `f` (work submitted to this device) inside error scopes for validation, out-of-memory
    /// and internal errors: any error wgpu reports for it, or one raised outside a scope
    /// meanwhile, fails the call with `GpuFault::Error`; a lost device with `GpuFault::Lost`.
    /// Error scopes are per thread: `f` must not hand GPU work to another thread.
    pub fn scoped<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if let Some(why) = self.faults.lost() {
            return Err(GpuFault::Lost(why).into());
        }
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let r = f();
        // Popped in reverse order; with wgpu-core the futures are ready at once.
        let errors: Vec<String> = [internal.pop(), validation.pop(), oom.pop()]
            .into_iter()
            .filter_map(pollster::block_on)
            .map(|e| e.to_string())
            .chain(self.faults.take_uncaptured())
            .collect();
        if let Some(why) = self.faults.lost() {
            return Err(GpuFault::Lost(why).into());
        }
        if !errors.is_empty() {
            return Err(GpuFault::Error(errors.join("; ")).into());
        }
        r
    }

    /// Test-only fault: records a copy that wgpu's validation rejects (an unaligned size), as a
    /// driver or shader bug would, so the error-scope path can be exercised.
    #[doc(hidden)]
    pub fn provoke_validation_error(&self) {
        let a = self.storage("fault-src", 16);
        let b = self.storage("fault-dst", 16);
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&a, 0, &b, 0, 3);
        self.queue.submit([enc.finish()]);
    }

    /// Writes the pipeline cache to disk (atomically), when there is one; errors are ignored
    /// (the cache only saves time).
    pub fn save_pipeline_cache(&self) {
        let (Some(cache), Some(path)) = (&self.pipeline_cache, &self.pipeline_cache_path) else { return };
        let Some(data) = cache.get_data() else { return };
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let ok = path.parent().is_some_and(|d| std::fs::create_dir_all(d).is_ok())
            && std::fs::write(&tmp, &data).is_ok()
            && std::fs::rename(&tmp, path).is_ok();
        if !ok {
            let _ = std::fs::remove_file(&tmp);
        }
    }

    /// A 1-D grid of `groups` workgroups folded into 2-D within `max_grid` per dimension
    /// (kernels rebuild the linear index from num_workgroups and skip the excess).
    pub fn fold(&self, groups: u32) -> (u32, u32) {
        let x = groups.clamp(1, self.max_grid.max(1));
        (x, groups.div_ceil(x).max(1))
    }

    /// Most buffers a layer's K (or V) cache may span on this device: the attention kernels
    /// bind 4 other storage buffers, and 2 per chunk.
    pub fn kv_chunk_limit(&self) -> usize {
        let n = self.device.limits().max_storage_buffers_per_shader_stage as usize;
        (n.saturating_sub(4) / 2).clamp(1, MAX_KV_CHUNKS)
    }

    /// The most loop iterations one shader invocation runs before the driver stops every loop
    /// of it, silently: llvmpipe's (lavapipe's) LLVMPIPE_LOOP_LIMIT; None on other drivers.
    /// Kernels whose loops grow with a step's tokens or a sequence's keys are written or bounded
    /// to stay within it (ops/delta.rs `max_loop_tokens`, the attention's unrolled head loops).
    pub fn loop_limit(&self) -> Option<usize> {
        self.info.name.contains("llvmpipe").then_some(LLVMPIPE_LOOP_LIMIT)
    }

    pub fn describe(&self) -> String {
        format!(
            "{} ({:?}, {:?}, driver {})",
            self.info.name, self.info.backend, self.info.device_type, self.info.driver_info
        )
    }

    pub fn storage_init(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        // wgpu rejects zero-sized bindings; pad empty data to one word.
        let data: &[u8] = if bytes.is_empty() { &[0u8; 16] } else { bytes };
        self.staged(data.len() as u64);
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: data,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        })
    }

    pub fn storage(&self, label: &str, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: size.max(16).next_multiple_of(16),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// An activation buffer: storage, and also bindable as uniform windows of UNIFORM_X_BYTES
    /// starting anywhere in its first `size` bytes (so it is padded by that much).
    pub fn activation(&self, label: &str, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (size + UNIFORM_X_BYTES).next_multiple_of(16),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::UNIFORM
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// Whether the uniform-x matmul variant can be used on this device.
    pub fn uniform_x_ok(&self) -> bool {
        self.device.limits().max_uniform_buffer_binding_size >= UNIFORM_X_BYTES
    }

    pub fn uniform_init(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytes,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        })
    }

    /// Submits one command buffer, counted and timed (`counters`).
    pub fn submit(&self, enc: wgpu::CommandEncoder) {
        let cb = enc.finish();
        let start = std::time::Instant::now();
        self.queue.submit([cb]);
        self.counters.submitted(start);
    }

    pub fn readback(&self, label: &str, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: size.max(16).next_multiple_of(16),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Blocks until `buf` (a MAP_READ buffer) is mapped and returns its first `len` bytes.
    pub fn read_mapped(&self, buf: &wgpu::Buffer, len: u64) -> Result<Vec<u8>> {
        let slice = buf.slice(..len);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let start = std::time::Instant::now();
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| anyhow!("GPU poll failed: {e}"))?;
        rx.recv().map_err(|_| anyhow!("GPU map callback dropped"))?.map_err(|e| anyhow!("GPU map failed: {e}"))?;
        self.counters.waited(start);
        let out = slice.get_mapped_range().map_err(|e| anyhow!("GPU map failed: {e:?}"))?.to_vec();
        buf.unmap();
        Ok(out)
    }

    /// Copies a storage buffer's first `len` bytes back to the host (tests and tools; the
    /// serving path reads back only sampled tokens).
    pub fn download(&self, src: &wgpu::Buffer, len: u64) -> Result<Vec<u8>> {
        let rb = self.readback("download", len);
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(src, 0, &rb, 0, len.next_multiple_of(4));
        self.queue.submit([enc.finish()]);
        self.read_mapped(&rb, len)
    }

    pub fn download_f32(&self, src: &wgpu::Buffer, n: usize) -> Result<Vec<f32>> {
        let b = self.download(src, (n * 4) as u64)?;
        Ok(bytemuck::pod_collect_to_vec(&b))
    }
}

/// Parses and validates WGSL with naga, so shader mistakes surface as one clear error. A
/// cooperative-matrix shader (one that enables the extension) is validated with its
/// capabilities; its pipeline is only built on a device opened with them (see `coop`).
pub fn validate_wgsl(label: &str, source: &str) -> Result<()> {
    validate_module(label, source, capabilities(source)).map(|_| ())
}

/// The naga capabilities a kernel's source is validated with.
pub fn capabilities(source: &str) -> naga::valid::Capabilities {
    use naga::valid::Capabilities as C;
    let caps = C::SHADER_FLOAT16_IN_FLOAT32 | C::SUBGROUP;
    if source.contains("enable wgpu_cooperative_matrix;") {
        caps | C::COOPERATIVE_MATRIX | C::SHADER_FLOAT16
    } else if source.contains("enable f16;") {
        caps | C::SHADER_FLOAT16
    } else {
        caps
    }
}

/// The parsed and validated module of `source` under `caps`, and its validation info.
pub fn validate_module(
    label: &str,
    source: &str,
    caps: naga::valid::Capabilities,
) -> Result<(naga::Module, naga::valid::ModuleInfo)> {
    let module =
        naga::front::wgsl::parse_str(source).map_err(|e| anyhow!("shader {label}: {}", e.emit_to_string(source)))?;
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
        .validate(&module)
        .map_err(|e| anyhow!("shader {label}: {}", e.emit_to_string(source)))?;
    Ok((module, info))
}
