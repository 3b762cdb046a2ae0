// Metal 4's tensors and MetalPerformancePrimitives `mpp::tensor_ops::matmul2d` (MSL 4.0), as
// far as MLX's `*_nax` kernels and ggml's `GGML_METAL_HAS_TENSOR` path use them:
// - `metal::tensor<T, extents, tensor_inline>`: a view of device or threadgroup memory made in
//   the kernel (pointer, extents, strides; `slice`), `extents` / `dextents` / `dynamic_extent`;
// - `matmul2d<desc, execution_simdgroups<N>>` on cooperative tensors (N = 1, MLX) or on tensor
//   operands (any N, ggml) into a cooperative tensor or a tensor, K static or read from the
//   operands (`dynamic_extent`); `cooperative_tensor::store` into a tensor.
// Not emulated, each a compile error naming it: `tensor_handle` (an MTLTensor bound by the
// host) and `tensor_offset`, `execution_thread`, the reductions, cooperative operands with
// N > 1 or shapes that are not whole 16x16 fragments.
//
// A cooperative tensor's layout is implementation defined (Apple: "depends on operation, data
// type, number of threads"; `get_multidimensional_index` tells where element i is). For one
// SIMD-group the emulator uses the layout MLX's nax kernels hard-code for 16x32 operands on the
// GPUs they run on (steel/gemm/nax.h, `BaseNAXFrag`): an operand of R x C elements as it is
// stored (the left M x K, or K x M when transposed; the right K x N, or N x K; the destination
// M x N) is cut into 16x16 fragments in row-major order, 8 elements of each per lane, and lane
// l holds rows r0 and r0 + 8 of its fragment, columns c0 .. c0 + 3, where q = l / 4,
// r0 = (q & 4) | (l / 2) % 4, c0 = ((q & 2) | l % 2) * 4: element 8f + 4h + j is row
// r0 + 8h, column c0 + j of fragment f. The destination of N > 1 SIMD-groups (T = 32N
// threads; thread t is lane + 32 * (SIMD-group index mod N)) is spread element by element:
// element i of thread t is the (iT + t)-th of the M x N in row-major order, valid while that
// is inside it. Code that uses get_multidimensional_index works with any layout; code that
// assumes one (as MLX's) is right here only where that layout is the GPU's: Apple documents
// none, and older GPUs differ.
//
// `run` on cooperative operands is a SIMD-group collective: the lanes exchange their left and
// right elements and each computes its own destination elements. On tensor operands each
// thread reads the operand elements its destination elements need, and a read outside an
// operand's extents is zero (Apple's op reads within the extents: ggml clamps K so). Products
// accumulate in float (int for 8-bit integers) in k order with one rounding per step, the
// destination's value first when the mode is multiply_accumulate. `relaxed_precision` lets
// Apple's implementation compute with less precision; the emulator does not.
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

// ---- <metal_tensor> -------------------------------------------------------------------------
constexpr size_t dynamic_extent = size_t(-1);

// Extents as std::mdspan has them: static ones in the type, dynamic ones given at construction
// (either the dynamic ones alone, or all of them).
template <class IndexType, size_t... Extents>
class extents {
  static constexpr size_t static_[sizeof...(Extents) + 1] = {Extents..., 0};

 public:
  using index_type = IndexType;
  using rank_type = size_t;
  static constexpr rank_type rank() { return sizeof...(Extents); }
  static constexpr rank_type rank_dynamic() { return (size_t(Extents == dynamic_extent) + ... + 0); }
  static constexpr size_t static_extent(rank_type r) { return static_[r]; }

  constexpr extents() {
    for (rank_type r = 0; r < rank(); ++r) e_[r] = static_[r] == dynamic_extent ? 0 : index_type(static_[r]);
  }
  template <class... I, class = std::enable_if_t<sizeof...(I) != 0 && (sizeof...(I) == rank() ||
                                                                       sizeof...(I) == rank_dynamic())>>
  constexpr explicit extents(I... values) {
    const index_type given[] = {index_type(values)...};
    for (rank_type r = 0, d = 0; r < rank(); ++r)
      e_[r] = sizeof...(I) == rank() ? given[r]
              : static_[r] == dynamic_extent ? given[d++]
                                             : index_type(static_[r]);
  }
  constexpr index_type extent(rank_type r) const { return e_[r]; }

 private:
  index_type e_[rank() > 0 ? rank() : 1] = {};
};

namespace tensor_ops_detail {
template <class I, size_t R, size_t... E>
struct dynamic_extents {
  using type = typename dynamic_extents<I, R - 1, dynamic_extent, E...>::type;
};
template <class I, size_t... E>
struct dynamic_extents<I, 0, E...> {
  using type = extents<I, E...>;
};
}  // namespace tensor_ops_detail

template <class IndexType, size_t Rank>
using dextents = typename tensor_ops_detail::dynamic_extents<IndexType, Rank>::type;

struct tensor_handle {};
struct tensor_inline {};
struct tensor_offset {};

// A tensor_inline: elements at data + sum(index[r] * stride[r]) for index[r] < extent(r),
// stride 1 in dimension 0 unless given. Each access goes through the data's checked pointer
// (bounds, and the sanitizer's shadow state), as the kernel's own accesses do.
template <class ElementType, class Extents, class Descriptor = tensor_handle, class... Tags>
class tensor {
  // In the constructors, not the class: deducing a tensor's type instantiates the class with
  // the default descriptor.
  static constexpr void emulated() {
    static_assert(std::is_same<Descriptor, tensor_inline>::value && sizeof...(Tags) == 0,
                  "the emulator has tensor_inline tensors only (views of device or threadgroup memory made in "
                  "the kernel); tensor_handle (an MTLTensor bound by the host) and tensor_offset are not emulated");
  }

 public:
  using element_type = ElementType;
  using value_type = std::remove_cv_t<ElementType>;
  using extents_type = Extents;
  using index_type = typename Extents::index_type;
  using data_handle_type = ::tsm_emu::ptr<ElementType>;
  static constexpr size_t rank = Extents::rank();

  // A kernel parameter (a tensor_handle) is bound through it: the assertion names that.
  tensor() { emulated(); }
  tensor(data_handle_type data, const Extents& e) : data_(data), extents_(e) {
    emulated();
    index_type s = 1;
    for (size_t r = 0; r < rank; ++r) {
      strides_[r] = s;
      s *= e.extent(r);
    }
  }
  template <class I>
  tensor(data_handle_type data, const Extents& e, const array<I, Extents::rank()>& strides)
      : data_(data), extents_(e) {
    emulated();
    for (size_t r = 0; r < rank; ++r) strides_[r] = index_type(strides[r]);
  }

  // The view from `origin` to the end of every dimension.
  template <class... I, class = std::enable_if_t<sizeof...(I) == rank>>
  tensor<ElementType, dextents<index_type, rank>, tensor_inline> slice(I... origin) const {
    const index_type at[] = {index_type(origin)...};
    index_type left[rank];
    ptrdiff_t offset = 0;
    for (size_t r = 0; r < rank; ++r) {
      if (at[r] < 0 || at[r] > extents_.extent(r))
        ::tsm_emu::fault("tensor_extents", "metal::tensor::slice: an origin outside the tensor's extents");
      left[r] = extents_.extent(r) - at[r];
      offset += ptrdiff_t(at[r]) * strides_[r];
    }
    return {data_ + offset, make_extents(left, std::make_index_sequence<rank>()), strides_};
  }

  // The view from `origin` with the given extents, dynamic_extent for what is left of a
  // dimension (PyTorch's Linear.metal: `slice<dynamic_extent, TILE_M>(0, m)`).
  template <size_t... E, class... I,
            class = std::enable_if_t<sizeof...(E) == rank && sizeof...(I) == rank>>
  tensor<ElementType, extents<index_type, E...>, tensor_inline> slice(I... origin) const {
    const auto view = slice(origin...);
    const size_t wanted[] = {E...};
    index_type e[rank];
    for (size_t r = 0; r < rank; ++r) e[r] = wanted[r] == dynamic_extent ? view.extent(r) : index_type(wanted[r]);
    return {view.data_, make_extents<extents<index_type, E...>>(e, std::make_index_sequence<rank>()), strides_};
  }

  // For the operations (not Metal's API, which the check holds kernels to): an extent, whether
  // (i0, i1) is inside the extents, and the element there.
  index_type extent(size_t r) const { return extents_.extent(r); }
  bool contains(index_type i0, index_type i1) const {
    return i0 >= 0 && i1 >= 0 && i0 < extents_.extent(0) && i1 < extents_.extent(1);
  }
  decltype(auto) at(index_type i0, index_type i1) const {
    return data_[ptrdiff_t(i0) * strides_[0] + ptrdiff_t(i1) * strides_[1]];
  }

 private:
  template <class X = dextents<index_type, rank>, size_t... R>
  static X make_extents(const index_type* e, std::index_sequence<R...>) {
    return X(e[R]...);
  }
  template <class, class, class, class...>
  friend class tensor;

  data_handle_type data_;
  Extents extents_;
  array<index_type, rank> strides_{};
};

template <class T, class E>
tensor(::tsm_emu::ptr<T>, E) -> tensor<T, E, tensor_inline>;
template <class T, class E, class I, size_t R>
tensor(::tsm_emu::ptr<T>, E, array<I, R>) -> tensor<T, E, tensor_inline>;

template <class T>
struct is_tensor : std::false_type {};
template <class T, class E, class... D>
struct is_tensor<tensor<T, E, D...>> : std::true_type {};

namespace tensor_ops_detail {
enum class operand { left, right, destination };

// The layout of a cooperative operand of Rows x Cols elements as stored, one SIMD-group's
// (see the top).
template <operand Role, int Rows, int Cols, class Coord>
struct layout {
  static_assert(Rows % 16 == 0 && Cols % 16 == 0,
                "the emulator's cooperative tensors of one SIMD-group are whole 16x16 fragments: matmul2d's M, N "
                "and K must be multiples of 16 (other shapes are not emulated)");
  static constexpr operand role = Role;
  static constexpr int rows = Rows, cols = Cols;
  static constexpr unsigned short capacity = Rows * Cols / 32;
  struct place {
    int row, col;
  };
  static unsigned thread() { return tsm_emu::current_thread().thread_index_in_simdgroup; }
  static constexpr bool valid(unsigned, unsigned) { return true; }
  static place of(unsigned lane, unsigned i) {
    const unsigned q = lane / 4, f = i / 8, h = (i / 4) % 2, j = i % 4;
    const int r0 = int((q & 4u) | ((lane / 2) % 4)), c0 = int(((q & 2u) | (lane % 2)) * 4);
    const int fr = int(f) / (Cols / 16), fc = int(f) % (Cols / 16);
    return {fr * 16 + r0 + 8 * int(h), fc * 16 + c0 + int(j)};
  }
};

// The destination of SimdGroups SIMD-groups, spread element by element (see the top).
template <int Rows, int Cols, unsigned SimdGroups>
struct spread_layout {
  static constexpr operand role = operand::destination;
  static constexpr int rows = Rows, cols = Cols;
  static constexpr unsigned threads = 32 * SimdGroups;
  static constexpr unsigned short capacity = (Rows * Cols + threads - 1) / threads;
  struct place {
    int row, col;
  };
  static unsigned thread() {
    const auto& t = tsm_emu::current_thread();
    return t.thread_index_in_simdgroup + 32 * (t.simdgroup_index_in_threadgroup % SimdGroups);
  }
  static constexpr bool valid(unsigned t, unsigned i) { return i * threads + t < unsigned(Rows * Cols); }
  static place of(unsigned t, unsigned i) {
    const int e = int(i * threads + t);
    return {e / Cols, e % Cols};
  }
};

template <class Coord, size_t Cols, size_t Rows>
struct extents {
  using index_type = Coord;
  static constexpr size_t rank() { return 2; }
  static constexpr size_t static_extent(size_t r) { return r == 0 ? Cols : Rows; }
};
}  // namespace tensor_ops_detail

// Thread-private storage: each thread's share of the operand, `capacity` elements.
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
  bool is_valid_element(thread_index_type i) const {
    return Layout::valid(Layout::thread(), tsm_emu::in_bounds<capacity>(i, "cooperative_tensor", nullptr, 0));
  }
  // {column, row} of element i in the operand as stored: index 0 is the innermost dimension,
  // as Metal's tensors order their extents.
  array<index_type, 2> get_multidimensional_index(thread_index_type i) const {
    const auto p = Layout::of(Layout::thread(), tsm_emu::in_bounds<capacity>(i, "cooperative_tensor", nullptr, 0));
    return {{index_type(p.col), index_type(p.row)}};
  }

  // This thread's valid elements into a tensor at {column, row}, those inside its extents.
  template <class T, class E, class... D>
  void store(const tensor<T, E, D...>& destination) const {
    static_assert(E::rank() == 2, "cooperative_tensor::store: the emulator stores into rank-2 tensors");
    const unsigned t = Layout::thread();
    for (unsigned i = 0; i < capacity; ++i) {
      if (!Layout::valid(t, i)) continue;
      const auto p = Layout::of(t, i);
      if (destination.contains(p.col, p.row))
        ::tsm_emu::stored(destination.at(p.col, p.row)) = std::remove_cv_t<T>(elements_[i]);
    }
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

namespace detail {
template <class Scope>
struct simdgroups_of {
  static_assert(!std::is_same<Scope, Scope>::value,
                "the emulator runs mpp::tensor_ops::matmul2d with execution_simdgroups<N> only "
                "(execution_thread is not emulated)");
};
template <size_t N>
struct simdgroups_of<metal::execution_simdgroups<N>> {
  static constexpr unsigned value = unsigned(N);
};
}  // namespace detail

template <unsigned long Descriptor, class Scope, class... Args>
class matmul2d {
  static constexpr matmul2d_descriptor d = matmul2d_descriptor::unpack(Descriptor);
  static constexpr unsigned simdgroups = detail::simdgroups_of<Scope>::value;
  using operand = metal::tensor_ops_detail::operand;
  template <operand Role, int Rows, int Cols, class Coord>
  using layout_t = metal::tensor_ops_detail::layout<Role, Rows, Cols, Coord>;
  template <class T, class Layout, class Coord>
  using cooperative_t = metal::cooperative_tensor<
      T, metal::tensor_ops_detail::extents<Coord, Layout::cols, Layout::rows>, Layout>;
  template <class T, operand Role, int Rows, int Cols, class Coord>
  using tensor_t = cooperative_t<T, layout_t<Role, Rows, Cols, Coord>, Coord>;
  // The destination's layout: a SIMD-group's fragments, or spread over several SIMD-groups.
  template <class Coord>
  using destination_layout_t = std::conditional_t<simdgroups == 1, layout_t<operand::destination, d.m, d.n, Coord>,
                                                  metal::tensor_ops_detail::spread_layout<d.m, d.n, simdgroups>>;
  static constexpr bool one_simdgroup = simdgroups == 1;  // cooperative operands need it

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
  using cooperative_tensor_destination_t = cooperative_t<ElementType, destination_layout_t<CoordType>, CoordType>;

  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  cooperative_tensor_left_input_t<LeftElementType, RightElementType, ElementType, CoordType>
  get_left_input_cooperative_tensor() const {
    static_assert(one_simdgroup, "cooperative input operands of execution_simdgroups<N> for N > 1 are not emulated");
    return {};
  }
  template <class LeftElementType, class RightElementType, class ElementType, class CoordType = int>
  cooperative_tensor_right_input_t<LeftElementType, RightElementType, ElementType, CoordType>
  get_right_input_cooperative_tensor() const {
    static_assert(one_simdgroup, "cooperative input operands of execution_simdgroups<N> for N > 1 are not emulated");
    return {};
  }
  template <class LeftOperand, class RightOperand, class ElementType, class CoordType = int>
  cooperative_tensor_destination_t<LeftOperand, RightOperand, ElementType, CoordType>
  get_destination_cooperative_tensor() const {
    return {};
  }

  // A collective of the scope: every thread of it calls it (Metal: "execution scope uniform").
  // Operands are both cooperative tensors (this thread's share of each) or both tensors; the
  // destination is a cooperative tensor or a tensor.
  template <class L, class R, class D>
  void run(L& left, R& right, D& destination, ::tsm_emu::Site site_ = TSM_EMU_SITE_HERE) const {
    constexpr bool cooperative = metal::is_cooperative_tensor<L>::value && metal::is_cooperative_tensor<R>::value &&
                                 metal::is_cooperative_tensor<D>::value;
    constexpr bool tensors = metal::is_tensor<L>::value && metal::is_tensor<R>::value &&
                             (metal::is_tensor<D>::value || metal::is_cooperative_tensor<D>::value);
    static_assert(cooperative || tensors,
                  "matmul2d::run: the emulator takes operands that are both cooperative tensors or both "
                  "metal::tensors, and a cooperative tensor or metal::tensor destination");
    if constexpr (cooperative)
      run_cooperative(left, right, destination, site_);
    else
      run_tensors(left, right, destination, site_);
  }

 private:
  template <class TL, class TR>
  using acc_t = std::conditional_t<std::is_integral<TL>::value && std::is_integral<TR>::value, long long, float>;

  // The lanes of this SIMD-group, all active, at a collective; the last lane reached it.
  static ::tsm_emu::SimdExchange exchange(const void* mine, size_t n, ::tsm_emu::Site site_) {
    const auto x = ::tsm_emu::simd_exchange(mine, n, site_);
    if (x.pending)
      ::tsm_emu::fault("launch", "matmul2d::run ran in a kernel translated to barrier regions (emulator bug; "
                                 "TSM_EMU_REGIONS=0 runs it as fibers)");
    if (x.active != 0xFFFFFFFFull)
      ::tsm_emu::fault("inactive_lane", "matmul2d::run needs all 32 lanes of each SIMD-group of its execution "
                                        "scope active (uniform control flow, threadgroup size a multiple of 32)");
    return x;
  }

  template <class L, class R, class D>
  void run_cooperative(L& left, R& right, D& destination, ::tsm_emu::Site site_) const {
    static_assert(one_simdgroup,
                  "matmul2d on cooperative operands is emulated with execution_simdgroup only (N > 1 is not)");
    static_assert(d.k >= 0, "matmul2d with a K read from tensor operands (dynamic_extent) needs metal::tensor "
                            "operands");
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
      const auto x = exchange(mine + offset, n, site_);
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
    using A = acc_t<TL, TR>;
    for (unsigned i = 0; i < DL::capacity; ++i) {
      const auto p = DL::of(lane, i);
      A acc = accumulating() ? A(destination.elements_[i]) : A(0);
      for (int k = 0; k < d.k; ++k)
        acc = step(acc, A(d.transpose_left ? a[k][p.row] : a[p.row][k]),
                   A(d.transpose_right ? b[p.col][k] : b[k][p.col]));
      destination.elements_[i] = TD(acc);
    }
    ::tsm_emu::counted_fmas(unsigned(DL::capacity) * unsigned(d.k));
  }

  // Each thread computes the destination elements its share holds, reading the operands where
  // they are (a destination tensor is shared as a cooperative destination would be).
  template <class L, class R, class D>
  void run_tensors(const L& left, const R& right, D& destination, ::tsm_emu::Site site_) const {
    static_assert(L::rank == 2 && R::rank == 2, "matmul2d::run: the emulator takes rank-2 tensor operands");
    using DL = destination_layout_t<int>;
    if constexpr (metal::is_cooperative_tensor<D>::value)
      static_assert(std::is_same<typename D::layout, DL>::value,
                    "matmul2d::run: the destination is not a destination cooperative tensor of this operation");
    const auto& t = ::tsm_emu::current_thread();
    const uint32_t group_threads = t.threads_per_threadgroup.x * t.threads_per_threadgroup.y * t.threads_per_threadgroup.z;
    if (group_threads % (32 * simdgroups) != 0)
      ::tsm_emu::fault("inactive_lane", "matmul2d::run with execution_simdgroups<N> needs a threadgroup of a "
                                        "multiple of 32 N threads");
    const unsigned char nothing = 0;
    exchange(&nothing, 1, site_);

    // {column, row} of A[m][k] and B[k][n] in the operands as stored.
    const int left_k = d.transpose_left ? int(left.extent(1)) : int(left.extent(0));
    const int right_k = d.transpose_right ? int(right.extent(0)) : int(right.extent(1));
    int K = d.k;
    if (K < 0) {
      if (left_k != right_k)
        ::tsm_emu::fault("tensor_extents", "matmul2d::run: K is dynamic_extent and the left and right operands' "
                                           "K extents differ");
      K = left_k;
    }
    using TL = std::remove_cv_t<typename L::element_type>;
    using TR = std::remove_cv_t<typename R::element_type>;
    using A = acc_t<TL, TR>;
    auto a = [&](int m, int k) -> A {
      const int c = d.transpose_left ? m : k, r = d.transpose_left ? k : m;
      return left.contains(c, r) ? A(TL(left.at(c, r))) : A(0);
    };
    auto b = [&](int k, int n) -> A {
      const int c = d.transpose_right ? k : n, r = d.transpose_right ? n : k;
      return right.contains(c, r) ? A(TR(right.at(c, r))) : A(0);
    };
    const unsigned me = DL::thread();
    unsigned computed = 0;
    for (unsigned i = 0; i < DL::capacity; ++i) {
      if (!DL::valid(me, i)) continue;
      const auto p = DL::of(me, i);
      A acc = 0;
      if constexpr (metal::is_cooperative_tensor<D>::value) {
        if (accumulating()) acc = A(destination.elements_[i]);
      } else {
        if (!destination.contains(p.col, p.row)) continue;
        if (accumulating()) acc = A(destination.at(p.col, p.row));
      }
      for (int k = 0; k < K; ++k) acc = step(acc, a(p.row, k), b(k, p.col));
      if constexpr (metal::is_cooperative_tensor<D>::value)
        destination.elements_[i] = std::remove_cv_t<typename D::element_type>(acc);
      else
        ::tsm_emu::stored(destination.at(p.col, p.row)) = std::remove_cv_t<typename D::element_type>(acc);
      ++computed;
    }
    ::tsm_emu::counted_fmas(computed * unsigned(K));
  }

  static constexpr bool accumulating() { return d.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate; }
  template <class A>
  static A step(A acc, A x, A y) {
    if constexpr (std::is_same<A, float>::value)
      return metal::simdgroup_detail::fused(x, y, acc);
    else
      return acc + x * y;
  }
};

}  // namespace tensor_ops
}  // namespace mpp
