//! Kernel launches through `cuLaunchKernelEx`, so that a launch can be a programmatic
//! dependent launch: on sm_90 and later such a kernel may be scheduled while the kernel before
//! it on the stream still runs, and waits for it inside (`pdl_wait` in kernels/pdl.cuh). This
//! hides the gap between two short kernels of a decode step. cudarc's own builder offers no
//! launch attributes, so [`Launch`] takes its arguments the same way (the [`PushKernelArg`]
//! trait) and keeps cudarc's cross-stream event tracking through `device_ptr`.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchConfig, CUresult};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};

use crate::AttnError;

/// One kernel launch being assembled: arguments pushed in the kernel's parameter order with
/// [`PushKernelArg::arg`], then [`Launch::launch`].
pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    dependent: bool,
    /// Pointers to each argument's value, in parameter order.
    args: Vec<*mut c_void>,
    /// The device addresses of buffer arguments, boxed so that `args` may point at them
    /// wherever the `Launch` moves.
    #[allow(
        clippy::vec_box,
        reason = "each address must stay put while the vector grows and the launch moves"
    )]
    ptrs: Vec<Box<sys::CUdeviceptr>>,
    /// cudarc's records of each buffer's use, taken when the launch is enqueued.
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Launch<'a> {
    /// A launch of `func` on `stream`, ordinary until [`Launch::dependent`] says otherwise.
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction) -> Self {
        Launch {
            stream,
            func,
            dependent: false,
            args: Vec::with_capacity(32),
            ptrs: Vec::with_capacity(16),
            guards: Vec::with_capacity(16),
        }
    }

    /// Makes this a programmatic dependent launch where `on` is true. The kernel must call
    /// `pdl_wait()` (kernels/pdl.cuh) before it touches memory.
    pub fn dependent(&mut self, on: bool) -> &mut Self {
        self.dependent = on;
        self
    }

    fn push_ptr(&mut self, ptr: sys::CUdeviceptr, guard: SyncOnDrop<'a>) {
        let boxed = Box::new(ptr);
        self.args.push((&raw const *boxed).cast_mut().cast());
        self.ptrs.push(boxed);
        self.guards.push(guard);
    }

    /// Enqueues the kernel on the stream.
    ///
    /// # Safety
    /// As cudarc's `LaunchArgs::launch`: the arguments must match the kernel's parameters in
    /// number, order and type, and the kernel must stay within the buffers it is given.
    pub unsafe fn launch(mut self, cfg: LaunchConfig) -> Result<(), AttnError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: an all-zero attribute is a valid value of this plain C struct (id 0, a
        // zeroed union); its id and value are set next, and it is passed only when asked for.
        let mut attr: CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &raw mut attr,
            numAttrs: u32::from(self.dependent),
        };
        // SAFETY: `config` and `attr` outlive the call; every entry of `args` points at a value
        // that lives until `self` drops, after the call; the caller vouches for their match
        // with the kernel's parameters.
        let res = unsafe {
            sys::cuLaunchKernelEx(
                &raw const config,
                self.func.cu_function(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if res != CUresult::CUDA_SUCCESS {
            return Err(AttnError::Device(format!("cuLaunchKernelEx: {res:?}")));
        }
        // Dropping the guards records each buffer's use after the launch.
        self.guards.clear();
        Ok(())
    }
}

/// A plain value a [`Launch`] passes by copy: a scalar, or a `#[repr(C)]` struct mirroring
/// one of a kernel's parameters.
///
/// # Safety
/// The type's bytes must be what the kernel's parameter of that type expects.
pub unsafe trait KernelValue: DeviceRepr {}

// SAFETY: CUDA C's int, unsigned int, float, long long and unsigned long long have these
// layouts.
unsafe impl KernelValue for i32 {}
// SAFETY: as above.
unsafe impl KernelValue for u32 {}
// SAFETY: as above.
unsafe impl KernelValue for f32 {}
// SAFETY: as above.
unsafe impl KernelValue for i64 {}
// SAFETY: as above.
unsafe impl KernelValue for u64 {}

// SAFETY: the pointer pushed is to a value borrowed for `'b`, which outlives the launch.
unsafe impl<'a, 'b: 'a, T: KernelValue> PushKernelArg<&'b T> for Launch<'a> {
    fn arg(&mut self, arg: &'b T) -> &mut Self {
        self.args.push((&raw const *arg).cast_mut().cast());
        self
    }
}

// SAFETY: the device address is boxed in `self`; `device_ptr` orders the stream after the
// buffer's last write, and its guard records this read when the launch is enqueued.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b CudaSlice<T>> for Launch<'a> {
    fn arg(&mut self, arg: &'b CudaSlice<T>) -> &mut Self {
        let (ptr, guard) = arg.device_ptr(self.stream);
        self.push_ptr(ptr, guard);
        self
    }
}

// SAFETY: as above, with `device_ptr_mut` ordering the stream after the buffer's last read and
// write and its guard recording this write.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut CudaSlice<T>> for Launch<'a> {
    fn arg(&mut self, arg: &'b mut CudaSlice<T>) -> &mut Self {
        let (ptr, guard) = arg.device_ptr_mut(self.stream);
        self.push_ptr(ptr, guard);
        self
    }
}
