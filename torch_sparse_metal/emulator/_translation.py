"""The emulator's translation of one shader, pass after pass: parse the emulator's view with
clang, lower the forms C++ reads differently, then plan how each kernel's threadgroup runs.

Layer: drive (the layers are in the package's docstring). Imports every layer below; the
compiler (_compiler) runs the check (_frontend), this, then the text rewrite (_rewrite).
"""
from __future__ import annotations

from typing import Sequence

from . import _cxx_forms, _designators, _msl_text, _program_constants, _schedule, _thread_arrays
from ._clang import _cindex, _main_file_cursors, language_version_number
from ._clang_view import _parse


def emulator_edits(preprocessed: str, *, language_version: str, main_file: str = "<msl>",
                   kernels: Sequence["_msl_text.Kernel"] = (), regions: bool = True):
    """Edits of the emulator's view of a shader (offsets into ``preprocessed``) that give its
    C++ Metal's meaning where C++ differs, and how each of ``kernels`` runs (a
    ``_schedule.Translation``):

    * every integer (or type-dependent) ``/``, ``%``, ``/=`` and ``%=`` becomes a call of
      ``tsm_emu::div``/``rem``/... (integer division by zero, and INT_MIN / -1, are undefined
      in Metal: the emulator gives one documented result on every architecture, and the
      sanitizer reports them);
    * every ``a * b`` of two simdgroup matrices becomes a call, a SIMD-group function with
      a site (see _matrix_products);
    * functions and member functions overloaded on address space (which the emulator's C++
      erases) get a name per overload, and each call the overload clang chose; constructors,
      conversion functions and operators, which have no name to call, keep one definition
      when the overloads' bodies are the same (MLX's pattern), and are an error otherwise;
    * array designators in local initialisers (``float s[N] = { [0 ... N-1] = 0 };``,
      which g++ has in C only) become calls after the declaration (see _designators);
    * program-scope ``constant`` arrays and structs are registered as regions for the
      checked pointers that point into them (see _program_constants);
    * with ``regions``, kernels whose only synchronisation is threadgroup barriers in their
      own bodies get a group function that runs a threadgroup as a loop (see _regions).
    """
    cindex = _cindex()
    prepared, tu, path = _parse(preprocessed, language_version_number(language_version), main_file,
                                emulator=True)
    source = prepared.source
    _cxx_forms.stored_pointers(tu, path)
    edits = _cxx_forms.address_space_overloads(tu, path, prepared, preprocessed)
    k = cindex.CursorKind
    found = _main_file_cursors(tu, path, (k.CALL_EXPR, k.CONDITIONAL_OPERATOR, k.UNEXPOSED_EXPR))
    edits += _cxx_forms.pointer_argument_conversions(found[k.CALL_EXPR], prepared, preprocessed)
    edits += _cxx_forms.swizzle_arguments(found[k.CALL_EXPR], prepared, preprocessed)
    edits += _cxx_forms.threadgroup_array_arguments(found[k.CALL_EXPR], prepared, preprocessed)
    edits += _cxx_forms.template_pointer_arguments(found[k.CALL_EXPR], found[k.UNEXPOSED_EXPR], prepared, preprocessed)
    edits += _cxx_forms.threadgroup_reference_arguments(found[k.CALL_EXPR], prepared, preprocessed)
    edits += _cxx_forms.bfloat_conditional_conversions(found[k.CONDITIONAL_OPERATOR], prepared, preprocessed)
    edits += _cxx_forms.address_space_specialisations(tu, path, prepared, preprocessed)
    edits += _designators.edits(tu, path, source, preprocessed)
    edits += _program_constants.registrations(tu, path, source, preprocessed)
    edits += _program_constants.made_const(tu, path, source, preprocessed)
    edits += _cxx_forms.operator_calls(tu, path, source, preprocessed)
    edits += _thread_arrays.edits(tu, path, source, preprocessed)  # after the divisions: see there
    replaced = [(a, b) for a, b, _ in edits if a < b]
    # (a literal the check's view converts to double is in the emulator's own double code)
    doubles = {source.original(literal.extent.start.offset) for conversion in found[k.UNEXPOSED_EXPR]
               if conversion.type.get_canonical().spelling in ("double", "const double")
               for literal in [next(conversion.get_children(), None)]
               if literal is not None and literal.kind == k.FLOATING_LITERAL}
    edits += [e for e in _cxx_forms.float_literals(preprocessed)
              if e[0] not in doubles and not any(a <= e[0] < b for a, b in replaced)]
    translation = _schedule.plan(tu, path, prepared, preprocessed, edits, kernels, enabled=regions)
    translation.edits += edits
    return translation
