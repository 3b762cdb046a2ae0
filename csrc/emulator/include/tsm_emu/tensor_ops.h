// Metal 4's MetalPerformancePrimitives `mpp::tensor_ops::matmul2d` (MSL 4.0) on cooperative
// tensors, run by one SIMD-group (`metal::execution_simdgroup`): what MLX's `*_nax` kernels use.
// Not emulated, each a compile error naming it: `metal::tensor` operands (tensor_handle,
// tensor_inline, slices), `execution_simdgroups<N>` for N > 1, `execution_thread`, the
// reductions, and shapes that are not whole 16x16 fragments.
//
// A cooperative tensor's layout is implementation defined (Apple: "depends on operation, data
// type, number of threads"; `get_multidimensional_index` tells where element i is). The
// emulator uses the layout MLX's nax kernels hard-code for 16x32 operands on the GPUs they
// run on (steel/gemm/nax.h, `BaseNAXFrag`): an operand of R x C elements as it is stored (the
// left M x K, or K x M when transposed; the right K x N, or N x K; the destination M x N) is
// cut into 16x16 fragments in row-major order, 8 elements of each per lane, and lane l holds
// rows r0 and r0 + 8 of its fragment, columns c0 .. c0 + 3, where q = l / 4,
// r0 = (q & 4) | (l / 2) % 4, c0 = ((q & 2) | l % 2) * 4: element 8f + 4h + j is row
// r0 + 8h, column c0 + j of fragment f. Code that uses get_multidimensional_index works with
// any layout; code that assumes one (as MLX's) is right here only where that layout is the
// GPU's: Apple documents none, and older GPUs differ.
//
// `run` is a SIMD-group collective: the lanes exchange their left and right elements and each
// computes its own destination elements, products accumulated in float (int for 8-bit
// integers) in k order with one rounding per step, the destination's value first when the
// mode is multiply_accumulate. `relaxed_precision` lets Apple's implementation compute with
// less precision; the emulator does not.
#pragma once

#include <cstring>
#include <type_traits>

#include "tsm_emu/array.h"
#include "tsm_emu/runtime.h"
#include "tsm_emu/simdgroup_matrix.h"
#include "tsm_emu/thread_array.h"
#include "tsm_emu/types.h"

namespace metal {

template <size_t N>
class execution_simdgroups {
  static_assert(N > 0, "execution_simdgroups<0> does not exist");

 public:
  static constexpr size_t static_size = N;
  constexpr uint size() const { return N; }
};
template <size_t N>
class execution_threads {
  static_assert(N == 1, "only execution_threads<1> (execution_thread) exists");

 public:
  static constexpr size_t static_size = N;
  constexpr uint size() const { return N; }
};
using execution_simdgroup = execution_simdgroups<1>;
using execution_thread = execution_threads<1>;

namespace tensor_ops_detail {
enum class operand { left, right, destination };

// The layout of a cooperative operand of Rows x Cols elements as stored (see the top).
template <operand Role, int Rows, int Cols, class Coord>
struct layout {
  static_assert(Rows % 16 == 0 && Cols % 16 == 0,
                "the emulator's cooperative tensors are whole 16x16 fragments: matmul2d's M, N and K must be "
                "multiples of 16 (other shapes are not emulated)");
  static constexpr operand role = Role;
  static constexpr int rows = Rows, cols = Cols;
  static constexpr unsigned short capacity = Rows * Cols / 32;
  struct place {
    int row, col;
  };
  static place of(unsigned lane, unsigned i) {
    const unsigned q = lane / 4, f = i / 8, h = (i / 4) % 2, j = i % 4;
    const int r0 = int((q & 4u) | ((lane / 2) % 4)), c0 = int(((q & 2u) | (lane % 2)) * 4);
    const int fr = int(f) / (Cols / 16), fc = int(f) % (Cols / 16);
    return {fr * 16 + r0 + 8 * int(h), fc * 16 + c0 + int(j)};
  }
};

template <class Coord, size_t Cols, size_t Rows>
struct extents {
  using index_type = Coord;
  static constexpr size_t rank() { return 2; }
  static constexpr size_t static_extent(size_t r) { return r == 0 ? Cols : Rows; }
};
}  // namespace tensor_ops_detail

// Thread-private storage: each lane's share of the operand, `capacity` elements.
template <class ElementType, class Extents, class Layout>
class cooperative_tensor {
 public:
  using element_type = ElementType;
  using value_type = std::remove_cv_t<ElementType>;
  using extents_type = Extents;
  using layout = Layout;
  using index_type = typename Extents::index_type;
  using thread_index_type = unsigned short;

  static constexpr thread_index_type capacity = Layout::capacity;

  constexpr thread_index_type get_capacity() const { return capacity; }
  ElementType& operator[](thread_index_type i) {
    return elements_[tsm_emu::in_bounds<capacity>(i, "cooperative_tensor", nullptr, 0)];
  }
  const ElementType& operator[](thread_index_type i) const {
    return elements_[tsm_emu::in_bounds<capacity>(i, "cooperative_tensor", nullptr, 0)];
  }
  // Every element of every lane is valid in the emulator's layout (whole fragments).
  bool is_valid_element(thread_index_type i) const {
    return tsm_emu::in_bounds<capacity>(i, "cooperative_tensor", nullptr, 0) < capacity;
  }
  // {column, row} of element i in the operand as stored: index 0 is the innermost dimension,
  // as Metal's tensors order their extents.
  array<index_type, 2> get_multidimensional_index(thread_index_type i) const {
    const auto p = Layout::of(tsm_emu::current_thread().thread_index_in_simdgroup,
                              tsm_emu::in_bounds<capacity>(i, "cooperative_tensor", nullptr, 0));
    return {{index_type(p.col), index_type(p.row)}};
  }

  ElementType elements_[capacity];
};

template <class T>
struct is_cooperative_tensor : std::false_type {};
template <class T, class E, class L>
struct is_cooperative_tensor<cooperative_tensor<T, E, L>> : std::true_type {};

}  // namespace metal

namespace mpp {
namespace tensor_ops {

enum class reduction_operation { sum, max, min };

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };

  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;

  constexpr matmul2d_descriptor(int m_, int n_, int k_ = -1, bool transpose_left_ = false,
                                bool transpose_right_ = false, bool relaxed_precision_ = false,
                                mode matmul_mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(matmul_mode_) {}

  // matmul2d takes the descriptor as a template argument. A class-type template parameter is
  // C++20 (Metal 4's compiler has it; the emulator is C++17), so the descriptor travels packed
  // into an integer: `matmul2d<desc, scope>` converts it, as a converted constant expression may.
  constexpr operator unsigned long() const {
    return (unsigned long)(unsigned(m) & 0xFFFFu) | (unsigned long)(unsigned(n) & 0xFFFFu) << 16 |
           (unsigned long)(unsigned(k) & 0xFFFFu) << 32 | (unsigned long)transpose_left << 48 |
           (unsigned long)transpose_right << 49 | (unsigned long)relaxed_precision << 50 |
           (unsigned long)(matmul_mode == mode::multiply_accumulate) << 51;
  }
  static constexpr matmul2d_descriptor unpack(unsigned long p) {
    auto field = [](unsigned long v) { return v == 0xFFFFu ? -1 : int(v); };
    return matmul2d_descriptor(field(p & 0xFFFFu), field(p >> 16 & 0xFFFFu), field(p >> 32 & 0xFFFFu),
                               bool(p >> 48 & 1u), bool(p >> 49 & 1u), bool(p >> 50 & 1u),
                               (p >> 51 & 1u) ? mode::multiply_accumulate : mode::multiply);
  }
};

template <unsigned long Descriptor, class Scope, class... Args>
class matmul2d {
  static constexpr matmul2d_descriptor d = matmul2d_descriptor::unpack(Descriptor);
  static_assert(std::is_same<Scope, metal::execution_simdgroup>::value,
                "the emulator runs mpp::tensor_ops::matmul2d with execution_simdgroup only "
                "(execution_simdgroups<N> for N > 1 and execution_thread are not emulated)");
  static_assert(d.k >= 0, "matmul2d with a K read from tensor operands (dynamic_extent) is not emulated: "
                          "the emulator has cooperative tensor operands only");
  using operand = metal::tensor_ops_detail::operand;
  template <operand Role, int Rows, int Cols, class Coord>
  using layout_t = metal::tensor_ops_detail::layout<Role, Rows, Cols, Coord>;
  template <class T, operand Role, int Rows, int Cols, class Coord>
  using tensor_t = metal::cooperative_tensor<T, metal::tensor_ops_detail::extents<Coord, Cols, Rows>,
                                             layout_t<Role, Rows, Cols, Coord>>;

 public:
  static constexpr matmul2d_descriptor descriptor = d;
  using scope = Scope;

  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  using cooperative_tensor_left_input_t =
      tensor_t<LeftElementType, operand::left, d.transpose_left ? d.k : d.m, d.transpose_left ? d.m : d.k,
               CoordType>;
  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  using cooperative_tensor_right_input_t =
      tensor_t<RightElementType, operand::right, d.transpose_right ? d.n : d.k, d.transpose_right ? d.k : d.n,
               CoordType>;
  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int>
  using cooperative_tensor_destination_t = tensor_t<ElementType, operand::destination, d.m, d.n, CoordType>;

  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  cooperative_tensor_left_input_t<LeftElementType, RightElementType, ElementType, CoordType>
  get_left_input_cooperative_tensor() const {
    return {};
  }
  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  cooperative_tensor_right_input_t<LeftElementType, RightElementType, ElementType, CoordType>
  get_right_input_cooperative_tensor() const {
    return {};
  }
  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int>
  cooperative_tensor_destination_t<LeftOperand, RightOperand, ElementType, CoordType>
  get_destination_cooperative_tensor() const {
    static_assert(metal::is_cooperative_tensor<LeftOperand>::value &&
                      metal::is_cooperative_tensor<RightOperand>::value,
                  "matmul2d on metal::tensor operands is not emulated: the emulator has cooperative tensor "
                  "operands only");
    return {};
  }

  // A SIMD-group collective: every lane of the SIMD-group calls it (Metal: "execution scope
  // uniform"), with its own share of the three operands.
  template <class L, class R, class D>
  void run(L& left, R& right, D& destination, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) const {
    static_assert(metal::is_cooperative_tensor<L>::value && metal::is_cooperative_tensor<R>::value &&
                      metal::is_cooperative_tensor<D>::value,
                  "matmul2d on metal::tensor operands is not emulated: the emulator has cooperative tensor "
                  "operands only");
    using LL = typename L::layout;
    using RL = typename R::layout;
    using DL = typename D::layout;
    static_assert(LL::role == operand::left && LL::rows == (d.transpose_left ? d.k : d.m) &&
                      LL::cols == (d.transpose_left ? d.m : d.k),
                  "matmul2d::run: the left operand is not a left input cooperative tensor of this descriptor");
    static_assert(RL::role == operand::right && RL::rows == (d.transpose_right ? d.n : d.k) &&
                      RL::cols == (d.transpose_right ? d.k : d.n),
                  "matmul2d::run: the right operand is not a right input cooperative tensor of this descriptor");
    static_assert(DL::role == operand::destination && DL::rows == d.m && DL::cols == d.n,
                  "matmul2d::run: the destination is not a destination cooperative tensor of this descriptor");
    using TL = std::remove_cv_t<typename L::element_type>;
    using TR = std::remove_cv_t<typename R::element_type>;
    using TD = std::remove_cv_t<typename D::element_type>;

    // The lanes' left and right elements, exchanged in pieces of at most a SIMD-group
    // value's size (the whole piece list is this lane's: the values handed over stay valid
    // until every lane waits again).
    constexpr size_t left_bytes = sizeof left.elements_, bytes = left_bytes + sizeof right.elements_;
    unsigned char mine[bytes];
    std::memcpy(mine, left.elements_, left_bytes);
    std::memcpy(mine + left_bytes, right.elements_, sizeof right.elements_);
    unsigned char all[32][bytes];
    unsigned lane = 0;
    for (size_t offset = 0; offset < bytes; offset += ::tsm_emu::kSimdValueBytes) {
      const size_t n = bytes - offset < ::tsm_emu::kSimdValueBytes ? bytes - offset : ::tsm_emu::kSimdValueBytes;
      const auto x = ::tsm_emu::simd_exchange(mine + offset, n, site_.value);
      if (x.pending)
        ::tsm_emu::fault("launch", "matmul2d::run ran in a kernel translated to barrier regions (emulator bug; "
                                   "TSM_EMU_REGIONS=0 runs it as fibers)");
      if (x.active != 0xFFFFFFFFull)
        ::tsm_emu::fault("inactive_lane", "matmul2d::run with execution_simdgroup needs all 32 lanes of the "
                                          "SIMD-group active (uniform control flow, threadgroup size a multiple "
                                          "of 32)");
      for (unsigned l = 0; l < 32; ++l) std::memcpy(all[l] + offset, x.values[l], n);
      lane = x.lane;
    }
    TL a[LL::rows][LL::cols];
    TR b[RL::rows][RL::cols];
    for (unsigned l = 0; l < 32; ++l) {
      TL la[LL::capacity];
      TR lb[RL::capacity];
      std::memcpy(la, all[l], left_bytes);
      std::memcpy(lb, all[l] + left_bytes, sizeof lb);
      for (unsigned i = 0; i < LL::capacity; ++i) {
        const auto p = LL::of(l, i);
        a[p.row][p.col] = la[i];
      }
      for (unsigned i = 0; i < RL::capacity; ++i) {
        const auto p = RL::of(l, i);
        b[p.row][p.col] = lb[i];
      }
    }
    using Acc = std::conditional_t<std::is_integral<TL>::value && std::is_integral<TR>::value, long long, float>;
    for (unsigned i = 0; i < DL::capacity; ++i) {
      const auto p = DL::of(lane, i);
      Acc acc = d.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate ? Acc(destination.elements_[i])
                                                                                : Acc(0);
      for (int k = 0; k < d.k; ++k) {
        const Acc x = Acc(d.transpose_left ? a[k][p.row] : a[p.row][k]);
        const Acc y = Acc(d.transpose_right ? b[p.col][k] : b[k][p.col]);
        if constexpr (std::is_same<Acc, float>::value)
          acc = metal::simdgroup_detail::fused(x, y, acc);
        else
          acc += x * y;
      }
      destination.elements_[i] = TD(acc);
    }
    ::tsm_emu::count_fmas(unsigned(DL::capacity) * unsigned(d.k));
  }
};

}  // namespace tensor_ops
}  // namespace mpp
