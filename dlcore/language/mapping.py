"""Which implementation each helper takes under each Triton (:mod:`dlcore.language.flavour`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlcore.language import plain
from dlcore.language.flavour import ActiveTriton, TritonFlavour


@dataclass(frozen=True)
class Helpers:
    """The objects a kernel reaches as ``dl.<name>``: each a ``@triton.jit`` function, a Triton
    builtin, or an iterator class that Triton's code generator accepts in a ``for`` loop."""

    persistent_range: Any
    compile_hint: Any
    multibuffer: Any
    extract_slice: Any
    insert_slice: Any


def helpers_for(active: ActiveTriton) -> Helpers:
    """triton-ascend's extension where it is the active Triton and has one; plain Triton otherwise.

    The persistent loop is Python's ``range`` under both: Triton's code generator turns it into the
    same ``scf.for`` as ``tl.range`` without options. triton-ascend's ``parallel`` is not a
    persistent loop: it binds its iterations to the two vector sub-cores of a 910B core and so
    needs them independent, while a persistent program carries state across its work items
    (``rms_norm``'s dweight share, its prefetched next rows).
    """
    ext = active.extension
    if active.flavour is TritonFlavour.ASCEND and ext is not None:
        return Helpers(range, ext.compile_hint, ext.multibuffer, ext.extract_slice, ext.insert_slice)
    return Helpers(range, plain.compile_hint, plain.multibuffer, plain.extract_slice, plain.insert_slice)
