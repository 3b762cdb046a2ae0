// Shared by every shader in this directory. Compiled by Metal and by the emulator.
#pragma once

// A kernel's signature is written once, as a template; each dtype gets an explicit
// instantiation registered under a host name built the way the Python side builds it
// (torch_sparse_metal/_kernel_names.py: "<base>_<dtype>").
#define TSM_INSTANTIATE_KERNEL(host_name_string, func, ...)                     \
  template [[host_name(host_name_string)]] [[kernel]] decltype(func<__VA_ARGS__>) \
      func<__VA_ARGS__>;

// Metal has no double. The emulator defines __METAL_EMULATOR__ and gets double
// instantiations so torch.autograd.gradcheck can run in float64 through the kernels.
#ifdef __METAL_EMULATOR__
#define TSM_EMULATOR_ONLY(...) __VA_ARGS__
#else
#define TSM_EMULATOR_ONLY(...)
#endif
