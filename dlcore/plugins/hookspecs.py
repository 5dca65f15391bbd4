"""The contract between the dlcore core and every plugin.

Each hook is a function with only a docstring. A plugin is a module (or any object) named by an
entry point in one of the groups ``dlcore.backends``, ``dlcore.kernels``, ``dlcore.passes`` or
``dlcore.strategies``; it implements some of these hooks with functions marked ``@dlcore.hookimpl``
of the same name. A hook implementation that matches no spec below rejects the whole plugin.

All hooks are collecting hooks: dlcore calls every implementation, plugin by plugin, and an
exception in one plugin is recorded against that plugin (shown by ``dlcore plugins``) without
affecting the others. The objects returned are plain declarations; a plugin never reaches into the
core, it only hands these objects over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from dlcore.declarations.backend import Backend
    from dlcore.declarations.device import DeviceProfile
    from dlcore.declarations.implementation import Implementation
    from dlcore.declarations.op import Op
    from dlcore.declarations.protocols import CompilerPass, SearchStrategy
    from dlcore.declarations.signature import Signature
    from dlcore.declarations.space import SearchSpace

hookspec = pluggy.HookspecMarker("dlcore")
hookimpl = pluggy.HookimplMarker("dlcore")


# --------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------


@hookspec
def dlcore_backends() -> list[Backend]:
    """Declare hardware backends.

    Called once, when the plugins are loaded. Must not probe devices or import vendor runtimes:
    ``Backend.available()`` is asked lazily, the first time a tensor of the backend's device type
    is seen.

    :return: the :class:`dlcore.declarations.backend.Backend` objects this plugin provides, each owning one or
        more torch device types (``"cuda"``, ``"npu"``, ...). A device type owned by two backends
        is an error reported against the later plugin.
    """


@hookspec
def dlcore_refine_space(
    space: SearchSpace, signature: Signature, profile: DeviceProfile
) -> SearchSpace | None:
    """Adapt a kernel's search space to a chip.

    Called before tuning an implementation on a device, once per (implementation, signature,
    device). Every plugin is asked, in registration order, each one receiving the space the
    previous one returned.

    :param space: the implementation's declared space (or the previous plugin's refinement).
    :param signature: the inputs' signature.
    :param profile: the device the space will be searched on.
    :return: a refined :class:`~dlcore.declarations.space.SearchSpace`, or ``None`` to leave it as is.
    """


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@hookspec
def dlcore_ops() -> list[Op]:
    """Declare operators: their argument schema, torch reference and key policy.

    Called once, when the plugins are loaded. An op name declared twice is an error reported
    against the later plugin.

    :return: :class:`dlcore.declarations.op.Op` declarations.
    """


@hookspec
def dlcore_implementations() -> list[Implementation]:
    """Provide implementations of operators (of this plugin's ops or any other plugin's).

    Called once, when the plugins are loaded, after :func:`dlcore_ops`. An implementation of an
    op no loaded plugin declares (its plugin disabled, or missing) is noted on its plugin's record
    (``dlcore plugins``) and ignored; the plugin's other implementations stay.

    :return: :class:`dlcore.declarations.implementation.Implementation` objects.
    """


# --------------------------------------------------------------------------------------------
# compiler passes
# --------------------------------------------------------------------------------------------


@hookspec
def dlcore_passes() -> list[CompilerPass]:
    """Provide compiler passes.

    Called once, when the plugins are loaded (dlcore's own ``grid_folding`` and ``ir_dump`` arrive
    this way too). Each :class:`dlcore.compiler.passes.Pass` declares its ``name`` (unique), its
    ``stage``, the ``backends`` it applies to (empty: all), whether it is on by default
    (``default_on``: everywhere, nowhere, or on the listed backends) and its ``order`` within the
    stage. Users switch passes off with ``DLCORE_DISABLE_PASSES=a,b`` and opt-in passes on with
    ``DLCORE_ENABLE_PASSES=a,b`` (or ``dlcore lower --pass/--no-pass``).

    What ``run`` receives depends on the stage:

    - ``"ast"``: ``run(tree, kernel)`` with the kernel's ``ast.FunctionDef`` (decorators removed)
      and the ``@triton.jit`` function; returns a rewritten tree, or ``None`` for no change. The
      rewritten kernel is built once per kernel and keeps its module globals.
    - ``"launch"``: ``run(call, profile)`` with a :class:`~dlcore.declarations.implementation.KernelCall` of a
      plan and the :class:`~dlcore.declarations.device.DeviceProfile` it will run on; returns a new call (kernel,
      grid, arguments), or ``None`` to leave it. Called before every launch of a plan and before
      lowering it; it must be cheap when it declines.
    - an IR stage of the backend's compiler (``ttir``, ``ttgir``, ``llir``, ``ptx``, ``cubin``,
      ``linalg``, ...) or ``"*"`` for every stage: ``run(module, stage)`` after that stage ran,
      with its output (an MLIR module, text or bytes) and a
      :class:`~dlcore.compiler.stages.StageContext` (stage name and position, kernel name, backend,
      Triton's metadata, a per-compile scratch dict); returns a replacement, or ``None`` when the
      module was only read or changed in place. A pass that only reads IR must say
      ``changes_ir=False``; every other IR pass is part of Triton's compile cache key.

    A pass that raises fails the launch or compile it ran on, with the pass named in the error.

    :return: :class:`~dlcore.compiler.passes.Pass` objects; anything else is warned about and
        left out, as is a second pass with a name already taken.
    """


# --------------------------------------------------------------------------------------------
# search strategies
# --------------------------------------------------------------------------------------------


@hookspec
def dlcore_strategies() -> list[SearchStrategy]:
    """Provide search strategies for tuning.

    Called once, when the plugins are loaded. A strategy has a unique ``name`` and a
    ``search(space, objective, budget, seed)`` method (see :mod:`dlcore.tuning.strategy`).

    :return: :class:`~dlcore.tuning.strategy.Strategy` objects.
    """
