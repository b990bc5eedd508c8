//! The CUDA backend: the same operations as the CPU implementation, on device memory.
//!
//! [`Gpu`] owns a context, one stream and the kernels of `kernels/attn.cu`, compiled once by
//! NVRTC when it is created. Data lives in [`DevicePagedKv`] (the block-tensor layout of
//! [`PagedKv`](crate::PagedKv)), [`DeviceBatch`] (the three metadata arrays, validated on the
//! host before they are uploaded) and [`DeviceSelection`] (selections in the shared -1-padded
//! format, which device kernels may produce). Every operation is enqueued on the stream and
//! returns without waiting; reading a result back (or [`Gpu::synchronize`]) waits.
//!
//! Without a CUDA driver or device [`Gpu::new`] answers [`AttnError::Device`]; it never panics.
//! Kernel indices read from device memory are range-checked before they address memory, so a
//! bad id produced on the device is skipped, never dereferenced.

mod kernels;
mod kv;
mod launch;
mod meta;
mod ops;
mod timing;
mod walk;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, DriverError,
    ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
use half::{bf16, f16};

use crate::kv::Memory;
use crate::{AttnError, DType, Element};

use kernels::{ATTN_DIMS, ATTN_SPECS, AttnKey, MIN_CHUNK, PUB_TABLE_ROWS};
pub(crate) use kernels::{AttnKernel, PubKernel, WARPS};
pub use kv::DevicePagedKv;
pub use launch::{KernelValue, Launch};
pub use meta::{DeviceArrays, DeviceBatch, DeviceGathered, DeviceSelection, Published};
pub use timing::{StageClock, Timing};
pub use walk::page_walk_rows_fit;

/// CTAs whose records the traced attention kernel keeps (`TRACE_CTAS` in kernels/trace.cuh).
pub const TRACE_CTAS: usize = 4096;
/// Words of one CTA's trace record: [`TRACE_MARKS`] timestamps (ns of `%globaltimer`, 0 where a
/// mark was not reached), then the SM id | merged << 16 | rounds << 20, then the SM cycles from
/// the first mark to the last.
pub const TRACE_WORDS: usize = TRACE_MARKS + 2;
/// Timestamps of a trace record: entry, after the dependent-launch wait, the unit's metadata,
/// the first slots, the first K and V, the end of the walk, the warps' states in shared
/// memory, the split's partial or final rows written, the split counted, the end (after the
/// merge where this CTA merged its unit).
pub const TRACE_MARKS: usize = 10;

/// The per-CTA trace records (kernels/trace.cuh) that the traced kernels of `module`, a module
/// compiled with that header, wrote since the last call: [`TRACE_WORDS`] words per CTA for
/// [`TRACE_CTAS`] CTAs. Synchronizes `stream`, reads the records and zeroes them. Attention's
/// are [`Gpu::take_attn_trace`]; sparse-algo reads its own module's the same way.
pub fn take_trace(
    module: &Arc<CudaModule>,
    stream: &Arc<CudaStream>,
) -> Result<Vec<u64>, AttnError> {
    stream.synchronize()?;
    let mut view = module.get_global("attn_trace", stream)?;
    let n = TRACE_CTAS * TRACE_WORDS;
    // SAFETY: `attn_trace` is declared in kernels/trace.cuh as `unsigned long long
    // [TRACE_CTAS * TRACE_WORDS]`, so the symbol holds exactly n u64s.
    let mut words = unsafe { view.transmute_mut::<u64>(n) }.ok_or_else(|| {
        AttnError::Device("attn_trace is smaller than kernels/trace.cuh declares".to_owned())
    })?;
    let records = stream.clone_dtoh(&words)?;
    stream.memset_zeros(&mut words)?;
    stream.synchronize()?;
    Ok(records)
}

/// The CUDA C source of every kernel, embedded at build time.
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("../../../../kernels/pdl.cuh"),
    include_str!("../../../../kernels/mma.cuh"),
    include_str!("../../../../kernels/trace.cuh"),
    include_str!("../../../../kernels/attn.cu"),
    include_str!("../../../../kernels/walk.cu")
);

/// Device memory, as [`Memory`] types: cudarc slices.
#[derive(Clone, Copy, Debug)]
pub struct Device;

impl Memory for Device {
    type Slice<T: Element> = CudaSlice<T>;
    type Indices = CudaSlice<i32>;
}

/// An [`Element`] the kernels are built for; sealed like `Element`.
pub trait CudaElement: Element + DeviceRepr + ValidAsZeroBits {
    /// The kernel-name suffix of the type.
    const KERNEL: &'static str;
}

impl CudaElement for f32 {
    const KERNEL: &'static str = "f32";
}

impl CudaElement for f16 {
    const KERNEL: &'static str = "f16";
}

impl CudaElement for bf16 {
    const KERNEL: &'static str = "bf16";
}

impl From<DriverError> for AttnError {
    fn from(e: DriverError) -> Self {
        AttnError::Device(format!("CUDA driver: {e:?}"))
    }
}

/// Compiles [`KERNEL_SOURCE`] to PTX for `arch` (for example `sm_90`) with NVRTC. Needs only the
/// NVRTC library, not a device: a build machine can check that the kernels compile.
pub fn compile_kernels(arch: &'static str) -> Result<Ptx, AttnError> {
    compile_source("kernels/attn.cu", KERNEL_SOURCE, arch)
}

/// Compiles CUDA C source (`name` is for messages) to PTX for `arch` with NVRTC, with the CUDA
/// headers from `/usr/local/cuda/include` or `HSA_CUDA_INCLUDE`. Other crates' kernels (offload's)
/// are compiled through this too.
pub fn compile_source(name: &str, src: &str, arch: &'static str) -> Result<Ptx, AttnError> {
    // SAFETY: only probes whether the NVRTC shared library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(AttnError::Device(
            "no NVRTC library (libnvrtc) found".to_owned(),
        ));
    }
    let mut include_paths = vec!["/usr/local/cuda/include".to_owned()];
    if let Ok(extra) = std::env::var("HSA_CUDA_INCLUDE") {
        include_paths.insert(0, extra);
    }
    let opts = CompileOptions {
        arch: Some(arch),
        include_paths,
        options: vec!["--std=c++17".to_owned()],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(src, opts)
        .map_err(|e| AttnError::Device(format!("NVRTC compile of {name}: {e}")))
}

/// The kernels of [`KERNEL_SOURCE`] other than attention (those are in [`Gpu::attn`]).
const KERNEL_NAMES: &[&str] = &[
    "attn_merge",
    "set_kv",
    "gather_pages",
    "compact_f32",
    "compact_f16",
    "compact_bf16",
    "walk_pages_f16",
    "walk_pages_bf16",
    "walk_pages_pub_f16",
    "walk_pages_pub_bf16",
    "walk_merge",
    "walk_merge_pub",
];

/// Where split-KV launches write their partial results: outputs `[splits, rows, head_dim]`,
/// LSEs `[splits, rows]`, and per unit (row tile of one sequence and KV head) the count of
/// splits done, zero between launches (the last split of a unit merges it and resets it).
pub(crate) struct Scratch {
    pub(crate) out: CudaSlice<f32>,
    pub(crate) lse: CudaSlice<f32>,
    pub(crate) counters: CudaSlice<i32>,
}

/// A CUDA device with the attention kernels loaded and one stream to run them on.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The compiled attention module (for its `attn_trace` symbol).
    module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    attn: HashMap<AttnKey, AttnKernel>,
    /// One-element buffers passed where a kernel argument is unused.
    dummy_f32: CudaSlice<f32>,
    dummy_i32: CudaSlice<i32>,
    sms: usize,
    /// Scratch for split-KV partial results, grown on demand and reused.
    scratch: Mutex<Option<Scratch>>,
    /// Target CTAs of a split-KV launch, in waves of the resident CTAs the device holds.
    waves: usize,
    /// The fewest keys a split of a split-KV launch takes.
    min_chunk: usize,
    /// The attention kernel to use where it is built for a launch's type and head dim, in
    /// place of the default (for the bench's sweep).
    variant: Option<&'static str>,
    /// The NVRTC architecture the kernels were compiled for.
    arch: &'static str,
    /// Whether the kernels that support it are launched as programmatic dependent launches.
    dependent: bool,
    /// Whether page-list decodes that fit it take the page walk (kernels/walk.cu).
    page_walk: bool,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .field("sms", &self.sms)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens device `ordinal` and compiles the kernels for its architecture. Answers
    /// [`AttnError::Device`] where no driver, no device or no NVRTC exists.
    pub fn new(ordinal: usize) -> Result<Self, AttnError> {
        // SAFETY: only probes whether the driver library can be opened; without it
        // `CudaContext::new` would panic instead of returning an error.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(AttnError::Device(
                "no CUDA driver (libcuda) found".to_owned(),
            ));
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = arch_name(major, minor)?;
        let module = ctx.load_module(compile_kernels(arch)?)?;
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let stream = ctx.default_stream();
        let mut funcs = HashMap::new();
        for &name in KERNEL_NAMES {
            let f = module
                .load_function(name)
                .map_err(|e| AttnError::Device(format!("kernel {name}: {e:?}")))?;
            funcs.insert(name, f);
        }
        let mut attn = HashMap::new();
        for (dtype, tn) in [
            (DType::F32, "f32"),
            (DType::F16, "f16"),
            (DType::BF16, "bf16"),
        ] {
            for d in ATTN_DIMS {
                for spec in ATTN_SPECS.iter().filter(|s| s.built_for(dtype, d)) {
                    let name = format!("attn_{tn}_d{d}_{}", spec.suffix);
                    let func = module
                        .load_function(&name)
                        .map_err(|e| AttnError::Device(format!("kernel {name}: {e:?}")))?;
                    let smem = spec.smem(d);
                    let occupancy = |f: &CudaFunction, bytes: usize| -> Result<usize, AttnError> {
                        Ok(f.occupancy_max_active_blocks_per_multiprocessor(
                            to_u32(WARPS * 32)?,
                            bytes,
                            None,
                        )?
                        .max(1) as usize)
                    };
                    let resident = occupancy(&func, smem)?;
                    let published = if spec.tensor_cores {
                        let name = format!("{name}_pub");
                        let f = module
                            .load_function(&name)
                            .map_err(|e| AttnError::Device(format!("kernel {name}: {e:?}")))?;
                        Some(pub_kernel(f, smem, resident, &occupancy)?)
                    } else {
                        None
                    };
                    let kernel = AttnKernel {
                        func,
                        published,
                        rows: spec.rows,
                        smem,
                        resident,
                    };
                    attn.insert((dtype, d, spec.suffix), kernel);
                }
            }
        }
        Ok(Gpu {
            dummy_f32: stream.alloc_zeros(1)?,
            dummy_i32: stream.alloc_zeros(1)?,
            ctx,
            stream,
            module,
            funcs,
            attn,
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            scratch: Mutex::new(None),
            waves: 1,
            min_chunk: MIN_CHUNK,
            variant: None,
            arch,
            dependent: major >= 9,
            page_walk: true,
        })
    }

    /// The NVRTC architecture of the device (for example `sm_90`), for compiling more kernels
    /// with [`compile_source`].
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// The device's name, as the driver reports it.
    pub fn name(&self) -> Result<String, AttnError> {
        Ok(self.ctx.name()?)
    }

    /// The per-CTA records written by launches of the traced attention kernel (variant `tct`,
    /// see kernels/trace.cuh) since the last call: [`TRACE_WORDS`] words per CTA, in the
    /// launch's linear CTA order, for the first [`TRACE_CTAS`] CTAs; all-zero records for CTAs
    /// no launch ran. Synchronizes the stream, reads the records and zeroes them.
    pub fn take_attn_trace(&self) -> Result<Vec<u64>, AttnError> {
        take_trace(&self.module, &self.stream)
    }

    /// Streaming multiprocessors of the device.
    pub fn multiprocessors(&self) -> usize {
        self.sms
    }

    /// Sets how many CTAs a split-KV launch aims for, in waves of the CTAs the device holds
    /// at once (1 unless set: fewer, longer CTAs measured fastest on an H200; at least 1).
    pub fn set_waves(&mut self, waves: usize) {
        self.waves = waves.max(1);
    }

    /// Sets the fewest keys one split of a split-KV launch takes, rounded up to a whole tile of
    /// 16 (128 unless set, two tiles per warp): for the bench's sweep, which weighs fewer,
    /// longer CTAs against more, shorter ones where a launch has few (sequence, KV head) units.
    pub fn set_min_chunk(&mut self, keys: usize) {
        self.min_chunk = keys.max(16).div_ceil(16) * 16;
    }

    /// Whether kernels that wait for their predecessor inside (attention, and the selection
    /// kernels of sparse-algo that ask) are launched as programmatic dependent launches, which
    /// lets each start while the kernel before it finishes. On by default from compute
    /// capability 9.0 (Hopper), where the hardware has it; off before.
    pub fn dependent_launches(&self) -> bool {
        self.dependent
    }

    /// Turns programmatic dependent launches on or off (for the bench's comparison); asking
    /// for them below compute capability 9.0 leaves them off.
    pub fn set_dependent_launches(&mut self, on: bool) {
        self.dependent = on && self.has_sm90_features();
    }

    /// Whether the device has what compute capability 9.0 (Hopper) brought that the kernels
    /// use: programmatic dependent launches and clusters of CTAs sharing their shared memory.
    pub fn has_sm90_features(&self) -> bool {
        self.arch
            .strip_prefix("sm_")
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| n >= 90)
    }

    /// The attention kernel picked by [`Gpu::set_variant`], `None` for the defaults.
    pub fn variant(&self) -> Option<&'static str> {
        self.variant
    }

    /// Picks the attention kernel by the suffix of its name, for benchmarking: `tc` (tensor
    /// cores, the default for f16 and bf16 at head dims 64 and 128), `r4` or `r8` (CUDA cores,
    /// 4 or 8 rows per CTA), or one of the variants built for bf16 at head dim 128 only: `tc2`
    /// (`tc` with two tiles a warp in flight, 2 CTAs per multiprocessor), `r4_u4` (four keys
    /// per stream and step), `r4_u4p` (the same, pipelined), `r4_u1p` (one key, pipelined),
    /// `tct` (`tc` writing per-CTA timestamps, read by [`Gpu::take_attn_trace`]). `None`
    /// restores the defaults. A launch for which the picked kernel is not built uses its
    /// default; unknown names are rejected.
    pub fn set_variant(&mut self, variant: Option<&str>) -> Result<(), AttnError> {
        self.variant = match variant {
            None => None,
            Some(v) => Some(
                ATTN_SPECS
                    .iter()
                    .find(|s| s.suffix == v)
                    .ok_or_else(|| AttnError::Invalid(format!("no attention kernel {v:?}")))?
                    .suffix,
            ),
        };
        Ok(())
    }

    /// Another handle on the same device and loaded kernels, with a stream of its own (a
    /// non-blocking one): work enqueued on the two runs concurrently. Each handle keeps its
    /// own scratch, so two threads may run attention on two forks at once. Buffers that both
    /// streams touch need ordering: cudarc's event tracking does it unless the caller turned
    /// it off, in which case the caller orders them (for example by synchronizing the
    /// stream that wrote them before the other reads them).
    pub fn fork(&self) -> Result<Gpu, AttnError> {
        self.fork_on(self.ctx.new_stream()?)
    }

    /// [`fork`](Self::fork) with a stream of the highest priority the device has (`high`)
    /// or its lowest: where both have work waiting, the device starts the blocks of the
    /// higher-priority stream's kernels first.
    pub fn fork_with_priority(&self, high: bool) -> Result<Gpu, AttnError> {
        self.ctx.bind_to_thread()?;
        let (least, greatest) = cudarc::driver::result::stream::get_priority_range()?;
        let stream = self
            .ctx
            .new_stream_with_priority(if high { greatest } else { least })?;
        self.fork_on(stream)
    }

    fn fork_on(&self, stream: Arc<CudaStream>) -> Result<Gpu, AttnError> {
        Ok(Gpu {
            dummy_f32: stream.alloc_zeros(1)?,
            dummy_i32: stream.alloc_zeros(1)?,
            ctx: Arc::clone(&self.ctx),
            stream,
            module: Arc::clone(&self.module),
            funcs: self.funcs.clone(),
            attn: self.attn.clone(),
            sms: self.sms,
            scratch: Mutex::new(None),
            waves: self.waves,
            min_chunk: self.min_chunk,
            variant: self.variant,
            arch: self.arch,
            dependent: self.dependent,
            page_walk: self.page_walk,
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every operation is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for everything enqueued so far.
    pub fn synchronize(&self) -> Result<(), AttnError> {
        Ok(self.stream.synchronize()?)
    }

    /// Copies host data into a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>, AttnError> {
        Ok(self.stream.clone_htod(src)?)
    }

    /// Copies a device buffer back to the host (waits for the stream).
    pub fn download<T: DeviceRepr>(&self, src: &CudaSlice<T>) -> Result<Vec<T>, AttnError> {
        Ok(self.stream.clone_dtoh(src)?)
    }

    /// A zeroed device buffer.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, AttnError> {
        Ok(self.stream.alloc_zeros(len.max(1))?)
    }

    /// The attention kernel for an element type, head dim and the most rows of one (sequence,
    /// KV head): the picked variant where it is built, else the default.
    pub(crate) fn attn_kernel(
        &self,
        dtype: DType,
        d: usize,
        max_rows: usize,
    ) -> Result<&AttnKernel, AttnError> {
        let picked = self.variant.and_then(|v| self.attn.get(&(dtype, d, v)));
        let default = || {
            let cuda_cores = if max_rows <= 4 { "r4" } else { "r8" };
            self.attn
                .get(&(dtype, d, "tc"))
                .or_else(|| self.attn.get(&(dtype, d, cuda_cores)))
        };
        picked.or_else(default).ok_or_else(|| {
            AttnError::Invalid(format!(
                "no device attention kernel for {dtype:?}, head_dim {d}"
            ))
        })
    }

    /// What the default attention kernel for an element type and head dim (decode rows), or
    /// its form over a published selection where `published`, holds per thread and
    /// multiprocessor, as the driver reports it: registers per thread, bytes of local memory
    /// per thread (spills), and CTAs per multiprocessor. For benches.
    pub fn attention_resources(
        &self,
        dtype: DType,
        d: usize,
        published: bool,
    ) -> Result<(usize, usize, usize), AttnError> {
        let kernel = self.attn_kernel(dtype, d, 4)?;
        let (func, resident) = match (&kernel.published, published) {
            (Some(p), true) => (&p.func, p.resident),
            (None, true) => {
                return Err(AttnError::Invalid(format!(
                    "no kernel over published selections for {dtype:?}, head_dim {d}"
                )));
            }
            (_, false) => (&kernel.func, kernel.resident),
        };
        let attr = |a| -> Result<usize, AttnError> {
            Ok(usize::try_from(func.get_attribute(a)?).unwrap_or(0))
        };
        Ok((
            attr(CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            attr(CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
            resident,
        ))
    }

    /// A loaded kernel by name (every name of [`KERNEL_NAMES`] is loaded by [`Gpu::new`]).
    fn function(&self, name: &str) -> Result<&CudaFunction, AttnError> {
        self.funcs
            .get(name)
            .ok_or_else(|| AttnError::Device(format!("no kernel named {name}")))
    }
}

/// The published form `func` of a kernel whose plain form holds `resident` CTAs a
/// multiprocessor with `smem` bytes of dynamic shared memory: the longest row of
/// [`PUB_TABLE_ROWS`] it stages at that occupancy, its launches allowed that much more.
fn pub_kernel(
    func: CudaFunction,
    smem: usize,
    resident: usize,
    occupancy: &dyn Fn(&CudaFunction, usize) -> Result<usize, AttnError>,
) -> Result<PubKernel, AttnError> {
    let allow = |bytes: usize| -> Result<(), AttnError> {
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            to_i32(bytes)?,
        )?;
        Ok(())
    };
    let own = occupancy(&func, smem)?;
    let mut table_cap = 0;
    for rows in PUB_TABLE_ROWS {
        let bytes = smem + rows * size_of::<i32>();
        // A device that cannot give a CTA that much refuses the allowance: a shorter row.
        if allow(bytes).is_ok() && occupancy(&func, bytes)? == resident {
            table_cap = rows;
            break;
        }
    }
    allow(smem + table_cap * size_of::<i32>())?;
    Ok(PubKernel {
        func,
        resident: own,
        table_cap,
    })
}

/// The NVRTC architecture name of a compute capability NVRTC can target.
fn arch_name(major: i32, minor: i32) -> Result<&'static str, AttnError> {
    Ok(match (major, minor) {
        (7, 0) => "sm_70",
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => {
            return Err(AttnError::Device(format!(
                "compute capability {major}.{minor} has no kernel build"
            )));
        }
    })
}

/// A host size as the kernels' `i32`.
fn to_i32(x: usize) -> Result<i32, AttnError> {
    i32::try_from(x).map_err(|_| AttnError::Invalid(format!("{x} does not fit in an i32")))
}

/// A host size as a launch dimension.
fn to_u32(x: usize) -> Result<u32, AttnError> {
    u32::try_from(x).map_err(|_| AttnError::Invalid(format!("{x} does not fit a grid dimension")))
}
