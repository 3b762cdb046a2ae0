"""Texture and sampler arguments of the emulator's kernels: tensors bound as textures, and
:class:`Sampler`, the sampler state a ``[[sampler(n)]]`` takes.

A texture is a contiguous CPU tensor, channels last (``(H, W, C)`` for a ``texture2d``; a
depth texture has no C); its pixel format follows from the tensor's dtype and the texture's
element type. docs/emulator.md ("Textures and samplers") has the shape of every texture
type and the formats; ``_DIMENSIONS`` and the ``_*_FORMATS`` tables below are them.

Layer: run (the layers are in the package's docstring), beside _library, which calls it.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .._binding import MAX_SAMPLERS, MAX_TEXTURES, P_SAMPLER, P_TEXTURE, ParamInfo
from ..errors import LaunchError

# tsm_emu::TextureFormat and TextureKind (csrc/emulator/include/tsm_emu/texture.h).
F32, F16, UNORM8, SNORM8, UNORM16, SNORM16, I32, I16, I8, U32, U16, U8 = range(12)
KINDS = ("texture1d", "texture1d_array", "texture2d", "texture2d_array", "texture3d", "texturecube",
         "texturecube_array", "texture2d_ms", "texture2d_ms_array", "texture_buffer")
DEPTH = 16  # added to a depth texture's kind
ACCESS = ("sample", "read", "write", "read_write")

# The tensor's dimensions per kind (without C), outermost first.
_DIMENSIONS = {0: "W", 1: "LW", 2: "HW", 3: "LHW", 4: "DHW", 5: "6HW", 6: "L6HW", 7: "HWS", 8: "LHWS", 9: "W"}

_FLOAT_FORMATS = {torch.float32: F32, torch.float16: F16, torch.uint8: UNORM8, torch.int8: SNORM8,
                  torch.int16: SNORM16}
_INT_FORMATS = {torch.int32: I32, torch.int16: I16, torch.int8: I8}
_UINT_FORMATS = {torch.uint8: U8, torch.int32: U32}
_DEPTH_FORMATS = {torch.float32: F32}
for _name, _float, _uint, _depth in (("uint16", UNORM16, U16, UNORM16), ("uint32", None, U32, None)):
    _dtype = getattr(torch, _name, None)  # torch 2.3 on
    if _dtype is not None:
        if _float is not None:
            _FLOAT_FORMATS[_dtype] = _float
        _UINT_FORMATS[_dtype] = _uint
        if _depth is not None:
            _DEPTH_FORMATS[_dtype] = _depth


class TextureDesc(ctypes.Structure):
    """``tsm_emu::TextureDesc``."""
    _fields_ = [("data", ctypes.c_void_p), ("bytes", ctypes.c_uint64), ("width", ctypes.c_uint32),
                ("height", ctypes.c_uint32), ("depth", ctypes.c_uint32), ("layers", ctypes.c_uint32),
                ("samples", ctypes.c_uint32), ("channels", ctypes.c_uint32), ("format", ctypes.c_int32),
                ("kind", ctypes.c_int32), ("name", ctypes.c_char_p)]


class SamplerDesc(ctypes.Structure):
    """``tsm_emu::SamplerDesc``."""
    _fields_ = [("normalized", ctypes.c_int32), ("address", ctypes.c_int32 * 3), ("mag_filter", ctypes.c_int32),
                ("min_filter", ctypes.c_int32), ("mip_filter", ctypes.c_int32), ("compare", ctypes.c_int32),
                ("border", ctypes.c_int32)]


_ADDRESS = ("repeat", "mirrored_repeat", "clamp_to_edge", "clamp_to_zero", "clamp_to_border")
_FILTER = ("nearest", "linear")
_MIP_FILTER = ("none", "nearest", "linear")
_COMPARE = ("none", "less", "less_equal", "greater", "greater_equal", "equal", "not_equal", "always", "never")
_BORDER = ("transparent_black", "opaque_black", "opaque_white")


def _pick(what: str, value: str, choices: Sequence[str]) -> int:
    if value not in choices:
        raise ValueError(f"Sampler: {what} must be one of {', '.join(choices)}; got {value!r}")
    return choices.index(value)


@dataclass(frozen=True)
class Sampler:
    """The state of a ``[[sampler(n)]]`` argument, as ``MTLSamplerDescriptor`` gives it, with
    Metal's defaults. ``address`` sets s, t and r at once; ``s_address`` / ``t_address`` /
    ``r_address`` override one; ``filter`` sets ``mag_filter`` and ``min_filter``.
    ``coord="pixel"``: unnormalised coordinates, in texels."""
    coord: str = "normalized"
    address: str = "clamp_to_edge"
    s_address: Optional[str] = None
    t_address: Optional[str] = None
    r_address: Optional[str] = None
    filter: str = "nearest"
    mag_filter: Optional[str] = None
    min_filter: Optional[str] = None
    mip_filter: str = "none"
    compare_func: str = "never"
    border_color: str = "transparent_black"

    def __post_init__(self) -> None:
        self.desc()  # every name checked when the sampler is made

    def desc(self) -> SamplerDesc:
        d = SamplerDesc()
        d.normalized = 1 - _pick("coord", self.coord, ("normalized", "pixel"))
        default = _pick("address", self.address, _ADDRESS)
        for i, axis in enumerate((self.s_address, self.t_address, self.r_address)):
            d.address[i] = default if axis is None else _pick("s/t/r_address", axis, _ADDRESS)
        both = _pick("filter", self.filter, _FILTER)
        d.mag_filter = both if self.mag_filter is None else _pick("mag_filter", self.mag_filter, _FILTER)
        d.min_filter = both if self.min_filter is None else _pick("min_filter", self.min_filter, _FILTER)
        d.mip_filter = _pick("mip_filter", self.mip_filter, _MIP_FILTER)
        d.compare = _pick("compare_func", self.compare_func, _COMPARE)
        d.border = _pick("border_color", self.border_color, _BORDER)
        return d


def describe(param: ParamInfo) -> str:
    """The texture type of a texture parameter, in Metal's words."""
    kind = param.size & 0xFF
    name = ("depth" + KINDS[kind & ~DEPTH][len("texture"):]) if kind & DEPTH else KINDS[kind]
    return f"{name}<{_ELEMENT.get(param.scalar, '?')}, access::{ACCESS[param.size >> 8]}>"


_ELEMENT = {"f": "float", "h": "half", "i": "int", "u": "uint"}


def _shape_text(kind: int) -> str:
    dims = ", ".join(_DIMENSIONS[kind & ~DEPTH])
    return f"({dims})" if kind & DEPTH else f"({dims}, C)"


def texture_desc(kernel: str, index: int, param: ParamInfo, tensor) -> Tuple[TextureDesc, object]:
    """The description of ``tensor`` bound to ``[[texture(index)]]`` ``param``, and what must
    stay alive while it is used."""
    kind = param.size & 0xFF  # TextureKind (+ DEPTH); the access is above it
    where = f"{kernel}: [[texture({index})]] {param.describe()}"
    if not isinstance(tensor, torch.Tensor):
        raise LaunchError(f"{where}: bind a tensor of shape {_shape_text(kind)} ({describe(param)}), "
                          f"got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise LaunchError(f"{where}: the emulator runs on CPU tensors, got a tensor on {tensor.device}")
    if not tensor.is_contiguous():
        raise LaunchError(f"{where}: the tensor must be contiguous (call .contiguous())")
    dims = _DIMENSIONS[kind & ~DEPTH]
    depth = bool(kind & DEPTH)
    shape = tuple(tensor.shape)
    expected = len(dims) + (0 if depth else 1)
    if len(shape) != expected or (not depth and shape[-1] not in (1, 2, 4)) or 0 in shape or \
            ("6" in dims and shape[dims.index("6")] != 6):
        channels = "" if depth else " with C 1, 2 or 4 channels"
        raise LaunchError(f"{where}: a {describe(param)} binds a tensor of shape {_shape_text(kind)}"
                          f"{channels} (6 faces for a cube), got shape {shape}")
    if depth:
        formats = _DEPTH_FORMATS
    else:
        formats = {"f": _FLOAT_FORMATS, "h": _FLOAT_FORMATS, "i": _INT_FORMATS, "u": _UINT_FORMATS}[param.scalar]
    if tensor.dtype not in formats:
        names = ", ".join(str(d).replace("torch.", "") for d in formats)
        raise LaunchError(f"{where}: a {describe(param)} binds a tensor of {names}; got {tensor.dtype} "
                          "(see the pixel formats in docs/emulator.md)")
    sizes = dict(zip(dims, shape))
    d = TextureDesc()
    d.data = tensor.data_ptr()
    d.bytes = tensor.numel() * tensor.element_size()
    d.width = sizes.get("W", 1)
    d.height = sizes.get("H", 1)
    d.depth = sizes.get("D", 1)
    d.layers = sizes.get("L", 1) * sizes.get("6", 1)
    d.samples = sizes.get("S", 1)
    d.channels = 1 if depth else shape[-1]
    d.format = formats[tensor.dtype]
    d.kind = kind & ~DEPTH
    name = param.name.encode()
    d.name = name
    return d, (tensor, name)


def _by_index(kernel: str, table: str, given: Mapping[int, object], wanted: Dict[int, ParamInfo]) -> List[object]:
    """A mapping {index: argument} as the list ``bind`` takes (None where nothing is given)."""
    for index in given:
        if not isinstance(index, int) or isinstance(index, bool) or index not in wanted:
            declared = ", ".join(map(str, sorted(wanted))) or "none"
            raise LaunchError(f"{kernel}: {table}= has key {index!r}; the kernel declares indices {declared}")
    return [given.get(i) for i in range(max(wanted) + 1)] if wanted else []


def bind(kernel: str, params: Sequence[ParamInfo],
         textures: Optional[Union[Sequence[object], Mapping[int, object]]],
         samplers: Optional[Union[Sequence[Optional[Sampler]], Mapping[int, Sampler]]], launch) -> List[object]:
    """Fill ``launch.textures`` and ``launch.samplers`` (a tsm_launch) from the arguments; what
    must stay alive during the dispatch is returned."""
    keep: List[object] = []
    declared = {p.index: p for p in params if p.kind == P_TEXTURE}
    sampler_params = {p.index: p for p in params if p.kind == P_SAMPLER}
    for table, given, wanted, limit in (("textures", textures, declared, MAX_TEXTURES),
                                        ("samplers", samplers, sampler_params, MAX_SAMPLERS)):
        if isinstance(given, Mapping):  # {index: tensor}, as setTexture:atIndex: binds them
            given = _by_index(kernel, table, given, wanted)
        given = list(given or [])
        if len(given) > limit:
            raise LaunchError(f"{kernel}: {len(given)} {table}; Metal binds at most {limit}")
        needed = max(wanted) + 1 if wanted else 0
        if len(given) != needed:
            what = "[[texture(n)]]" if table == "textures" else "[[sampler(n)]]"
            raise LaunchError(f"{kernel}: {table}= must give one entry per {what} index up to the last "
                              f"the kernel declares ({needed}; None at an index it does not use), got "
                              f"{len(given)}")
        for i, arg in enumerate(given):
            if arg is None:
                continue
            if i not in wanted:
                raise LaunchError(f"{kernel}: {table}[{i}] has no parameter at that index; pass None there")
            if table == "textures":
                desc, alive = texture_desc(kernel, i, wanted[i], arg)
                launch.textures[i] = ctypes.addressof(desc)
            else:
                if not isinstance(arg, Sampler):
                    raise LaunchError(f"{kernel}: samplers[{i}] ({wanted[i].describe()}) must be a "
                                      f"torch_sparse_metal.emulator.Sampler, got {type(arg).__name__}")
                desc, alive = arg.desc(), None
                launch.samplers[i] = ctypes.addressof(desc)
            keep += [desc, alive]
    return keep
