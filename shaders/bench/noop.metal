// A kernel that does nothing, for measuring what a launch costs around it
// (python -m torch_sparse_metal.bench ops). Not used by any op.
#include <metal_stdlib>
using namespace metal;

kernel void noop(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {}
