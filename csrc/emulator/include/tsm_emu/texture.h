// Textures and samplers in compute kernels: Metal's texture types (1D to cube arrays,
// multisampled, buffers, depth), read / write / sample / sample_compare / gather, the
// size queries, and constexpr samplers.
//
// A texture argument is bound from a tensor (torch_sparse_metal/emulator/_textures.py):
// its texels stored layer by layer, then by z, row and column, then sample, with 1, 2 or 4
// channels of one pixel format (TextureFormat). One mip level: get_num_mip_levels() is 1,
// and sampling reads level 0 whatever lod it is given. Every access is bounds-checked, in
// every build: a coordinate outside the texture (undefined in Metal) faults with kind
// out_of_bounds, naming the texture and the coordinate.
//
// Written from the Metal Shading Language specification (section 6.12, textures; 2.9,
// samplers; 7.7, pixel format conversions).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "tsm_emu/runtime.h"
#include "tsm_emu/types.h"

namespace tsm_emu {

// Shared with _textures.py (its FORMATS and KINDS); a texture's storage, one component.
enum TextureFormat : int32_t {
  TF_F32, TF_F16, TF_UNORM8, TF_SNORM8, TF_UNORM16, TF_SNORM16,
  TF_I32, TF_I16, TF_I8, TF_U32, TF_U16, TF_U8,
};
enum TextureKind : int32_t {
  TK_1D, TK_1D_ARRAY, TK_2D, TK_2D_ARRAY, TK_3D, TK_CUBE, TK_CUBE_ARRAY,
  TK_2D_MS, TK_2D_MS_ARRAY, TK_BUFFER,
  TK_DEPTH = 16,  // added to a depth texture's kind, in its parameter's description only
};

// What Python binds to a [[texture(n)]] (struct tsm_texture of _textures.py).
struct TextureDesc {
  void* data;
  uint64_t bytes;
  uint32_t width, height, depth;  // 1 where the kind has no such dimension
  uint32_t layers;                // array elements; cube: faces of every element (6 each)
  uint32_t samples;
  uint32_t channels;              // 1, 2 or 4
  int32_t format;                 // TextureFormat
  int32_t kind;                   // TextureKind
  const char* name;               // the parameter's name, for messages
};

// What Python binds to a [[sampler(n)]] (and what a constexpr sampler holds).
struct SamplerDesc {
  int32_t normalized;      // coord::normalized (1) or coord::pixel (0)
  int32_t address[3];      // s, t, r: metal::address
  int32_t mag_filter, min_filter, mip_filter;
  int32_t compare;         // metal::compare_func
  int32_t border;          // metal::border_color
};

// ---- texel storage -------------------------------------------------------------------------
inline bool format_is_float(int32_t f) { return f <= TF_SNORM16; }

inline double load_component(const TextureDesc* d, uint64_t i) {
  const char* p = static_cast<const char*>(d->data);
  switch (d->format) {
    case TF_F32: { float v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case TF_F16: { _Float16 v; std::memcpy(&v, p + 2 * i, 2); return double(v); }
    case TF_UNORM8: return double(uint8_t(p[i])) / 255.0;
    case TF_SNORM8: return std::fmax(double(int8_t(p[i])) / 127.0, -1.0);
    case TF_UNORM16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return double(v) / 65535.0; }
    case TF_SNORM16: { int16_t v; std::memcpy(&v, p + 2 * i, 2); return std::fmax(double(v) / 32767.0, -1.0); }
    case TF_I32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case TF_I16: { int16_t v; std::memcpy(&v, p + 2 * i, 2); return v; }
    case TF_I8: return int8_t(p[i]);
    case TF_U32: { uint32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case TF_U16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return v; }
    case TF_U8: return uint8_t(p[i]);
  }
  return 0;
}

// Integers keep their bits through the double above (32-bit at most); a value stored into a
// narrower integer format saturates, a float into a normalised one is clamped and rounded
// to nearest even (MSL 7.7.1).
inline void store_component(const TextureDesc* d, uint64_t i, double v) {
  char* p = static_cast<char*>(d->data);
  auto norm = [](double x, double lo, double scale) { return std::nearbyint(std::fmin(std::fmax(x, lo), 1.0) * scale); };
  auto sat = [](double x, double lo, double hi) { return std::fmin(std::fmax(x, lo), hi); };
  switch (d->format) {
    case TF_F32: { float x = float(v); std::memcpy(p + 4 * i, &x, 4); return; }
    case TF_F16: { _Float16 x = _Float16(float(v)); std::memcpy(p + 2 * i, &x, 2); return; }
    case TF_UNORM8: p[i] = char(uint8_t(norm(v, 0.0, 255.0))); return;
    case TF_SNORM8: p[i] = char(int8_t(norm(v, -1.0, 127.0))); return;
    case TF_UNORM16: { uint16_t x = uint16_t(norm(v, 0.0, 65535.0)); std::memcpy(p + 2 * i, &x, 2); return; }
    case TF_SNORM16: { int16_t x = int16_t(norm(v, -1.0, 32767.0)); std::memcpy(p + 2 * i, &x, 2); return; }
    case TF_I32: { int32_t x = int32_t(v); std::memcpy(p + 4 * i, &x, 4); return; }
    case TF_I16: { int16_t x = int16_t(sat(v, -32768, 32767)); std::memcpy(p + 2 * i, &x, 2); return; }
    case TF_I8: p[i] = char(int8_t(sat(v, -128, 127))); return;
    case TF_U32: { uint32_t x = uint32_t(v); std::memcpy(p + 4 * i, &x, 4); return; }
    case TF_U16: { uint16_t x = uint16_t(sat(v, 0, 65535)); std::memcpy(p + 2 * i, &x, 2); return; }
    case TF_U8: p[i] = char(uint8_t(sat(v, 0, 255))); return;
  }
}

// A texel's place: column, row, slice (3D), layer (array element; cube: element * 6 + face),
// sample.
struct Texel {
  int64_t x = 0, y = 0, z = 0, layer = 0, sample = 0;
};

[[noreturn]] inline void texture_fault(const TextureDesc* d, const char* op, const Texel& t, uint32_t lod) {
  if (d == nullptr) fault("out_of_bounds", (std::string(op) + " of a null texture (no texture bound at its index)").c_str());
  std::string at = "(" + std::to_string(t.x);
  if (d->kind != TK_1D && d->kind != TK_1D_ARRAY && d->kind != TK_BUFFER) at += ", " + std::to_string(t.y);
  if (d->kind == TK_3D) at += ", " + std::to_string(t.z);
  at += ")";
  std::string size = std::to_string(d->width);
  if (d->kind != TK_1D && d->kind != TK_1D_ARRAY && d->kind != TK_BUFFER) size += "x" + std::to_string(d->height);
  if (d->kind == TK_3D) size += "x" + std::to_string(d->depth);
  std::string msg = std::string(op) + " at " + at;
  if (d->layers > 1 || d->kind == TK_CUBE || d->kind == TK_CUBE_ARRAY || d->kind == TK_1D_ARRAY ||
      d->kind == TK_2D_ARRAY || d->kind == TK_2D_MS_ARRAY)
    msg += ", layer " + std::to_string(t.layer);
  if (d->samples > 1 || d->kind == TK_2D_MS || d->kind == TK_2D_MS_ARRAY) msg += ", sample " + std::to_string(t.sample);
  if (lod) msg += ", level " + std::to_string(lod);
  msg += " outside texture `" + std::string(d->name ? d->name : "?") + "` (" + size + " texels, " +
         std::to_string(d->layers) + " layer(s), " + std::to_string(d->samples) +
         " sample(s), 1 mip level; Metal leaves such an access undefined) by " + where_info(current_thread());
  fault("out_of_bounds", msg.c_str());
}

// The index of texel `t`'s first component, after checking it lies in the texture.
inline uint64_t texel_index(const TextureDesc* d, const char* op, const Texel& t, uint32_t lod = 0) {
  if (d == nullptr || lod != 0 || t.x < 0 || t.y < 0 || t.z < 0 || t.layer < 0 || t.sample < 0 ||
      t.x >= d->width || t.y >= d->height || t.z >= d->depth || t.layer >= d->layers || t.sample >= d->samples)
    texture_fault(d, op, t, lod);
  const uint64_t texel = ((((uint64_t(t.layer) * d->depth + uint64_t(t.z)) * d->height + uint64_t(t.y)) * d->width +
                           uint64_t(t.x)) * d->samples + uint64_t(t.sample));
  return texel * d->channels;
}

// Texel `t` as four components (r, g, b, a), the missing ones 0 and alpha 1.
inline void load_texel(const TextureDesc* d, const char* op, const Texel& t, uint32_t lod, double out[4]) {
  const uint64_t i = texel_index(d, op, t, lod);
  out[0] = out[1] = out[2] = 0;
  out[3] = 1;
  for (uint32_t c = 0; c < d->channels; ++c) out[c] = load_component(d, i + c);
}

inline void store_texel(const TextureDesc* d, const Texel& t, uint32_t lod, const double in[4]) {
  const uint64_t i = texel_index(d, "write", t, lod);
  for (uint32_t c = 0; c < d->channels; ++c) store_component(d, i + c, in[c]);
}

}  // namespace tsm_emu

namespace metal {

enum class access { sample, read, write, read_write };
// MSL 3.2: whether a texture's writes are coherent across the device or within a threadgroup;
// the emulator's memory is coherent either way.
enum memory_coherence { memory_coherence_threadgroup, memory_coherence_device };

// ---- samplers (MSL 2.9) --------------------------------------------------------------------
enum class coord { normalized, pixel };
enum class address { repeat, mirrored_repeat, clamp_to_edge, clamp_to_zero, clamp_to_border };
enum class s_address { repeat, mirrored_repeat, clamp_to_edge, clamp_to_zero, clamp_to_border };
enum class t_address { repeat, mirrored_repeat, clamp_to_edge, clamp_to_zero, clamp_to_border };
enum class r_address { repeat, mirrored_repeat, clamp_to_edge, clamp_to_zero, clamp_to_border };
enum class filter { nearest, linear };
enum class mag_filter { nearest, linear };
enum class min_filter { nearest, linear };
enum class mip_filter { none, nearest, linear };
enum class compare_func { none, less, less_equal, greater, greater_equal, equal, not_equal, always, never };
enum class border_color { transparent_black, opaque_black, opaque_white };
struct lod_clamp {
  constexpr lod_clamp(float lo, float hi) : lo(lo), hi(hi) {}
  float lo, hi;
};
struct max_anisotropy {
  constexpr explicit max_anisotropy(int n) : n(n) {}
  int n;
};

struct sampler {
  // Metal's defaults: normalized coordinates, clamp_to_edge, nearest, no mipmap filtering,
  // compare_func::never, transparent black borders.
  constexpr sampler() : s_{1, {2, 2, 2}, 0, 0, 0, int32_t(compare_func::never), 0} {}
  template <class A0, class... A>
  constexpr sampler(A0 a0, A... a) : sampler() {
    set(a0);
    (set(a), ...);
  }
  explicit sampler(const tsm_emu::SamplerDesc* d) : sampler() {
    if (d) s_ = *d;
  }
  const tsm_emu::SamplerDesc& tsm_sampler_state() const { return s_; }

 private:
  constexpr void set(coord c) { s_.normalized = c == coord::normalized; }
  constexpr void set(address a) { s_.address[0] = s_.address[1] = s_.address[2] = int32_t(a); }
  constexpr void set(s_address a) { s_.address[0] = int32_t(a); }
  constexpr void set(t_address a) { s_.address[1] = int32_t(a); }
  constexpr void set(r_address a) { s_.address[2] = int32_t(a); }
  constexpr void set(filter f) { s_.mag_filter = s_.min_filter = int32_t(f); }
  constexpr void set(mag_filter f) { s_.mag_filter = int32_t(f); }
  constexpr void set(min_filter f) { s_.min_filter = int32_t(f); }
  constexpr void set(mip_filter f) { s_.mip_filter = int32_t(f); }
  constexpr void set(compare_func f) { s_.compare = int32_t(f); }
  constexpr void set(border_color b) { s_.border = int32_t(b); }
  constexpr void set(lod_clamp) {}        // one mip level: nothing to clamp
  constexpr void set(max_anisotropy) {}   // no anisotropic filtering of one level

  tsm_emu::SamplerDesc s_;
};

// Level-of-detail options of sample(): one mip level here, so they select level 0.
struct bias { constexpr explicit bias(float) {} };
struct level { constexpr explicit level(float) {} };
struct min_lod_clamp { constexpr explicit min_lod_clamp(float) {} };
template <int N> struct tsm_gradient {
  template <class X, class Y> tsm_gradient(const X&, const Y&) {}
};
using gradient2d = tsm_gradient<2>;
using gradient3d = tsm_gradient<3>;
using gradientcube = tsm_gradient<4>;

enum class component { x, y, z, w };

namespace tsm_tex {
using tsm_emu::TextureDesc;
using tsm_emu::Texel;

template <class X>
constexpr bool is_lod_option() {
  using B = std::decay_t<X>;
  return std::is_same<B, bias>::value || std::is_same<B, level>::value || std::is_same<B, min_lod_clamp>::value ||
         std::is_same<B, gradient2d>::value || std::is_same<B, gradient3d>::value || std::is_same<B, gradientcube>::value;
}

// A coordinate argument (a scalar or a vector of up to 3 components, swizzles too) as
// integers or floats.
template <class C>
void coordinates(const C& c, double out[3]) {
  out[0] = out[1] = out[2] = 0;
  if constexpr (tsm_detail::is_vec_like<C>::value) {
    const typename tsm_detail::vi<C>::vec_type v = c;
    for (int i = 0; i < tsm_detail::vi<C>::n && i < 3; ++i) out[i] = double(v[i]);
  } else {
    out[0] = double(c);
  }
}

struct Options {
  int64_t offset[3] = {0, 0, 0};
};
template <class X>
void take_option(Options& o, const X& x) {
  if constexpr (is_lod_option<X>()) {
    (void)x;
  } else {
    static_assert(tsm_detail::is_vec_like<X>::value || std::is_integral<std::decay_t<X>>::value,
                  "sample(): an option is a level, bias, gradient, min_lod_clamp or an integer offset");
    double v[3];
    coordinates(x, v);
    for (int i = 0; i < 3; ++i) o.offset[i] = int64_t(v[i]);
  }
}
template <class... X>
Options options(const X&... x) {
  Options o;
  (take_option(o, x), ...);
  return o;
}

inline int64_t wrap(int64_t i, int64_t n, int mode, bool* outside) {
  switch (mode) {
    case int(address::repeat): return ((i % n) + n) % n;
    case int(address::mirrored_repeat): {
      int64_t period = 2 * n, m = ((i % period) + period) % period;
      return m < n ? m : period - 1 - m;
    }
    case int(address::clamp_to_edge): return i < 0 ? 0 : (i >= n ? n - 1 : i);
    default:  // clamp_to_zero, clamp_to_border: the border's color outside
      if (i < 0 || i >= n) *outside = true;
      return i < 0 ? 0 : (i >= n ? n - 1 : i);
  }
}

// The texel at integer coordinates (ix, iy, iz) of `layer`, through the sampler's
// addressing: the border color where clamp_to_zero / clamp_to_border leaves the texture.
inline void addressed_texel(const TextureDesc* d, const tsm_emu::SamplerDesc& s, int dims, int64_t ix, int64_t iy,
                            int64_t iz, int64_t layer, double out[4]) {
  bool outside = false;
  Texel t;
  t.x = wrap(ix, d->width, s.address[0], &outside);
  t.y = dims >= 2 ? wrap(iy, d->height, s.address[1], &outside) : 0;
  t.z = dims >= 3 ? wrap(iz, d->depth, s.address[2], &outside) : 0;
  t.layer = layer;
  if (outside) {
    const bool zero = s.address[0] == int(address::clamp_to_zero) || s.address[1] == int(address::clamp_to_zero) ||
                      s.address[2] == int(address::clamp_to_zero);
    const bool has_alpha = d->channels == 4;
    const double a = zero ? (has_alpha ? 0.0 : 1.0)
                          : (s.border == int(border_color::transparent_black) ? 0.0 : 1.0);
    const double c = !zero && s.border == int(border_color::opaque_white) ? 1.0 : 0.0;
    out[0] = out[1] = out[2] = c;
    out[3] = a;
    if (layer < 0 || layer >= d->layers) tsm_emu::texture_fault(d, "sample", t, 0);
    return;
  }
  tsm_emu::load_texel(d, "sample", t, 0, out);
}

// A cube direction as (face, u, v), u and v normalized (MSL: the major axis picks the face).
inline void cube_face(const double dir[3], int64_t* face, double* u, double* v) {
  const double ax = std::fabs(dir[0]), ay = std::fabs(dir[1]), az = std::fabs(dir[2]);
  double sc, tc, ma;
  if (ax >= ay && ax >= az) {
    *face = dir[0] >= 0 ? 0 : 1;
    sc = dir[0] >= 0 ? -dir[2] : dir[2];
    tc = -dir[1];
    ma = ax;
  } else if (ay >= az) {
    *face = dir[1] >= 0 ? 2 : 3;
    sc = dir[0];
    tc = dir[1] >= 0 ? dir[2] : -dir[2];
    ma = ay;
  } else {
    *face = dir[2] >= 0 ? 4 : 5;
    sc = dir[2] >= 0 ? dir[0] : -dir[0];
    tc = -dir[1];
    ma = az;
  }
  ma = ma == 0 ? 1 : ma;
  *u = (sc / ma + 1) / 2;
  *v = (tc / ma + 1) / 2;
}

// Where a cube lookup lands: the face's layer (element * 6 + face), (u, v) normalized on that
// face, and the sampler state made to stay on it (no filtering across faces).
struct CubeSite {
  int64_t layer;
  double uv[3];
  tsm_emu::SamplerDesc state;
};
inline CubeSite cube_site(const double dir[3], int64_t element, tsm_emu::SamplerDesc state) {
  CubeSite site{0, {0, 0, 0}, state};
  int64_t face;
  cube_face(dir, &face, &site.uv[0], &site.uv[1]);
  site.layer = element * 6 + face;
  site.state.normalized = 1;
  site.state.address[0] = site.state.address[1] = int(address::clamp_to_edge);
  return site;
}

// Filtered sample at coordinates c (normalized or in texels, as the sampler says), plus an
// integer texel offset: nearest or (bi/tri)linear, per component.
inline void filtered(const TextureDesc* d, const tsm_emu::SamplerDesc& s, int dims, const double c[3],
                     const Options& o, int64_t layer, double out[4]) {
  if (d == nullptr) tsm_emu::texture_fault(d, "sample", Texel{}, 0);
  const double size[3] = {double(d->width), double(d->height), double(d->depth)};
  double x[3];
  for (int i = 0; i < 3; ++i) x[i] = i < dims ? (s.normalized ? c[i] * size[i] : c[i]) : 0;
  const bool linear = s.mag_filter == int(filter::linear) || s.min_filter == int(filter::linear);
  if (!linear) {
    addressed_texel(d, s, dims, int64_t(std::floor(x[0])) + o.offset[0], int64_t(std::floor(x[1])) + o.offset[1],
                    int64_t(std::floor(x[2])) + o.offset[2], layer, out);
    return;
  }
  int64_t i0[3];
  double f[3];
  for (int i = 0; i < 3; ++i) {
    const double p = i < dims ? x[i] - 0.5 : 0;
    i0[i] = int64_t(std::floor(p)) + o.offset[i];
    f[i] = i < dims ? p - std::floor(p) : 0;
  }
  for (int k = 0; k < 4; ++k) out[k] = 0;
  const int corners = 1 << dims;
  for (int corner = 0; corner < corners; ++corner) {
    double w = 1;
    int64_t at[3] = {0, 0, 0};
    for (int i = 0; i < dims; ++i) {
      const int bit = (corner >> i) & 1;
      at[i] = i0[i] + bit;
      w *= bit ? f[i] : 1 - f[i];
    }
    double t[4];
    addressed_texel(d, s, dims, at[0], at[1], at[2], layer, t);
    for (int k = 0; k < 4; ++k) out[k] += w * t[k];
  }
}

inline bool compare(int func, double reference, double texel) {
  switch (func) {
    case int(compare_func::less): return reference < texel;
    case int(compare_func::less_equal): return reference <= texel;
    case int(compare_func::greater): return reference > texel;
    case int(compare_func::greater_equal): return reference >= texel;
    case int(compare_func::equal): return reference == texel;
    case int(compare_func::not_equal): return reference != texel;
    case int(compare_func::always): return true;
    default: return false;  // never, none
  }
}

// The 2x2 footprint linear filtering of (u, v) reads, in gather's order: (i0, j1),
// (i1, j1), (i1, j0), (i0, j0).
inline void footprint(const TextureDesc* d, const tsm_emu::SamplerDesc& s, const double c[3], const Options& o,
                      int64_t layer, double texels[4][4]) {
  if (d == nullptr) tsm_emu::texture_fault(d, "gather", Texel{}, 0);
  const double px = (s.normalized ? c[0] * d->width : c[0]) - 0.5;
  const double py = (s.normalized ? c[1] * d->height : c[1]) - 0.5;
  const int64_t i0 = int64_t(std::floor(px)) + o.offset[0], j0 = int64_t(std::floor(py)) + o.offset[1];
  const int64_t at[4][2] = {{i0, j0 + 1}, {i0 + 1, j0 + 1}, {i0 + 1, j0}, {i0, j0}};
  for (int k = 0; k < 4; ++k) addressed_texel(d, s, 2, at[k][0], at[k][1], 0, layer, texels[k]);
}

template <class T>
vec<T, 4> as_vec(const double v[4]) {
  vec<T, 4> r;
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_integral<T>::value)
      r[i] = T(int64_t(v[i]));
    else
      r[i] = T(v[i]);
  }
  return r;
}

template <class V>
void as_doubles(const V& color, double out[4]) {
  const typename tsm_detail::vi<V>::vec_type v = color;
  out[0] = out[1] = out[2] = 0;
  out[3] = 1;
  if constexpr (tsm_detail::is_vec_like<V>::value) {
    for (int i = 0; i < tsm_detail::vi<V>::n && i < 4; ++i) out[i] = double(v[i]);
  } else {
    out[0] = double(v);
  }
}

template <class T>
constexpr bool texel_type_ok() {
  return std::is_same<T, float>::value || std::is_same<T, half>::value || std::is_same<T, int>::value ||
         std::is_same<T, uint>::value || std::is_same<T, short>::value || std::is_same<T, ushort>::value;
}

// What every texture type has: its description, the null test, fence, the size queries.
template <class T, access A, int Kind>
struct texture_core {
  static_assert(texel_type_ok<T>(), "a texture's element type is float, half, int, uint, short or ushort");
  using tsm_texel_type = T;
  static constexpr access tsm_access = A;
  static constexpr int tsm_kind = Kind;

  texture_core() = default;
  explicit texture_core(const TextureDesc* d) : d_(d) {}

  bool is_null_texture() const { return d_ == nullptr; }
  void fence() const {}  // a thread's writes are visible to its reads here at once
  uint get_num_mip_levels() const { return 1; }

 protected:
  static constexpr bool readable() { return A != access::write; }
  static constexpr bool writable() { return A == access::write || A == access::read_write; }
  uint size(uint32_t TextureDesc::*dim, uint lod) const {
    if (d_ == nullptr) return 0;
    const uint n = d_->*dim >> lod;
    return n ? n : 1;
  }
  vec<T, 4> fetch(const Texel& t, uint32_t lod) const {
    static_assert(readable(), "read() needs a texture with access::read, read_write or sample");
    double v[4];
    tsm_emu::load_texel(d_, "read", t, lod, v);
    return as_vec<T>(v);
  }
  template <class V>
  void put(const V& color, const Texel& t, uint32_t lod) const {
    static_assert(writable(), "write() needs a texture with access::write or read_write");
    double v[4];
    as_doubles(color, v);
    tsm_emu::store_texel(d_, t, lod, v);
  }
  // MSL 3.1's texture atomics: on r32Sint / r32Uint textures with access::read_write; the
  // texel's old value comes back as (old, 0, 0, 1).
  T* atomic_texel(const Texel& t) const {
    static_assert(A == access::read_write && sizeof(T) == 4 && std::is_integral<T>::value,
                  "texture atomics need an int or uint texture with access::read_write");
    const uint64_t i = tsm_emu::texel_index(d_, "atomic", t, 0);
    if (d_->format != tsm_emu::TF_I32 && d_->format != tsm_emu::TF_U32)
      tsm_emu::fault("launch", "texture atomics need a 32-bit integer pixel format (an int32 tensor: r32Sint / r32Uint)");
    return static_cast<T*>(d_->data) + i;
  }
  template <class Op>
  vec<T, 4> atomic_update(const Texel& t, Op op) const {
    T* p = atomic_texel(t);
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, op(old), true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return vec<T, 4>(old, T(0), T(0), T(1));
  }
  vec<T, 4> atomic_loaded(const Texel& t) const {
    return vec<T, 4>(__atomic_load_n(atomic_texel(t), __ATOMIC_RELAXED), T(0), T(0), T(1));
  }
  void atomic_stored(const Texel& t, T v) const { __atomic_store_n(atomic_texel(t), v, __ATOMIC_RELAXED); }
  // `expected` is a thread vec<T, 4>*: its x is compared, and on failure gets the texel's value
  // (a strong exchange: the emulator has no spurious failures).
  template <class P>
  bool atomic_exchanged(const Texel& t, const P& expected, T desired) const {
    T& want = (*expected)[0];
    return __atomic_compare_exchange_n(atomic_texel(t), &want, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  }
  template <class C, class... O>
  vec<T, 4> sampled(const sampler& s, int dims, const C& c, int64_t layer, const O&... o) const {
    static_assert(A == access::sample, "sample() needs a texture with access::sample");
    double x[3], v[4];
    coordinates(c, x);
    filtered(d_, s.tsm_sampler_state(), dims, x, options(o...), layer, v);
    return as_vec<T>(v);
  }
  template <class C, class... O>
  vec<T, 4> sampled_cube(const sampler& s, const C& c, int64_t element, const O&... o) const {
    static_assert(A == access::sample, "sample() needs a texture with access::sample");
    double dir[3], v[4];
    coordinates(c, dir);
    const CubeSite site = cube_site(dir, element, s.tsm_sampler_state());
    filtered(d_, site.state, 2, site.uv, options(o...), site.layer, v);
    return as_vec<T>(v);
  }
  template <class C, class... O>
  vec<T, 4> gathered(const sampler& s, const C& c, int64_t layer, component which, const O&... o) const {
    double x[3], texels[4][4];
    coordinates(c, x);
    footprint(d_, s.tsm_sampler_state(), x, options(o...), layer, texels);
    double v[4];
    for (int k = 0; k < 4; ++k) v[k] = texels[k][int(which)];
    return as_vec<T>(v);
  }
  template <class C, class... O>
  vec<T, 4> gathered_cube(const sampler& s, const C& c, int64_t element, component which, const O&... o) const {
    double dir[3], texels[4][4];
    coordinates(c, dir);
    const CubeSite site = cube_site(dir, element, s.tsm_sampler_state());
    footprint(d_, site.state, site.uv, options(o...), site.layer, texels);
    double v[4];
    for (int k = 0; k < 4; ++k) v[k] = texels[k][int(which)];
    return as_vec<T>(v);
  }

  const TextureDesc* d_ = nullptr;
};

template <class C>
Texel at1(const C& c, int64_t layer = 0) {
  double x[3];
  coordinates(c, x);
  Texel t;
  t.x = int64_t(x[0]);
  t.layer = layer;
  return t;
}
template <class C>
Texel at2(const C& c, int64_t layer = 0) {
  double x[3];
  coordinates(c, x);
  Texel t;
  t.x = int64_t(x[0]);
  t.y = int64_t(x[1]);
  t.layer = layer;
  return t;
}
template <class C>
Texel at3(const C& c) {
  double x[3];
  coordinates(c, x);
  Texel t;
  t.x = int64_t(x[0]);
  t.y = int64_t(x[1]);
  t.z = int64_t(x[2]);
  return t;
}
inline uint32_t lod_of(int64_t lod) { return lod < 0 ? 0xffffffffu : uint32_t(lod); }
}  // namespace tsm_tex

// The texture atomics, at the texel `TEXEL` makes of the coordinate parameters `...`.
#define TSM_TEXTURE_ATOMICS(TEXEL, ...)                                                                  \
  vec<T, 4> atomic_fetch_add(__VA_ARGS__, T v) const { return this->atomic_update(TEXEL, [v](T o) { return T(o + v); }); } \
  vec<T, 4> atomic_fetch_sub(__VA_ARGS__, T v) const { return this->atomic_update(TEXEL, [v](T o) { return T(o - v); }); } \
  vec<T, 4> atomic_fetch_and(__VA_ARGS__, T v) const { return this->atomic_update(TEXEL, [v](T o) { return T(o & v); }); } \
  vec<T, 4> atomic_fetch_or(__VA_ARGS__, T v) const { return this->atomic_update(TEXEL, [v](T o) { return T(o | v); }); }  \
  vec<T, 4> atomic_fetch_xor(__VA_ARGS__, T v) const { return this->atomic_update(TEXEL, [v](T o) { return T(o ^ v); }); } \
  vec<T, 4> atomic_fetch_min(__VA_ARGS__, T v) const { return this->atomic_update(TEXEL, [v](T o) { return o < v ? o : v; }); } \
  vec<T, 4> atomic_fetch_max(__VA_ARGS__, T v) const { return this->atomic_update(TEXEL, [v](T o) { return o > v ? o : v; }); } \
  vec<T, 4> atomic_exchange(__VA_ARGS__, T v) const { return this->atomic_update(TEXEL, [v](T) { return v; }); } \
  vec<T, 4> atomic_load(__VA_ARGS__) const { return this->atomic_loaded(TEXEL); }                                 \
  void atomic_store(__VA_ARGS__, T v) const { this->atomic_stored(TEXEL, v); }                                    \
  template <class P>                                                                                             \
  bool atomic_compare_exchange_weak(__VA_ARGS__, const P& expected, T v) const {                                 \
    return this->atomic_exchanged(TEXEL, expected, v);                                                           \
  }
#define TSM_TEXTURE_SIZES_1D \
  uint get_width(uint lod = 0) const { return this->size(&tsm_emu::TextureDesc::width, lod); }
#define TSM_TEXTURE_SIZES_2D \
  TSM_TEXTURE_SIZES_1D       \
  uint get_height(uint lod = 0) const { return this->size(&tsm_emu::TextureDesc::height, lod); }
#define TSM_TEXTURE_ARRAY_SIZE \
  uint get_array_size() const { return this->d_ ? this->d_->layers : 0; }
#define TSM_TEXTURE_CUBE_ARRAY_SIZE \
  uint get_array_size() const { return this->d_ ? this->d_->layers / 6 : 0; }
#define TSM_TEXTURE_SAMPLES \
  uint get_num_samples() const { return this->d_ ? this->d_->samples : 0; }

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct texture1d : tsm_tex::texture_core<T, A, tsm_emu::TK_1D> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_1D>::texture_core;
  TSM_TEXTURE_ATOMICS(tsm_tex::at1(c), uint c)
  TSM_TEXTURE_SIZES_1D
  template <class C> vec<T, 4> read(const C& c, int64_t lod = 0) const { return this->fetch(tsm_tex::at1(c), tsm_tex::lod_of(lod)); }
  template <class V, class C> void write(const V& color, const C& c, int64_t lod = 0) const {
    this->put(color, tsm_tex::at1(c), tsm_tex::lod_of(lod));
  }
  template <class C, class... O> vec<T, 4> sample(const sampler& s, const C& c, const O&... o) const {
    return this->sampled(s, 1, c, 0, o...);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct texture1d_array : tsm_tex::texture_core<T, A, tsm_emu::TK_1D_ARRAY> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_1D_ARRAY>::texture_core;
  TSM_TEXTURE_ATOMICS(tsm_tex::at1(c, array), uint c, uint array)
  TSM_TEXTURE_SIZES_1D
  TSM_TEXTURE_ARRAY_SIZE
  template <class C> vec<T, 4> read(const C& c, int64_t array, int64_t lod = 0) const {
    return this->fetch(tsm_tex::at1(c, array), tsm_tex::lod_of(lod));
  }
  template <class V, class C> void write(const V& color, const C& c, int64_t array, int64_t lod = 0) const {
    this->put(color, tsm_tex::at1(c, array), tsm_tex::lod_of(lod));
  }
  template <class C, class... O> vec<T, 4> sample(const sampler& s, const C& c, int64_t array, const O&... o) const {
    return this->sampled(s, 1, c, array, o...);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct texture2d : tsm_tex::texture_core<T, A, tsm_emu::TK_2D> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_2D>::texture_core;
  TSM_TEXTURE_ATOMICS(tsm_tex::at2(c), uint2 c)
  TSM_TEXTURE_SIZES_2D
  template <class C> vec<T, 4> read(const C& c, int64_t lod = 0) const { return this->fetch(tsm_tex::at2(c), tsm_tex::lod_of(lod)); }
  template <class V, class C> void write(const V& color, const C& c, int64_t lod = 0) const {
    this->put(color, tsm_tex::at2(c), tsm_tex::lod_of(lod));
  }
  template <class C, class... O> vec<T, 4> sample(const sampler& s, const C& c, const O&... o) const {
    return this->sampled(s, 2, c, 0, o...);
  }
  template <class C> vec<T, 4> gather(const sampler& s, const C& c, int2 offset = int2(0), component w = component::x) const {
    return this->gathered(s, c, 0, w, offset);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct texture2d_array : tsm_tex::texture_core<T, A, tsm_emu::TK_2D_ARRAY> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_2D_ARRAY>::texture_core;
  TSM_TEXTURE_ATOMICS(tsm_tex::at2(c, array), uint2 c, uint array)
  TSM_TEXTURE_SIZES_2D
  TSM_TEXTURE_ARRAY_SIZE
  template <class C> vec<T, 4> read(const C& c, int64_t array, int64_t lod = 0) const {
    return this->fetch(tsm_tex::at2(c, array), tsm_tex::lod_of(lod));
  }
  template <class V, class C> void write(const V& color, const C& c, int64_t array, int64_t lod = 0) const {
    this->put(color, tsm_tex::at2(c, array), tsm_tex::lod_of(lod));
  }
  template <class C, class... O> vec<T, 4> sample(const sampler& s, const C& c, int64_t array, const O&... o) const {
    return this->sampled(s, 2, c, array, o...);
  }
  template <class C>
  vec<T, 4> gather(const sampler& s, const C& c, int64_t array, int2 offset = int2(0), component w = component::x) const {
    return this->gathered(s, c, array, w, offset);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct texture3d : tsm_tex::texture_core<T, A, tsm_emu::TK_3D> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_3D>::texture_core;
  TSM_TEXTURE_ATOMICS(tsm_tex::at3(c), uint3 c)
  TSM_TEXTURE_SIZES_2D
  uint get_depth(uint lod = 0) const { return this->size(&tsm_emu::TextureDesc::depth, lod); }
  template <class C> vec<T, 4> read(const C& c, int64_t lod = 0) const { return this->fetch(tsm_tex::at3(c), tsm_tex::lod_of(lod)); }
  template <class V, class C> void write(const V& color, const C& c, int64_t lod = 0) const {
    this->put(color, tsm_tex::at3(c), tsm_tex::lod_of(lod));
  }
  template <class C, class... O> vec<T, 4> sample(const sampler& s, const C& c, const O&... o) const {
    return this->sampled(s, 3, c, 0, o...);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct texturecube : tsm_tex::texture_core<T, A, tsm_emu::TK_CUBE> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_CUBE>::texture_core;
  TSM_TEXTURE_ATOMICS(tsm_tex::at2(c, face > 5 ? -1 : int64_t(face)), uint2 c, uint face)  // MSL 4.0
  TSM_TEXTURE_SIZES_2D
  template <class C> vec<T, 4> read(const C& c, int64_t face, int64_t lod = 0) const {
    return this->fetch(tsm_tex::at2(c, face < 0 || face > 5 ? -1 : face), tsm_tex::lod_of(lod));
  }
  template <class V, class C> void write(const V& color, const C& c, int64_t face, int64_t lod = 0) const {
    this->put(color, tsm_tex::at2(c, face < 0 || face > 5 ? -1 : face), tsm_tex::lod_of(lod));
  }
  template <class C, class... O> vec<T, 4> sample(const sampler& s, const C& c, const O&... o) const {
    return this->sampled_cube(s, c, 0, o...);
  }
  template <class C> vec<T, 4> gather(const sampler& s, const C& c, component w = component::x) const {
    return this->gathered_cube(s, c, 0, w);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct texturecube_array : tsm_tex::texture_core<T, A, tsm_emu::TK_CUBE_ARRAY> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_CUBE_ARRAY>::texture_core;
  TSM_TEXTURE_ATOMICS(tsm_tex::at2(c, face > 5 ? -1 : int64_t(array) * 6 + face), uint2 c, uint face, uint array)
  TSM_TEXTURE_SIZES_2D
  TSM_TEXTURE_CUBE_ARRAY_SIZE
  template <class C> vec<T, 4> read(const C& c, int64_t face, int64_t array, int64_t lod = 0) const {
    return this->fetch(tsm_tex::at2(c, face < 0 || face > 5 ? -1 : array * 6 + face), tsm_tex::lod_of(lod));
  }
  template <class V, class C> void write(const V& color, const C& c, int64_t face, int64_t array, int64_t lod = 0) const {
    this->put(color, tsm_tex::at2(c, face < 0 || face > 5 ? -1 : array * 6 + face), tsm_tex::lod_of(lod));
  }
  template <class C, class... O> vec<T, 4> sample(const sampler& s, const C& c, int64_t array, const O&... o) const {
    return this->sampled_cube(s, c, array, o...);
  }
  template <class C> vec<T, 4> gather(const sampler& s, const C& c, int64_t array, component w = component::x) const {
    return this->gathered_cube(s, c, array, w);
  }
};

template <class T, access A = access::read, memory_coherence = memory_coherence_threadgroup>
struct texture2d_ms : tsm_tex::texture_core<T, A, tsm_emu::TK_2D_MS> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_2D_MS>::texture_core;
  TSM_TEXTURE_SIZES_2D
  TSM_TEXTURE_SAMPLES
  template <class C> vec<T, 4> read(const C& c, int64_t sample) const {
    tsm_tex::Texel t = tsm_tex::at2(c);
    t.sample = sample;
    return this->fetch(t, 0);
  }
};

template <class T, access A = access::read, memory_coherence = memory_coherence_threadgroup>
struct texture2d_ms_array : tsm_tex::texture_core<T, A, tsm_emu::TK_2D_MS_ARRAY> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_2D_MS_ARRAY>::texture_core;
  TSM_TEXTURE_SIZES_2D
  TSM_TEXTURE_ARRAY_SIZE
  TSM_TEXTURE_SAMPLES
  template <class C> vec<T, 4> read(const C& c, int64_t array, int64_t sample) const {
    tsm_tex::Texel t = tsm_tex::at2(c, array);
    t.sample = sample;
    return this->fetch(t, 0);
  }
};

template <class T, access A = access::read, memory_coherence = memory_coherence_threadgroup>
struct texture_buffer : tsm_tex::texture_core<T, A, tsm_emu::TK_BUFFER> {
  using tsm_tex::texture_core<T, A, tsm_emu::TK_BUFFER>::texture_core;
  TSM_TEXTURE_ATOMICS(tsm_tex::at1(c), uint c)
  TSM_TEXTURE_SIZES_1D
  template <class C> vec<T, 4> read(const C& c) const { return this->fetch(tsm_tex::at1(c), 0); }
  template <class V, class C> void write(const V& color, const C& c) const { this->put(color, tsm_tex::at1(c), 0); }
};

// Depth textures: one channel, read and sampled as a scalar; compared against a reference.
template <class T, access A, int Kind>
struct depth_core : tsm_tex::texture_core<T, A, Kind> {
  static_assert(std::is_same<T, float>::value || std::is_same<T, half>::value,
                "a depth texture's element type is float or half");
  using tsm_tex::texture_core<T, A, Kind>::texture_core;
  static constexpr int tsm_kind = Kind + tsm_emu::TK_DEPTH;  // what Python is told: no channel dimension

 protected:
  template <class C, class... O>
  T compared(const sampler& s, int dims, bool cube, const C& c, int64_t layer, float reference, const O&... o) const {
    static_assert(A == access::sample, "sample_compare() needs a depth texture with access::sample");
    double x[3];
    tsm_tex::coordinates(c, x);
    tsm_tex::CubeSite site{layer, {x[0], x[1], x[2]}, s.tsm_sampler_state()};
    if (cube) site = tsm_tex::cube_site(x, layer, site.state);
    layer = site.layer;
    const tsm_emu::SamplerDesc& st = site.state;
    // Each texel compared, then filtered (percentage-closer filtering).
    const tsm_tex::Options opt = tsm_tex::options(o...);
    const double* origin = site.uv;
    double texels[4][4];
    const bool linear = st.mag_filter == int(filter::linear) || st.min_filter == int(filter::linear);
    if (!linear) {
      double v[4];
      tsm_tex::filtered(this->d_, st, dims, origin, opt, layer, v);
      return T(tsm_tex::compare(st.compare, reference, v[0]) ? 1 : 0);
    }
    tsm_tex::footprint(this->d_, st, origin, opt, layer, texels);
    const double px = (st.normalized ? origin[0] * this->d_->width : origin[0]) - 0.5;
    const double py = (st.normalized ? origin[1] * this->d_->height : origin[1]) - 0.5;
    const double fx = px - std::floor(px), fy = py - std::floor(py);
    const double w[4] = {(1 - fx) * fy, fx * fy, fx * (1 - fy), (1 - fx) * (1 - fy)};
    double r = 0;
    for (int k = 0; k < 4; ++k) r += w[k] * (tsm_tex::compare(st.compare, reference, texels[k][0]) ? 1 : 0);
    return T(r);
  }
  template <class C, class... O>
  vec<T, 4> gathered_compare(const sampler& s, bool cube, const C& c, int64_t layer, float reference,
                             const O&... o) const {
    double x[3], texels[4][4], v[4];
    tsm_tex::coordinates(c, x);
    tsm_tex::CubeSite site{layer, {x[0], x[1], x[2]}, s.tsm_sampler_state()};
    if (cube) site = tsm_tex::cube_site(x, layer, site.state);
    tsm_tex::footprint(this->d_, site.state, site.uv, tsm_tex::options(o...), site.layer, texels);
    for (int k = 0; k < 4; ++k) v[k] = tsm_tex::compare(site.state.compare, reference, texels[k][0]) ? 1 : 0;
    return tsm_tex::as_vec<T>(v);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct depth2d : depth_core<T, A, tsm_emu::TK_2D> {
  using depth_core<T, A, tsm_emu::TK_2D>::depth_core;
  TSM_TEXTURE_SIZES_2D
  template <class C> T read(const C& c, int64_t lod = 0) const { return this->fetch(tsm_tex::at2(c), tsm_tex::lod_of(lod))[0]; }
  template <class C> void write(T depth, const C& c, int64_t lod = 0) const {
    this->put(depth, tsm_tex::at2(c), tsm_tex::lod_of(lod));
  }
  template <class C, class... O> T sample(const sampler& s, const C& c, const O&... o) const {
    return this->sampled(s, 2, c, 0, o...)[0];
  }
  template <class C, class... O> T sample_compare(const sampler& s, const C& c, float ref, const O&... o) const {
    return this->compared(s, 2, false, c, 0, ref, o...);
  }
  template <class C> vec<T, 4> gather(const sampler& s, const C& c, int2 offset = int2(0)) const {
    return this->gathered(s, c, 0, component::x, offset);
  }
  template <class C> vec<T, 4> gather_compare(const sampler& s, const C& c, float ref, int2 offset = int2(0)) const {
    return this->gathered_compare(s, false, c, 0, ref, offset);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct depth2d_array : depth_core<T, A, tsm_emu::TK_2D_ARRAY> {
  using depth_core<T, A, tsm_emu::TK_2D_ARRAY>::depth_core;
  TSM_TEXTURE_SIZES_2D
  TSM_TEXTURE_ARRAY_SIZE
  template <class C> T read(const C& c, int64_t array, int64_t lod = 0) const {
    return this->fetch(tsm_tex::at2(c, array), tsm_tex::lod_of(lod))[0];
  }
  template <class C> void write(T depth, const C& c, int64_t array, int64_t lod = 0) const {
    this->put(depth, tsm_tex::at2(c, array), tsm_tex::lod_of(lod));
  }
  template <class C, class... O> T sample(const sampler& s, const C& c, int64_t array, const O&... o) const {
    return this->sampled(s, 2, c, array, o...)[0];
  }
  template <class C, class... O> T sample_compare(const sampler& s, const C& c, int64_t array, float ref, const O&... o) const {
    return this->compared(s, 2, false, c, array, ref, o...);
  }
  template <class C> vec<T, 4> gather(const sampler& s, const C& c, int64_t array, int2 offset = int2(0)) const {
    return this->gathered(s, c, array, component::x, offset);
  }
  template <class C>
  vec<T, 4> gather_compare(const sampler& s, const C& c, int64_t array, float ref, int2 offset = int2(0)) const {
    return this->gathered_compare(s, false, c, array, ref, offset);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct depthcube : depth_core<T, A, tsm_emu::TK_CUBE> {
  using depth_core<T, A, tsm_emu::TK_CUBE>::depth_core;
  TSM_TEXTURE_SIZES_2D
  template <class C> T read(const C& c, int64_t face, int64_t lod = 0) const {
    return this->fetch(tsm_tex::at2(c, face < 0 || face > 5 ? -1 : face), tsm_tex::lod_of(lod))[0];
  }
  template <class C, class... O> T sample(const sampler& s, const C& c, const O&... o) const {
    return this->sampled_cube(s, c, 0, o...)[0];
  }
  template <class C, class... O> T sample_compare(const sampler& s, const C& c, float ref, const O&... o) const {
    return this->compared(s, 2, true, c, 0, ref, o...);
  }
  template <class C> vec<T, 4> gather(const sampler& s, const C& c) const { return this->gathered_cube(s, c, 0, component::x); }
  template <class C> vec<T, 4> gather_compare(const sampler& s, const C& c, float ref) const {
    return this->gathered_compare(s, true, c, 0, ref);
  }
};

template <class T, access A = access::sample, memory_coherence = memory_coherence_threadgroup>
struct depthcube_array : depth_core<T, A, tsm_emu::TK_CUBE_ARRAY> {
  using depth_core<T, A, tsm_emu::TK_CUBE_ARRAY>::depth_core;
  TSM_TEXTURE_SIZES_2D
  TSM_TEXTURE_CUBE_ARRAY_SIZE
  template <class C> T read(const C& c, int64_t face, int64_t array, int64_t lod = 0) const {
    return this->fetch(tsm_tex::at2(c, face < 0 || face > 5 ? -1 : array * 6 + face), tsm_tex::lod_of(lod))[0];
  }
  template <class C, class... O> T sample(const sampler& s, const C& c, int64_t array, const O&... o) const {
    return this->sampled_cube(s, c, array, o...)[0];
  }
  template <class C, class... O>
  T sample_compare(const sampler& s, const C& c, int64_t array, float ref, const O&... o) const {
    return this->compared(s, 2, true, c, array, ref, o...);
  }
  template <class C> vec<T, 4> gather(const sampler& s, const C& c, int64_t array) const {
    return this->gathered_cube(s, c, array, component::x);
  }
  template <class C> vec<T, 4> gather_compare(const sampler& s, const C& c, int64_t array, float ref) const {
    return this->gathered_compare(s, true, c, array, ref);
  }
};

template <class T, access A = access::read, memory_coherence = memory_coherence_threadgroup>
struct depth2d_ms : depth_core<T, A, tsm_emu::TK_2D_MS> {
  using depth_core<T, A, tsm_emu::TK_2D_MS>::depth_core;
  TSM_TEXTURE_SIZES_2D
  TSM_TEXTURE_SAMPLES
  template <class C> T read(const C& c, int64_t sample) const {
    tsm_tex::Texel t = tsm_tex::at2(c);
    t.sample = sample;
    return this->fetch(t, 0)[0];
  }
};

template <class T, access A = access::read, memory_coherence = memory_coherence_threadgroup>
struct depth2d_ms_array : depth_core<T, A, tsm_emu::TK_2D_MS_ARRAY> {
  using depth_core<T, A, tsm_emu::TK_2D_MS_ARRAY>::depth_core;
  TSM_TEXTURE_SIZES_2D
  TSM_TEXTURE_ARRAY_SIZE
  TSM_TEXTURE_SAMPLES
  template <class C> T read(const C& c, int64_t array, int64_t sample) const {
    tsm_tex::Texel t = tsm_tex::at2(c, array);
    t.sample = sample;
    return this->fetch(t, 0)[0];
  }
};

#undef TSM_TEXTURE_ATOMICS
#undef TSM_TEXTURE_SIZES_1D
#undef TSM_TEXTURE_SIZES_2D
#undef TSM_TEXTURE_ARRAY_SIZE
#undef TSM_TEXTURE_CUBE_ARRAY_SIZE
#undef TSM_TEXTURE_SAMPLES

}  // namespace metal
