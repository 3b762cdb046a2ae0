// torch_sparse_metal._metal_launcher: encode one Metal compute dispatch on torch's MPS stream.
//
// A thin, op-agnostic launcher. Python (torch_sparse_metal/_metal_backend.py) hands it a
// self-contained Metal source string, a kernel name, the arguments in [[buffer(i)]] order
// (MPS tensors or the raw bytes of typed scalars), the grid in threads and the threadgroup
// size (dispatchThreads semantics) and the byte lengths of the [[threadgroup(n)]] parameters.
//
// Stream contract (the same one torch's own Metal ops follow):
//   * everything that touches the encoder runs inside
//     dispatch_sync(stream->queue(), ^{ ... stream->commandEncoder() ... });
//   * the encoder is torch's shared ("coalesced") compute encoder: this file never ends it
//     and never commits the command buffer; torch does both when it needs to;
//   * a tensor binds as its storage's MTLBuffer at byte offset
//     storage_offset * element_size, so views work;
//   * every dispatch is bracketed by torch's MPSProfiler beginProfileKernel/endProfileKernel,
//     keyed by the pipeline, as torch's own Metal kernels are, so it shows in
//     torch.mps.profiler traces and in PYTORCH_MPS_LOG_PROFILE_INFO logs (torch 2.7 and
//     later: see TSM_TORCH_PROFILER).
//
// Bind-time checks: each pipeline is created with its reflection, cached with it. A dispatch
// binds exactly the declared [[buffer(i)]] (bytes: one value of the declared size, unless
// Metal reports the binding unused: its size need not be reported then) and gives
// every declared [[threadgroup(n)]] a length, which is always set, 0 included: the encoder is
// shared, so a slot left alone would keep what the previous kernel on the stream set there.
// The Python side runs the same checks first, with the emulator's messages (pipeline_info
// gives it the reflection); the ones here guard the module's own entry point.
//
// Memory management: Automatic Reference Counting. setup.py compiles this file with
// -fobjc-arc and the #error below refuses any other build. Strong references live in the
// (deliberately never destroyed) caches and in local __strong variables; nothing is retained
// or released by hand. Objective-C++ defaults to -fobjc-arc-exceptions, so strong locals are
// also released when a C++ exception unwinds through them. Autorelease pools are never left
// by an exception: code inside @autoreleasepool reports failures as values and the C++
// exception is thrown after the pool has been popped.
//
// Compilation: MTLCompileOptions.languageVersion is the newest Metal Shading Language the
// running macOS supports among 3.0 (macOS 13), 3.1 (14), 3.2 (15) and 4.0 (26), limited to
// what the SDK used for the build knows. Math is SAFE with precise functions, as torch's own
// runtime-compiled shaders use unless PYTORCH_MPS_FAST_MATH is set, and as the emulator
// computes: fast math lets the compiler assume no NaN/Inf operands, which breaks kernels that
// start a minimum from INFINITY or must propagate NaN, and would make the GPU disagree with
// the emulator the tests run on. TSM_METAL_FAST_MATH=1 in the environment (read once) opts
// into Metal's fast math. It is set explicitly on every macOS, since from macOS 15 the
// default depends on the language version.
//
// Objective-C types never leave this file: the only interface is the Python module below.

#if !__has_feature(objc_arc)
#error "launcher.mm must be compiled with -fobjc-arc (see setup.py)"
#endif

#include <torch/extension.h>
#include <torch/version.h>

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

// torch 2.4 to 2.6 define MPSProfiler.h's BaseInfo::buildTensorString inline with code ARC
// rejects (an id<MTLBuffer> passed as const void*, -retainCount); 2.7 moved it out of line.
// Under those releases the dispatches are encoded as usual but not registered with the
// profiler.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
#define TSM_TORCH_PROFILER 1
#include <ATen/mps/MPSProfiler.h>
#else
#define TSM_TORCH_PROFILER 0
#endif
#include <pybind11/stl.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
// Declarations only, for the MPSMatrixMultiplication benchmark baseline (mps_matmul below):
// its classes are looked up at run time, so the extension links no extra framework.
#import <MetalPerformanceShaders/MetalPerformanceShaders.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _metal_launcher
#endif

// Availability.h (via Foundation) names the SDK's newest macOS as __MAC_OS_X_VERSION_MAX_ALLOWED.
#ifndef __MAC_OS_X_VERSION_MAX_ALLOWED
#define __MAC_OS_X_VERSION_MAX_ALLOWED 0
#endif
#define TSM_SDK_HAS(version) (__MAC_OS_X_VERSION_MAX_ALLOWED >= (version))

namespace py = pybind11;

namespace {

// Metal's argument tables: [[buffer(0..30)]] and [[threadgroup(0..30)]].
constexpr size_t kMaxBufferArguments = 31;
constexpr size_t kMaxThreadgroupArguments = 31;
// setBytes:length:atIndex: is documented for data smaller than 4 KB.
constexpr size_t kMaxSetBytesLength = 4096;
// setThreadgroupMemoryLength:atIndex: takes multiples of 16 bytes.
constexpr uint64_t kThreadgroupMemoryAlignment = 16;

std::string ns_to_std(NSString* s) {
  if (s == nil) {
    return std::string();
  }
  const char* utf8 = [s UTF8String];
  return utf8 ? std::string(utf8) : std::string();
}

// ---------------------------------------------------------------------------------------
// Compile options, chosen once per process.
// ---------------------------------------------------------------------------------------

struct LanguageChoice {
  bool set = false;  // false: leave Metal's default (macOS older than 13)
  MTLLanguageVersion version{};
  const char* name = "default";
};

LanguageChoice newest_language_version() {
  LanguageChoice c;
#if TSM_SDK_HAS(260000)
  if (@available(macOS 26.0, *)) {
    c.set = true;
    c.version = MTLLanguageVersion4_0;
    c.name = "4.0";
    return c;
  }
#endif
#if TSM_SDK_HAS(150000)
  if (@available(macOS 15.0, *)) {
    c.set = true;
    c.version = MTLLanguageVersion3_2;
    c.name = "3.2";
    return c;
  }
#endif
#if TSM_SDK_HAS(140000)
  if (@available(macOS 14.0, *)) {
    c.set = true;
    c.version = MTLLanguageVersion3_1;
    c.name = "3.1";
    return c;
  }
#endif
#if TSM_SDK_HAS(130000)
  if (@available(macOS 13.0, *)) {
    c.set = true;
    c.version = MTLLanguageVersion3_0;
    c.name = "3.0";
    return c;
  }
#endif
  return c;
}

const LanguageChoice& language_version() {
  static const LanguageChoice choice = newest_language_version();
  return choice;
}

bool fast_math_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("TSM_METAL_FAST_MATH");
    if (value == nullptr || *value == '\0') {
      return false;
    }
    const std::string v(value);
    return v == "1" || v == "true" || v == "True" || v == "TRUE" || v == "on" || v == "yes";
  }();
  return enabled;
}

void apply_math_mode(MTLCompileOptions* options, bool fast) {
#if TSM_SDK_HAS(150000)
  if (@available(macOS 15.0, *)) {
    options.mathMode = fast ? MTLMathModeFast : MTLMathModeSafe;
    options.mathFloatingPointFunctions =
        fast ? MTLMathFloatingPointFunctionsFast : MTLMathFloatingPointFunctionsPrecise;
    return;
  }
#endif
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
  options.fastMathEnabled = fast ? YES : NO;  // YES is the documented default before macOS 15
#pragma clang diagnostic pop
}

// ---------------------------------------------------------------------------------------
// Device.
// ---------------------------------------------------------------------------------------

id<MTLDevice> metal_device() {
  if (!at::mps::is_available()) {
    throw std::runtime_error(
        "_metal_launcher: torch's MPS backend is not available on this machine (no Apple "
        "GPU, or macOS too old)");
  }
  id<MTLDevice> device = at::mps::MPSDevice::getInstance()->device();
  if (device == nil) {
    throw std::runtime_error("_metal_launcher: torch's MPS device has no MTLDevice");
  }
  return device;
}

struct DeviceProbe {
  std::string name;
  bool apple7 = false;  // simdgroup_matrix
  bool metal3 = false;  // native atomic_float in device memory
  MTLSize max_threads_per_threadgroup{};
  uint64_t max_threadgroup_memory = 0;
  uint64_t recommended_max_working_set_size = 0;
};

DeviceProbe probe_device(id<MTLDevice> device) {
  DeviceProbe p;
  @autoreleasepool {
    p.name = ns_to_std(device.name);
    if (@available(macOS 11.0, *)) {
      p.apple7 = [device supportsFamily:MTLGPUFamilyApple7];
    }
#if TSM_SDK_HAS(130000)
    if (@available(macOS 13.0, *)) {
      p.metal3 = [device supportsFamily:MTLGPUFamilyMetal3];
    }
#endif
    p.max_threads_per_threadgroup = device.maxThreadsPerThreadgroup;
    p.max_threadgroup_memory = static_cast<uint64_t>(device.maxThreadgroupMemoryLength);
    p.recommended_max_working_set_size = static_cast<uint64_t>(device.recommendedMaxWorkingSetSize);
  }
  return p;
}

const DeviceProbe& device_probe() {
  // Initialised on first use; a throw from metal_device() leaves it uninitialised for a retry.
  static const DeviceProbe probe = probe_device(metal_device());
  return probe;
}

// ---------------------------------------------------------------------------------------
// Library and pipeline caches.
// ---------------------------------------------------------------------------------------

// A [[buffer(i)]] or [[threadgroup(i)]] parameter, as the pipeline's reflection gives it.
struct Parameter {
  uint64_t index = 0;
  std::string name;
  uint64_t size = 0;      // bufferDataSize (the pointee's) / threadgroupMemoryDataSize
  int64_t data_type = 0;  // MTLDataType of a buffer's pointee; 0 for threadgroup memory
  // MTLBinding.used: whether the function reads the binding. Size and type of an unused
  // one need not be reported, so they are not checked.
  bool used = true;
};

struct Kernel {
  id<MTLComputePipelineState> pipeline = nil;
  uint64_t max_total_threads = 0;
  uint64_t thread_execution_width = 0;
  uint64_t static_threadgroup_memory = 0;
  std::vector<Parameter> buffers;       // sorted by index
  std::vector<Parameter> threadgroups;  // sorted by index
  size_t buffer_slots = 0;              // highest [[buffer(i)]] + 1: the arguments expected
  size_t threadgroup_slots = 0;         // highest [[threadgroup(n)]] + 1
};

struct Library {
  id<MTLLibrary> library = nil;
  std::unordered_map<std::string, Kernel> kernels;  // pipeline per kernel name
};

struct Caches {
  std::mutex mutex;
  // Authoritative: one compiled library per distinct source text.
  std::unordered_map<std::string, std::unique_ptr<Library>> by_source;
  // Fast path: the Python str object last seen for a source (torch_sparse_metal caches
  // shader sources, so the same object comes back on every dispatch and the text is
  // neither copied nor hashed again). Each entry holds a reference to its str, so the
  // address cannot be reused by another object while the entry exists.
  std::unordered_map<PyObject*, std::pair<py::object, Library*>> by_object;
};

constexpr size_t kMaxIdentityEntries = 256;

Caches& caches() {
  // Never destroyed: releasing Metal objects or Python references during interpreter
  // shutdown is not safe.
  static Caches* c = new Caches();
  return *c;
}

// The Metal compiler rejected a shader: raised in Python as _metal_launcher.CompileError
// with the compiler's output, which torch_sparse_metal._metal_backend turns into the
// MetalCompileError the emulator raises, naming the shader file and line.
struct CompileFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Returns nil and fills `message` on failure (never throws inside the pool).
id<MTLLibrary> compile_library(id<MTLDevice> device, const std::string& source,
                               std::string* message) {
  id<MTLLibrary> library = nil;
  @autoreleasepool {
    NSString* text = [[NSString alloc] initWithBytes:source.data()
                                              length:source.size()
                                            encoding:NSUTF8StringEncoding];
    if (text == nil) {
      *message = "the shader source is not valid UTF-8";
      return nil;
    }
    MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
    const LanguageChoice& lang = language_version();
    if (lang.set) {
      options.languageVersion = lang.version;
    }
    apply_math_mode(options, fast_math_enabled());
    NSError* error = nil;
    library = [device newLibraryWithSource:text options:options error:&error];
    if (library == nil) {
      *message = error ? ns_to_std(error.localizedDescription) : std::string("no diagnostic");
    }
  }
  return library;
}

std::vector<std::string> function_names(id<MTLLibrary> library) {
  std::vector<std::string> out;
  @autoreleasepool {
    for (NSString* name in library.functionNames) {
      out.push_back(ns_to_std(name));
    }
  }
  return out;
}

// Reflection with every binding's index, name, size, type and use. MTLPipelineOptionBindingInfo
// replaces (and equals) MTLPipelineOptionArgumentInfo from the macOS 15 SDK on.
MTLPipelineOption reflection_options() {
#if TSM_SDK_HAS(150000)
  return static_cast<MTLPipelineOption>(MTLPipelineOptionBindingInfo |
                                        MTLPipelineOptionBufferTypeInfo);
#else
  return static_cast<MTLPipelineOption>(MTLPipelineOptionArgumentInfo |
                                        MTLPipelineOptionBufferTypeInfo);
#endif
}

enum class PipelineFailure { None, UnknownKernel, CreationFailed };

// Fills `kernel` with the pipeline and its reflection; on failure returns why and fills
// `message` (never throws inside the pool).
PipelineFailure make_kernel(id<MTLDevice> device, id<MTLLibrary> library,
                            const std::string& name, Kernel* kernel, std::string* message) {
  @autoreleasepool {
    NSString* ns_name = [[NSString alloc] initWithBytes:name.data()
                                                 length:name.size()
                                               encoding:NSUTF8StringEncoding];
    id<MTLFunction> function = ns_name ? [library newFunctionWithName:ns_name] : nil;
    if (function == nil) {
      return PipelineFailure::UnknownKernel;
    }
    if (@available(macOS 13.0, *)) {
      MTLAutoreleasedComputePipelineReflection reflection = nil;
      NSError* error = nil;
      id<MTLComputePipelineState> pipeline =
          [device newComputePipelineStateWithFunction:function
                                              options:reflection_options()
                                           reflection:&reflection
                                                error:&error];
      if (pipeline == nil || reflection == nil) {
        *message = error ? ns_to_std(error.localizedDescription) : std::string("no diagnostic");
        return PipelineFailure::CreationFailed;
      }
      kernel->pipeline = pipeline;
      kernel->max_total_threads = static_cast<uint64_t>(pipeline.maxTotalThreadsPerThreadgroup);
      kernel->thread_execution_width = static_cast<uint64_t>(pipeline.threadExecutionWidth);
      kernel->static_threadgroup_memory =
          static_cast<uint64_t>(pipeline.staticThreadgroupMemoryLength);
      for (id<MTLBinding> binding in reflection.bindings) {
        Parameter p;
        p.index = static_cast<uint64_t>(binding.index);
        p.name = ns_to_std(binding.name);
        p.used = binding.used;
        if (binding.type == MTLBindingTypeBuffer) {
          id<MTLBufferBinding> buffer = (id<MTLBufferBinding>)binding;
          p.size = static_cast<uint64_t>(buffer.bufferDataSize);
          p.data_type = static_cast<int64_t>(buffer.bufferDataType);
          kernel->buffers.push_back(p);
        } else if (binding.type == MTLBindingTypeThreadgroupMemory) {
          id<MTLThreadgroupBinding> memory = (id<MTLThreadgroupBinding>)binding;
          p.size = static_cast<uint64_t>(memory.threadgroupMemoryDataSize);
          kernel->threadgroups.push_back(p);
        }
      }
    } else {
      // Unreachable in practice: torch's MPS backend itself needs a newer macOS.
      *message = "pipeline reflection (MTLBinding) needs macOS 13 or later";
      return PipelineFailure::CreationFailed;
    }
  }
  const auto by_index = [](const Parameter& a, const Parameter& b) { return a.index < b.index; };
  std::sort(kernel->buffers.begin(), kernel->buffers.end(), by_index);
  std::sort(kernel->threadgroups.begin(), kernel->threadgroups.end(), by_index);
  kernel->buffer_slots = kernel->buffers.empty() ? 0 : kernel->buffers.back().index + 1;
  kernel->threadgroup_slots =
      kernel->threadgroups.empty() ? 0 : kernel->threadgroups.back().index + 1;
  return PipelineFailure::None;
}

Library* library_for(id<MTLDevice> device, const py::str& source) {
  Caches& c = caches();
  PyObject* key = source.ptr();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto hit = c.by_object.find(key);
    if (hit != c.by_object.end()) {
      return hit->second.second;
    }
  }
  const std::string text = source;  // UTF-8
  std::lock_guard<std::mutex> lock(c.mutex);
  Library* lib = nullptr;
  auto found = c.by_source.find(text);
  if (found != c.by_source.end()) {
    lib = found->second.get();
  } else {
    std::string message;
    id<MTLLibrary> compiled = compile_library(device, text, &message);
    if (compiled == nil) {
      throw CompileFailure(message);
    }
    auto entry = std::make_unique<Library>();
    entry->library = compiled;
    lib = entry.get();
    c.by_source.emplace(text, std::move(entry));
  }
  if (c.by_object.size() >= kMaxIdentityEntries) {
    c.by_object.clear();  // sources built afresh on every call: keep the fast path bounded
  }
  c.by_object.emplace(key, std::make_pair(py::reinterpret_borrow<py::object>(source), lib));
  return lib;
}

const Kernel& kernel_for(id<MTLDevice> device, Library* lib, const std::string& kernel) {
  Caches& c = caches();
  std::lock_guard<std::mutex> lock(c.mutex);
  auto found = lib->kernels.find(kernel);
  if (found != lib->kernels.end()) {
    return found->second;
  }
  Kernel k;
  std::string message;
  const PipelineFailure failure = make_kernel(device, lib->library, kernel, &k, &message);
  if (failure == PipelineFailure::UnknownKernel) {
    std::string names;
    for (const std::string& name : function_names(lib->library)) {
      names += (names.empty() ? "" : ", ") + name;
    }
    throw py::value_error("_metal_launcher: no kernel named '" + kernel +
                          "' in the shader; it defines: " + names);
  }
  if (failure != PipelineFailure::None) {
    throw std::runtime_error("_metal_launcher: could not create the compute pipeline for '" +
                             kernel + "': " + message);
  }
  return lib->kernels.emplace(kernel, std::move(k)).first->second;
}

// ---------------------------------------------------------------------------------------
// Arguments.
// ---------------------------------------------------------------------------------------

struct Binding {
  bool is_none = false;  // None: a gap in the kernel's [[buffer(i)]] indices, bound to nothing
  bool is_tensor = false;
  at::Tensor tensor;  // keeps the storage alive until the dispatch is encoded
  NSUInteger offset = 0;
  std::string bytes;
};

std::string where(const std::string& kernel, size_t index) {
  return "_metal_launcher(" + kernel + "): argument " + std::to_string(index);
}

std::vector<Binding> parse_args(const std::string& kernel, const py::list& args) {
  if (args.size() > kMaxBufferArguments) {
    throw py::value_error("_metal_launcher(" + kernel + "): " + std::to_string(args.size()) +
                          " arguments; Metal binds at most " +
                          std::to_string(kMaxBufferArguments) + " buffers");
  }
  std::vector<Binding> out;
  out.reserve(args.size());
  size_t i = 0;
  for (const py::handle item : args) {
    Binding b;
    if (item.is_none()) {
      b.is_none = true;
    } else if (THPVariable_Check(item.ptr())) {
      const at::Tensor& t = THPVariable_Unpack(item.ptr());
      if (!t.defined()) {
        throw py::value_error(where(kernel, i) + " is an undefined tensor");
      }
      if (!t.is_mps()) {
        throw py::value_error(where(kernel, i) + " is a tensor on '" + t.device().str() +
                              "'; the Metal launcher needs tensors on 'mps'");
      }
      b.is_tensor = true;
      b.tensor = t;
      b.offset = static_cast<NSUInteger>(t.storage_offset()) *
                 static_cast<NSUInteger>(t.element_size());
    } else if (PyBytes_Check(item.ptr())) {
      char* data = nullptr;
      Py_ssize_t size = 0;
      if (PyBytes_AsStringAndSize(item.ptr(), &data, &size) != 0) {
        throw py::error_already_set();
      }
      if (size <= 0 || static_cast<size_t>(size) > kMaxSetBytesLength) {
        throw py::value_error(where(kernel, i) + " has " + std::to_string(size) +
                              " bytes; setBytes takes 1 to " +
                              std::to_string(kMaxSetBytesLength));
      }
      b.bytes.assign(data, static_cast<size_t>(size));
    } else {
      throw py::type_error(where(kernel, i) + " must be a torch.Tensor on 'mps' or bytes, got " +
                           std::string(Py_TYPE(item.ptr())->tp_name));
    }
    out.push_back(std::move(b));
    ++i;
  }
  return out;
}

// The arguments against the pipeline's reflection. torch's compute encoder is shared by
// every op on the stream, so an argument index left unbound, or a threadgroup length left
// unset, would silently hand the kernel whatever the previous dispatch set there.
// (torch_sparse_metal._metal_backend checks the same first, with the emulator's messages;
// these guard the extension's own entry point.)
void check_bindings(const std::string& kernel, const Kernel& k,
                    const std::vector<Binding>& bindings, const std::vector<uint64_t>& tg) {
  if (bindings.size() != k.buffer_slots) {
    throw py::value_error("_metal_launcher(" + kernel + "): expected " +
                          std::to_string(k.buffer_slots) +
                          " arguments (one per [[buffer(i)]]), got " +
                          std::to_string(bindings.size()));
  }
  std::vector<const Parameter*> declared(k.buffer_slots, nullptr);
  for (const Parameter& p : k.buffers) {
    declared[p.index] = &p;
  }
  for (size_t i = 0; i < bindings.size(); ++i) {
    const Parameter* p = declared[i];
    if ((p == nullptr) != bindings[i].is_none) {
      throw py::value_error(where(kernel, i) + (p ? " is None; the kernel declares [[buffer("
                                                  : " is not None; the kernel declares no [[buffer(") +
                            std::to_string(i) + ")]]");
    }
    if (p == nullptr || !p->used) continue;  // unused: still bound, whatever its size
    // One value of the declared type, or a table of them for a `constant T*` (reflection
    // gives the pointee's size and cannot tell a pointer from a reference; the Python side
    // passes tables only to pointers, and a reference reads its first value).
    const size_t length = bindings[i].bytes.size();
    if (!bindings[i].is_tensor && (p->size == 0 || length % p->size != 0)) {
      throw py::value_error(where(kernel, i) + " (`" + p->name + "`) is " +
                            std::to_string(length) + " bytes; the kernel declares " +
                            std::to_string(p->size) + " (or a table of values of that size)");
    }
  }
  if (tg.size() < k.threadgroup_slots) {
    throw py::value_error("_metal_launcher(" + kernel + "): threadgroup_memory must give the " +
                          "byte length of each of its " + std::to_string(k.threadgroup_slots) +
                          " [[threadgroup(n)]] parameters, got " + std::to_string(tg.size()));
  }
}

std::vector<uint64_t> dims3(const std::vector<int64_t>& v, const char* what, int64_t minimum,
                            const std::string& kernel) {
  if (v.size() != 3) {
    throw py::value_error("_metal_launcher(" + kernel + "): " + what + " must have 3 entries");
  }
  std::vector<uint64_t> out;
  for (int64_t d : v) {
    if (d < minimum) {
      throw py::value_error("_metal_launcher(" + kernel + "): " + what + " entries must be >= " +
                            std::to_string(minimum) + ", got " + std::to_string(d));
    }
    out.push_back(static_cast<uint64_t>(d));
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// The Python entry points.
// ---------------------------------------------------------------------------------------

std::vector<std::string> py_kernel_names(const py::str& source) {
  return function_names(library_for(metal_device(), source)->library);
}

py::dict py_pipeline_info(const py::str& source, const std::string& kernel) {
  id<MTLDevice> device = metal_device();
  const Kernel& k = kernel_for(device, library_for(device, source), kernel);
  py::list buffers;
  for (const Parameter& p : k.buffers) {
    buffers.append(py::make_tuple(p.index, p.name, p.size, p.data_type, p.used));
  }
  py::list threadgroups;
  for (const Parameter& p : k.threadgroups) {
    threadgroups.append(py::make_tuple(p.index, p.name, p.size));
  }
  py::dict d;
  d["buffers"] = buffers;
  d["threadgroups"] = threadgroups;
  d["max_total_threads_per_threadgroup"] = k.max_total_threads;
  d["thread_execution_width"] = k.thread_execution_width;
  d["static_threadgroup_memory"] = k.static_threadgroup_memory;
  return d;
}

void py_dispatch(const py::str& source, const std::string& kernel, const py::list& args,
                 const std::vector<int64_t>& threads, const std::vector<int64_t>& group_size,
                 const std::vector<int64_t>& threadgroup_memory) {
  // 1. Validate everything that needs no GPU.
  const std::vector<uint64_t> grid = dims3(threads, "threads", 0, kernel);
  const std::vector<uint64_t> group = dims3(group_size, "group_size", 1, kernel);
  if (threadgroup_memory.size() > kMaxThreadgroupArguments) {
    throw py::value_error("_metal_launcher(" + kernel + "): at most " +
                          std::to_string(kMaxThreadgroupArguments) +
                          " threadgroup memory arguments");
  }
  std::vector<uint64_t> tg_lengths;
  for (int64_t n : threadgroup_memory) {
    if (n < 0 || n % kThreadgroupMemoryAlignment != 0) {
      throw py::value_error("_metal_launcher(" + kernel + "): threadgroup_memory lengths " +
                            "must be non-negative multiples of 16, got " + std::to_string(n));
    }
    tg_lengths.push_back(static_cast<uint64_t>(n));
  }
  std::vector<Binding> bindings = parse_args(kernel, args);

  // 2. Nothing to run.
  if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {
    return;
  }

  // 3. Library and pipeline (compiled once, then cached), and the limits they imply.
  id<MTLDevice> device = metal_device();
  const DeviceProbe& dev = device_probe();
  Library* lib = library_for(device, source);
  const Kernel& k = kernel_for(device, lib, kernel);
  check_bindings(kernel, k, bindings, tg_lengths);

  const uint64_t group_threads = group[0] * group[1] * group[2];
  if (group_threads > k.max_total_threads || group[0] > dev.max_threads_per_threadgroup.width ||
      group[1] > dev.max_threads_per_threadgroup.height ||
      group[2] > dev.max_threads_per_threadgroup.depth) {
    throw py::value_error(
        "_metal_launcher(" + kernel + "): threadgroup " + std::to_string(group[0]) + "x" +
        std::to_string(group[1]) + "x" + std::to_string(group[2]) + " (" +
        std::to_string(group_threads) + " threads) exceeds the pipeline's " +
        "maxTotalThreadsPerThreadgroup " + std::to_string(k.max_total_threads) +
        " or the device's per-dimension limit " +
        std::to_string(dev.max_threads_per_threadgroup.width) + "x" +
        std::to_string(dev.max_threads_per_threadgroup.height) + "x" +
        std::to_string(dev.max_threads_per_threadgroup.depth));
  }
  uint64_t tg_total = k.static_threadgroup_memory;
  for (const Parameter& p : k.threadgroups) {
    tg_total += tg_lengths[p.index];
  }
  if (tg_total > dev.max_threadgroup_memory) {
    throw py::value_error("_metal_launcher(" + kernel + "): " + std::to_string(tg_total) +
                          " bytes of threadgroup memory (" +
                          std::to_string(k.static_threadgroup_memory) +
                          " static + the dynamic lengths) exceed the device limit of " +
                          std::to_string(dev.max_threadgroup_memory));
  }
#if TSM_TORCH_PROFILER
  // The tensors, for the profiler's description of the dispatch (as torch's ops give it).
  std::vector<at::Tensor> tensors;
  for (const Binding& b : bindings) {
    if (b.is_tensor) {
      tensors.push_back(b.tensor);
    }
  }
#endif

  // 4. Encode on torch's current stream, in its serial queue, on its shared encoder.
  id<MTLComputePipelineState> pipeline = k.pipeline;
  const MTLSize grid_size = MTLSizeMake(grid[0], grid[1], grid[2]);
  const MTLSize group_dims = MTLSizeMake(group[0], group[1], group[2]);
  // Blocks capture by copy: pointers to what outlives dispatch_sync.
  const std::vector<Binding>* bound = &bindings;
  const std::vector<Parameter>* tg_params = &k.threadgroups;
  const std::vector<uint64_t>* tg = &tg_lengths;
#if TSM_TORCH_PROFILER
  const std::vector<at::Tensor>* profiled = &tensors;
  const std::string* name = &kernel;
#endif
  std::exception_ptr failure;
  std::exception_ptr* failure_out = &failure;
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  {
    // Tensors are held by `bindings`; no Python object is touched while the GIL is released.
    py::gil_scoped_release no_gil;
    dispatch_sync(stream->queue(), ^{
      @autoreleasepool {
        try {
          id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
#if TSM_TORCH_PROFILER
          // A no-op unless torch.mps.profiler (or PYTORCH_MPS_LOG_PROFILE_INFO) is on; keyed
          // by the pipeline, as torch's own Metal kernels are.
          at::mps::getMPSProfiler().beginProfileKernel((__bridge const void*)pipeline, *name,
                                                       *profiled);
#endif
          [encoder setComputePipelineState:pipeline];
          for (size_t i = 0; i < bound->size(); ++i) {
            const Binding& b = (*bound)[i];
            if (b.is_none) {
              continue;  // no parameter reads this index (check_bindings)
            } else if (b.is_tensor) {
              // The storage's data pointer is its id<MTLBuffer> (nil for an empty storage,
              // which binds a null pointer the kernel must not dereference).
              id<MTLBuffer> buffer = __builtin_bit_cast(id<MTLBuffer>, b.tensor.storage().data());
              [encoder setBuffer:buffer offset:b.offset atIndex:i];
            } else {
              [encoder setBytes:b.bytes.data() length:b.bytes.size() atIndex:i];
            }
          }
          for (const Parameter& p : *tg_params) {  // every declared one, 0 included
            [encoder setThreadgroupMemoryLength:(*tg)[p.index] atIndex:p.index];
          }
          [encoder dispatchThreads:grid_size threadsPerThreadgroup:group_dims];
#if TSM_TORCH_PROFILER
          at::mps::getMPSProfiler().endProfileKernel((__bridge const void*)pipeline);
#endif
        } catch (...) {  // an exception must not unwind through libdispatch
          *failure_out = std::current_exception();
        }
      }
    });
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
}

py::dict py_device_info() {
  metal_device();  // clear error when there is no MPS device
  const DeviceProbe& p = device_probe();
  py::dict d;
  d["name"] = p.name;
  d["supports_apple7"] = p.apple7;
  d["supports_metal3"] = p.metal3;
  d["max_threads_per_threadgroup"] = static_cast<uint64_t>(p.max_threads_per_threadgroup.width);
  d["max_threads_per_threadgroup_xyz"] =
      py::make_tuple(static_cast<uint64_t>(p.max_threads_per_threadgroup.width),
                     static_cast<uint64_t>(p.max_threads_per_threadgroup.height),
                     static_cast<uint64_t>(p.max_threads_per_threadgroup.depth));
  d["max_threadgroup_memory"] = p.max_threadgroup_memory;
  d["recommended_max_working_set_size"] = p.recommended_max_working_set_size;
  d["metal_language_version"] = std::string(language_version().name);
  d["fast_math"] = fast_math_enabled();
  return d;
}


// ---------------------------------------------------------------------------------------
// Benchmark baseline: Apple's MPSMatrixMultiplication on the same MPS tensors.
//
// mps_matmul(left, right, result, transpose_left, transpose_right, alpha, beta) encodes
//   result = alpha * op(left) @ op(right) + beta * result
// on torch's current MPS stream. Each matrix is passed as stored: 2-D, row-major (last
// stride 1) with any row stride (rowBytes), at its storage offset; op() transposes when
// asked. MPS kernels encode into a command buffer, not into a compute encoder, so inside
// the stream's queue the shared compute encoder is first closed with torch's own
// endKernelCoalescing() (as torch's MPS linear-algebra ops do before their MPS kernels);
// the command buffer is stream->commandBuffer(), and, as for our kernels, nothing here
// submits it: torch does when it synchronises.
//
// The classes are looked up with NSClassFromString: torch's MPS backend already loads
// MetalPerformanceShaders.framework; if it has not, it is dlopen'ed once.
// ---------------------------------------------------------------------------------------

Class mps_class(const char* name) {
  NSString* ns_name = [NSString stringWithUTF8String:name];
  Class cls = NSClassFromString(ns_name);
  if (cls == nil) {
    static void* handle = dlopen(
        "/System/Library/Frameworks/MetalPerformanceShaders.framework/MetalPerformanceShaders",
        RTLD_LAZY | RTLD_GLOBAL);
    (void)handle;
    cls = NSClassFromString(ns_name);
  }
  if (cls == nil) {
    throw std::runtime_error(std::string("_metal_launcher.mps_matmul: class ") + name +
                             " not found (MetalPerformanceShaders.framework unavailable)");
  }
  return cls;
}

struct StoredMatrix {
  id<MTLBuffer> buffer = nil;
  NSUInteger offset = 0;
  NSUInteger rows = 0, columns = 0, row_bytes = 0;
};

StoredMatrix stored_matrix(const at::Tensor& t, const char* what) {
  if (!t.defined() || !t.is_mps()) {
    throw py::value_error(std::string("_metal_launcher.mps_matmul: ") + what +
                          " must be a tensor on 'mps'");
  }
  if (t.dim() != 2 || (t.size(1) > 1 && t.stride(1) != 1) ||
      (t.size(0) > 1 && t.stride(0) < t.size(1))) {
    throw py::value_error(std::string("_metal_launcher.mps_matmul: ") + what +
                          " must be a row-major 2-D tensor (last stride 1); pass a transposed "
                          "view's base with transpose_* set instead");
  }
  StoredMatrix m;
  m.buffer = __builtin_bit_cast(id<MTLBuffer>, t.storage().data());
  m.offset = static_cast<NSUInteger>(t.storage_offset()) * static_cast<NSUInteger>(t.element_size());
  m.rows = static_cast<NSUInteger>(t.size(0));
  m.columns = static_cast<NSUInteger>(t.size(1));
  const int64_t row_stride = t.size(0) > 1 ? t.stride(0) : t.size(1);
  m.row_bytes = static_cast<NSUInteger>(row_stride) * static_cast<NSUInteger>(t.element_size());
  return m;
}

using MpsKey = std::tuple<NSUInteger, NSUInteger, NSUInteger, bool, bool, double, double>;

void py_mps_matmul(const at::Tensor& left, const at::Tensor& right, const at::Tensor& result,
                   bool transpose_left, bool transpose_right, double alpha, double beta) {
  if (left.scalar_type() != right.scalar_type() || left.scalar_type() != result.scalar_type()) {
    throw py::value_error("_metal_launcher.mps_matmul: left, right and result must share a dtype");
  }
  MPSDataType data_type;
  if (left.scalar_type() == at::kFloat) {
    data_type = MPSDataTypeFloat32;
  } else if (left.scalar_type() == at::kHalf) {
    data_type = MPSDataTypeFloat16;
  } else {
    throw py::value_error("_metal_launcher.mps_matmul: float32 or float16 tensors only");
  }
  const StoredMatrix a = stored_matrix(left, "left");
  const StoredMatrix b = stored_matrix(right, "right");
  const StoredMatrix c = stored_matrix(result, "result");
  // op(A) is M x K, op(B) is K x N, C is M x N.
  const NSUInteger m = transpose_left ? a.columns : a.rows;
  const NSUInteger k = transpose_left ? a.rows : a.columns;
  const NSUInteger k_b = transpose_right ? b.columns : b.rows;
  const NSUInteger n = transpose_right ? b.rows : b.columns;
  if (k != k_b || c.rows != m || c.columns != n) {
    throw py::value_error("_metal_launcher.mps_matmul: shapes do not match: op(left) is " +
                          std::to_string(m) + "x" + std::to_string(k) + ", op(right) is " +
                          std::to_string(k_b) + "x" + std::to_string(n) + ", result is " +
                          std::to_string(c.rows) + "x" + std::to_string(c.columns));
  }
  if (m == 0 || n == 0) {
    return;
  }
  id<MTLDevice> device = metal_device();

  // Kernels are cached per shape, transposes and scalars (they are baked in at init).
  static std::mutex kernels_mutex;
  static std::map<MpsKey, MPSMatrixMultiplication*>* kernels =
      new std::map<MpsKey, MPSMatrixMultiplication*>();  // never destroyed, like the caches
  MPSMatrixMultiplication* kernel = nil;
  {
    std::lock_guard<std::mutex> lock(kernels_mutex);
    const MpsKey key{m, n, k, transpose_left, transpose_right, alpha, beta};
    auto found = kernels->find(key);
    if (found != kernels->end()) {
      kernel = found->second;
    } else {
      Class kernel_class = mps_class("MPSMatrixMultiplication");  // may throw: outside the pool
      @autoreleasepool {
        kernel = [(MPSMatrixMultiplication*)[kernel_class alloc] initWithDevice:device
                                                                  transposeLeft:transpose_left
                                                                 transposeRight:transpose_right
                                                                     resultRows:m
                                                                  resultColumns:n
                                                                interiorColumns:k
                                                                          alpha:alpha
                                                                           beta:beta];
      }
      if (kernel == nil) {
        throw std::runtime_error("_metal_launcher.mps_matmul: MPSMatrixMultiplication init failed");
      }
      kernels->emplace(key, kernel);
    }
  }

  if (@available(macOS 10.15, *)) {
  } else {
    throw std::runtime_error("_metal_launcher.mps_matmul: needs macOS 10.15 (MPSMatrix "
                             "initWithBuffer:offset:descriptor:)");
  }
  Class descriptor_class = mps_class("MPSMatrixDescriptor");
  Class matrix_class = mps_class("MPSMatrix");
  // Blocks cannot capture arrays: one pointer per operand. `left`, `right` and `result`
  // keep the storages alive until dispatch_sync returns.
  const StoredMatrix* pa = &a;
  const StoredMatrix* pb = &b;
  const StoredMatrix* pc = &c;
  std::exception_ptr failure;
  std::exception_ptr* failure_out = &failure;
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  {
    py::gil_scoped_release no_gil;
    dispatch_sync(stream->queue(), ^{
      @autoreleasepool {
        try {
          const StoredMatrix* operands[3] = {pa, pb, pc};
          MPSMatrix* matrices[3];
          for (int i = 0; i < 3; ++i) {
            const StoredMatrix* s = operands[i];
            MPSMatrixDescriptor* d = [descriptor_class matrixDescriptorWithRows:s->rows
                                                                        columns:s->columns
                                                                       rowBytes:s->row_bytes
                                                                       dataType:data_type];
            if (@available(macOS 10.15, *)) {
              matrices[i] = [(MPSMatrix*)[matrix_class alloc] initWithBuffer:s->buffer
                                                                      offset:s->offset
                                                                  descriptor:d];
            }
            if (d == nil || matrices[i] == nil) {
              throw std::runtime_error("_metal_launcher.mps_matmul: could not describe an "
                                       "operand as an MPSMatrix");
            }
          }
          stream->endKernelCoalescing();
          [kernel encodeToCommandBuffer:stream->commandBuffer()
                             leftMatrix:matrices[0]
                            rightMatrix:matrices[1]
                           resultMatrix:matrices[2]];
        } catch (...) {
          *failure_out = std::current_exception();
        }
      }
    });
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Encodes Metal compute dispatches on torch's current MPS stream (see launcher.mm).";
  py::register_exception<CompileFailure>(m, "CompileError", PyExc_RuntimeError);
  m.def("kernel_names", &py_kernel_names, py::arg("source"),
        "kernel_names(source): compile `source` once (CompileError with the compiler's output "
        "if Metal rejects it) and list the kernels it defines.");
  m.def("pipeline_info", &py_pipeline_info, py::arg("source"), py::arg("kernel"),
        "pipeline_info(source, kernel): the pipeline's reflection, cached with it: buffers "
        "[(index, name, data size, MTLDataType, used)], threadgroups [(index, name, data "
        "size)], max_total_threads_per_threadgroup, thread_execution_width, "
        "static_threadgroup_memory.");
  m.def("dispatch", &py_dispatch, py::arg("source"), py::arg("kernel"), py::arg("args"),
        py::arg("threads"), py::arg("group_size"),
        py::arg("threadgroup_memory") = std::vector<int64_t>{},
        "dispatch(source, kernel, args, threads, group_size, threadgroup_memory=[]): compile "
        "`source` once, then encode dispatchThreads(threads, group_size) of `kernel` on the "
        "current MPS stream. args[i] binds [[buffer(i)]], one per declared index: an mps "
        "tensor (at its storage offset), or the bytes of one value of the declared type or of "
        "a table of them, under 4 KB (setBytes). threadgroup_memory[n] is the byte length (a multiple of 16) of "
        "[[threadgroup(n)]], one per declared index. Does not commit.");
  m.def("mps_matmul", &py_mps_matmul, py::arg("left"), py::arg("right"), py::arg("result"),
        py::arg("transpose_left") = false, py::arg("transpose_right") = false,
        py::arg("alpha") = 1.0, py::arg("beta") = 0.0,
        "mps_matmul(left, right, result, transpose_left=False, transpose_right=False, "
        "alpha=1.0, beta=0.0): the benchmark baseline. Encodes Apple's "
        "MPSMatrixMultiplication, result = alpha * op(left) @ op(right) + beta * result, on "
        "the current MPS stream (float32 or float16, row-major tensors at their storage "
        "offsets). Does not submit the command buffer.");
  m.def("device_info", &py_device_info,
        "The Metal device's name, supports_apple7 (simdgroup_matrix), supports_metal3 "
        "(atomic_float), max_threads_per_threadgroup, max_threadgroup_memory, "
        "recommended_max_working_set_size, and the MSL version and fast-math setting used.");
}
