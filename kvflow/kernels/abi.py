"""The CPU kernels' C interface, read from its one declaration: csrc/kvflow_cpu.h.

The header's structs become ctypes Structures (`STRUCTS["KvflowStep"]`, or `abi.KvflowStep`), its callback
typedefs ctypes function types, and its prototypes the signatures of the library's functions. `native()`
returns the built library's entry points as Python functions whose parameters carry the header's names,
so a call reads `native().kvflow_paged_attention(layer=..., step=..., rows=..., ...)` and a missing,
extra or misplaced argument fails in Python instead of corrupting memory in C. Nothing here restates a
field or an argument list: change the header and the Python side follows.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

HEADER = Path(__file__).parent / "csrc" / "kvflow_cpu.h"

_SCALARS = {
    "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16,
    "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
}


@dataclass(frozen=True)
class Prototype:
    name: str
    restype: object  # a ctypes type, or None for void
    params: tuple[tuple[str, object], ...]  # (name, ctypes type) in order


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _split_declaration(decl: str) -> tuple[str, list[str]]:
    """'const float* cos' -> ('const float*', ['cos']); 'int32_t a, b' -> ('int32_t', ['a', 'b'])."""
    m = re.fullmatch(r"\s*(.*?[\w*])\s+(\w+(?:\s*,\s*\w+)*)\s*", decl)
    if m is None:
        raise ValueError(f"{HEADER.name}: cannot read declaration {decl!r}")
    return " ".join(m.group(1).split()), [n.strip() for n in m.group(2).split(",")]


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = _strip_comments(text)
        self.structs: dict[str, type[ctypes.Structure]] = {}
        self.callbacks: dict[str, object] = {}
        self.prototypes: dict[str, Prototype] = {}

    def ctype(self, type_name: str, in_struct: bool) -> object:
        base = type_name.replace("const ", "").strip()
        if base.endswith("*"):
            target = base[:-1].strip()
            if target in self.structs:
                return ctypes.POINTER(self.structs[target])
            return ctypes.c_void_p  # data pointers travel as addresses (tensor.data_ptr())
        if base in _SCALARS:
            return _SCALARS[base]
        if base in self.structs and in_struct:
            return self.structs[base]
        if base in self.callbacks:
            return self.callbacks[base]
        if base == "void" and not in_struct:
            return None
        raise ValueError(f"{HEADER.name}: unknown type {type_name!r}")

    def read(self) -> _Reader:
        pattern = re.compile(r"typedef\s+(.+?)\(\s*\*\s*(\w+)\s*\)\s*\(([^)]*)\)\s*;|struct\s+(\w+)\s*\{([^}]*)\}\s*;"
                             r"|([\w\s*]+?)\s*\b(kvflow_\w+)\s*\(([^)]*)\)\s*;")
        for m in pattern.finditer(self.text):  # in order: a struct may use the ones above it
            if m.group(2):
                restype = self.ctype(m.group(1).strip(), False)
                self.callbacks[m.group(2)] = ctypes.CFUNCTYPE(restype, *[t for _, t in self._params(m.group(3))])
            elif m.group(4):
                self._struct(m.group(4), m.group(5))
            else:
                name = m.group(7)
                restype = self.ctype(m.group(6).replace("extern", "").replace('"C"', "").strip(), False)
                self.prototypes[name] = Prototype(name, restype, tuple(self._params(m.group(8))))
        return self

    def _struct(self, name: str, body: str) -> None:
        fields = []
        for decl in filter(str.strip, body.split(";")):
            type_name, names = _split_declaration(decl)
            fields += [(n, self.ctype(type_name, True)) for n in names]
        self.structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"{name} of {HEADER.name}"})

    def _params(self, text: str) -> list[tuple[str, object]]:
        text = text.strip()
        if text in ("", "void"):
            return []
        out = []
        for decl in text.split(","):
            type_name, names = _split_declaration(decl)
            out.append((names[0], self.ctype(type_name, False)))
        return out


_ABI = _Reader(HEADER.read_text()).read()
STRUCTS: dict[str, type[ctypes.Structure]] = _ABI.structs
CALLBACKS: dict[str, object] = _ABI.callbacks
PROTOTYPES: dict[str, Prototype] = _ABI.prototypes
globals().update(STRUCTS)  # abi.KvflowStep, abi.KvflowPackedWeight, ...
globals().update(CALLBACKS)


def _wrapper(fn, proto: Prototype):
    """A Python function with the prototype's parameter names that calls the C function."""
    names = [n for n, _ in proto.params]
    args = ", ".join(names)
    source = f"def {proto.name}({args}):\n    return _fn({args})\n"
    scope: dict = {"_fn": fn}
    exec(compile(source, f"<kvflow abi: {proto.name}>", "exec"), scope)
    wrapper = scope[proto.name]
    wrapper.__doc__ = f"{proto.name}({', '.join(names)}) from {HEADER.name}"
    return wrapper


def bind(lib: ctypes.CDLL) -> SimpleNamespace:
    """The library's entry points, each with the header's signature (argtypes, restype, parameter names)."""
    functions = {}
    for name, proto in PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes = [t for _, t in proto.params]
        fn.restype = proto.restype
        functions[name] = _wrapper(fn, proto)
    return SimpleNamespace(**functions)


@functools.cache
def native(tier: str | None = None) -> SimpleNamespace | None:
    """The kernel library's functions for a CPU tier (default: the one in use, kernels/cpu_features), or
    None where it cannot be built (kernels/build)."""
    from kvflow.kernels import build, cpu_features

    lib = build.load(tier or cpu_features.isa_tier())
    return None if lib is None else bind(lib)
