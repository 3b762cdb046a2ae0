// Runs the kernels of kernels.metal (as the emulator translates them) through the runtime's
// C interface and checks their results; test_aarch64_qemu.py builds it for AArch64 and runs
// it under qemu-user. Prints "ok <check>" for each check that passes and "FAIL <check>: ..."
// for each that does not; exits with 1 if any failed.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "c_interface.h"
#include "canary.h"

typedef unsigned int uint;

namespace {

int failures = 0;

void report(const char* check, bool ok, const std::string& detail = "") {
  if (ok) {
    std::printf("ok %s\n", check);
  } else {
    std::printf("FAIL %s: %s\n", check, detail.c_str());
    ++failures;
  }
  std::fflush(stdout);
}

int kernel_index(const char* name) {
  for (int k = 0; k < tsm_num_kernels(); ++k)
    if (std::strcmp(tsm_kernel_name(k), name) == 0) return k;
  std::printf("FAIL setup: no kernel %s in the library\n", name);
  std::exit(1);
}

// One dispatch of a 1-D grid, buffers bound in [[buffer(i)]] order.
class Dispatch {
 public:
  Dispatch(uint32_t threads, uint32_t group_size, int workers = 1) {
    launch_.grid[0] = threads;
    launch_.group[0] = group_size;
    launch_.grid[1] = launch_.grid[2] = launch_.group[1] = launch_.group[2] = 1;
    launch_.num_workers = workers;
  }
  template <class T>
  Dispatch& buffer(std::vector<T>& v) {
    launch_.buffers[launch_.num_buffers] = v.data();
    launch_.buffer_bytes[launch_.num_buffers] = v.size() * sizeof(T);
    ++launch_.num_buffers;
    return *this;
  }
  // "" when the kernel ran, else the runtime's "kind\tmessage".
  std::string run(const char* kernel) {
    char error[2048] = "";
    return tsm_dispatch(kernel_index(kernel), &launch_, error, sizeof error) == 0 ? "" : error;
  }

 private:
  tsm_launch launch_{};
};

std::string ran(const std::string& error) { return error.empty() ? "" : "dispatch failed: " + error; }

void check_tree_sum() {
  const uint32_t groups = 16, n = 256;
  std::vector<float> x(groups * n), sums(groups, -1.0f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float((i * 7) % 13);
  std::string detail = ran(Dispatch(groups * n, n, 2).buffer(x).buffer(sums).run("tree_sum"));
  bool ok = detail.empty();
  for (uint32_t g = 0; ok && g < groups; ++g) {
    float expected = 0;
    for (uint32_t i = 0; i < n; ++i) expected += x[g * n + i];
    ok = sums[g] == expected;
    if (!ok) detail = "group " + std::to_string(g) + ": " + std::to_string(sums[g]) + " != " + std::to_string(expected);
  }
  report("tree_sum", ok, detail);
}

void check_simd_collectives() {
  const uint32_t threads = 256;
  std::vector<int> x(threads), out(8 * threads, -7);
  for (uint32_t i = 0; i < threads; ++i) x[i] = int((i * 37) % 101) - 50;
  std::string detail = ran(Dispatch(threads, 64, 2).buffer(x).buffer(out).run("simd_collectives"));
  bool ok = detail.empty();
  for (uint32_t i = 0; ok && i < threads; ++i) {
    const uint32_t lane = i % 32, first = i - lane;
    int sum = 0, prefix = 0;
    uint32_t odd = 0;
    for (uint32_t l = 0; l < 32; ++l) {
      sum += x[first + l];
      if (l < lane) prefix += x[first + l];
      if (x[first + l] & 1) odd |= 1u << l;
    }
    const int expected[8] = {sum,
                             x[first + (lane + 1) % 32],
                             x[first + (lane ^ 5u)],
                             lane + 3 < 32 ? x[i + 3] : x[i],
                             prefix,
                             int(odd),
                             lane < 12 ? 12 : -1,
                             32};
    for (int k = 0; ok && k < 8; ++k) {
      ok = out[8 * i + k] == expected[k];
      if (!ok)
        detail = "thread " + std::to_string(i) + " result " + std::to_string(k) + ": " +
                 std::to_string(out[8 * i + k]) + " != " + std::to_string(expected[k]);
    }
  }
  report("simd_collectives", ok, detail);
}

void check_atomics() {
  const uint32_t threads = 16384;
  std::vector<int> count(1, 0);
  std::vector<float> total(1, 0.0f), x(threads);
  std::vector<uint32_t> cas_total(1, 0);  // the bits of 0.0f
  for (uint32_t i = 0; i < threads; ++i) x[i] = float(i % 4);  // sums stay exact in float
  std::string error = Dispatch(threads, 256, 4).buffer(count).buffer(total).buffer(cas_total).buffer(x).run("atomics");
  float cas;
  std::memcpy(&cas, cas_total.data(), sizeof cas);
  const float expected = float(threads / 4 * (0 + 1 + 2 + 3));
  const bool ok = error.empty() && count[0] == int(threads) && total[0] == expected && cas == expected;
  report("atomics", ok,
         ran(error) + " count " + std::to_string(count[0]) + ", atomic_float " + std::to_string(total[0]) +
             ", CAS loop " + std::to_string(cas) + ", expected " + std::to_string(threads) + ", " +
             std::to_string(expected));
}

void check_canary() {
  const uint32_t threads = 256;
  std::vector<uint32_t> u(10 * threads);
  std::vector<float> f(4 * threads);
  std::vector<double> d(4 * threads);
  std::vector<uint32_t> eu(u.size());
  std::vector<float> ef(f.size());
  std::vector<double> ed(d.size());
  for (uint32_t gid = 0; gid < threads; ++gid) {
    CANARY_INIT(gid);
    for (uint step = 0; step < CANARY_STEPS; ++step) {
      CANARY_STEP(step);
    }
    CANARY_STORE(eu, ef, ed, gid);
  }
  std::string error = Dispatch(threads, 64, 2).buffer(u).buffer(f).buffer(d).run("canary");
  // Bit patterns: a lost register shows even where a value is NaN.
  const bool ok = error.empty() && std::memcmp(u.data(), eu.data(), u.size() * sizeof u[0]) == 0 &&
                  std::memcmp(f.data(), ef.data(), f.size() * sizeof f[0]) == 0 &&
                  std::memcmp(d.data(), ed.data(), d.size() * sizeof d[0]) == 0;
  std::string detail = ran(error);
  for (uint32_t i = 0; detail.empty() && !ok && i < threads; ++i)
    for (int k = 0; detail.empty() && k < 10; ++k)
      if (u[10 * i + k] != eu[10 * i + k] || (k < 4 && (std::memcmp(&f[4 * i + k], &ef[4 * i + k], 4) != 0 ||
                                                        std::memcmp(&d[4 * i + k], &ed[4 * i + k], 8) != 0)))
        detail = "thread " + std::to_string(i) + ", value " + std::to_string(k) + ": u " + std::to_string(u[10 * i + k]) +
                 " (expected " + std::to_string(eu[10 * i + k]) + ")" +
                 (k < 4 ? ", f " + std::to_string(f[4 * i + k]) + " (expected " + std::to_string(ef[4 * i + k]) +
                              "), d " + std::to_string(d[4 * i + k]) + " (expected " +
                              std::to_string(ed[4 * i + k]) + ")"
                        : "");
  report("canary", ok, detail);
}

void check_host_independent_arithmetic() {
  const float a = 1.0f + 1.0f / 4096;  // a * a = 1 + 2^-11 + 2^-24: the last bit is lost unless fused
  std::vector<float> x = {a, a, -(1.0f + 1.0f / 2048)}, out(3, -1.0f);
  std::vector<signed char> c = {-3};
  const _Float16 h = _Float16(1.0f + 1.0f / 64);  // likewise in half: 2^-12 lost unless kept in float
  std::vector<_Float16> hs = {h, h, _Float16(-(1.0f + 1.0f / 32))};
  std::string error = Dispatch(1, 1).buffer(x).buffer(c).buffer(hs).buffer(out).run("host_independent_arithmetic");
  const bool ok = error.empty() && out[0] == 0.0f && out[1] == -3.0f && out[2] == 0.0f;
  report("host_independent_arithmetic", ok,
         ran(error) + " a*b+c " + std::to_string(out[0]) + " (0 unfused), char " + std::to_string(out[1]) +
             " (-3 signed), half " + std::to_string(out[2]) + " (0 rounded per operation)");
}

// A fault is a "crash" whose message names what happened; the next dispatch works.
void check_fault(const char* check, const char* kernel, std::vector<Dispatch> dispatches, const char* kind,
                 const char* what, const char* thread) {
  bool ok = true;
  std::string detail;
  for (Dispatch& d : dispatches) {
    for (int again = 0; again < 2 && ok; ++again) {  // the worker that faulted is usable afterwards
      const std::string error = d.run(kernel);
      ok = error.rfind(std::string(kind) + "\t", 0) == 0 && error.find(what) != std::string::npos &&
           error.find(thread) != std::string::npos;
      if (!ok) detail = "got \"" + error + "\", expected " + kind + ": " + what + " in " + thread;
    }
  }
  std::vector<int> out(1000, -1);
  std::string error = Dispatch(1000, 64).buffer(out).run("fill");
  for (int i = 0; ok && i < 1000; ++i) ok = out[i] == i;
  if (!ok && detail.empty()) detail = "the next dispatch failed: " + ran(error);
  report(check, ok, detail);
}

void check_faults() {
  std::vector<float> floats(100);
  std::vector<int> ints(100);
  std::vector<void*> null_pointer(1, nullptr);
  // An access outside its buffer is stopped by the bounds check.
  check_fault("fault_wild_write", "wild_write", {Dispatch(100, 32).buffer(floats)}, "out_of_bounds",
              "accesses [[buffer(0)]] at element 400000077", "thread (77, 0, 0)");
  check_fault("fault_null_read", "read_through_null", {Dispatch(100, 32).buffer(ints).buffer(null_pointer)},
              "crash", "invalid memory access (SIG", "thread (3, 0, 0)");
  check_fault("fault_stack_overflow", "overflow_fiber_stack", {Dispatch(64, 32).buffer(ints)}, "crash",
              "fiber stack overflow (SIG", "thread (");
  check_fault("fault_trap", "trap", {Dispatch(100, 32).buffer(ints)}, "crash",
              "trap or illegal instruction (SIG", "thread (9, 0, 0)");
}

}  // namespace

int main() {
  check_tree_sum();
  check_simd_collectives();
  check_atomics();
  check_canary();
  check_host_independent_arithmetic();
  check_faults();
  return failures ? 1 : 0;
}
