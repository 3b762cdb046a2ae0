// Force-included before every source the front-end check parses (torch_sparse_metal/metal/_frontend.py).
//
// clang parses MSL here as C++ for OpenCL 2021 with the generic address space enabled, which
// has address spaces in its type system as Metal does: device = __global, threadgroup =
// __local, constant = __constant. Metal has no generic address space; its `thread` is
// OpenCL's __private, and the check reports every implicit conversion of a device,
// threadgroup or constant pointer, reference or object into __generic (what an unqualified
// pointer, reference or `this` is here) as the error Apple's compiler gives.
//
// Declarations only: nothing parsed with these headers is compiled or run.
#pragma once

#define device __global
#define constant __constant
#define threadgroup __local
#define thread __private

// OpenCL keywords and built-in type names that are ordinary identifiers in MSL.
#define global __tsm_msl_global
#define local __tsm_msl_local
#define generic __tsm_msl_generic
#define read_only __tsm_msl_read_only
#define write_only __tsm_msl_write_only
#define read_write __tsm_msl_read_write
#define pipe __tsm_msl_pipe
#define image1d_t __tsm_msl_image1d_t
#define image1d_array_t __tsm_msl_image1d_array_t
#define image1d_buffer_t __tsm_msl_image1d_buffer_t
#define image2d_t __tsm_msl_image2d_t
#define image2d_array_t __tsm_msl_image2d_array_t
#define image2d_depth_t __tsm_msl_image2d_depth_t
#define image2d_array_depth_t __tsm_msl_image2d_array_depth_t
#define image3d_t __tsm_msl_image3d_t
#define sampler_t __tsm_msl_sampler_t
#define event_t __tsm_msl_event_t
#define queue_t __tsm_msl_queue_t
#define clk_event_t __tsm_msl_clk_event_t
#define reserve_id_t __tsm_msl_reserve_id_t
// OpenCL 2.0's atomic types are built into clang's C++ for OpenCL; Metal's are metal::atomic<T>.
#define atomic_int __tsm_msl_atomic_int
#define atomic_uint __tsm_msl_atomic_uint
#define atomic_long __tsm_msl_atomic_long
#define atomic_ulong __tsm_msl_atomic_ulong
#define atomic_float __tsm_msl_atomic_float
#define atomic_double __tsm_msl_atomic_double
#define atomic_half __tsm_msl_atomic_half
#define atomic_flag __tsm_msl_atomic_flag
#define atomic_intptr_t __tsm_msl_atomic_intptr_t
#define atomic_uintptr_t __tsm_msl_atomic_uintptr_t
#define atomic_size_t __tsm_msl_atomic_size_t
#define atomic_ptrdiff_t __tsm_msl_atomic_ptrdiff_t
#define memory_order __tsm_msl_memory_order
#define memory_scope __tsm_msl_memory_scope

// MSL's half is IEEE binary16; OpenCL's `half` keyword is unusable on the x86-64 target
// this parse runs for (which the check needs for __bf16), so half is _Float16 here.
#define half _Float16

#if __METAL_VERSION__ >= 320
// Metal 3.2's coherence qualifier of device pointers, `coherent(device)`: a guarantee about
// the memory model, not a type difference the check needs.
#define coherent(scope)
#endif

// Function pointers parse (Metal takes them as template arguments, ggml's
// `template <void (*deq)(...)>`); the check reports every run-time one itself.
#pragma OPENCL EXTENSION __cl_clang_function_pointers : enable
