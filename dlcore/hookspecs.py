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
    from dlcore.backend import Backend
    from dlcore.device import DeviceProfile
    from dlcore.implementation import Implementation
    from dlcore.op import Op
    from dlcore.signature import Signature
    from dlcore.tuning.space import SearchSpace
    from dlcore.tuning.strategy import Strategy

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

    :return: the :class:`dlcore.backend.Backend` objects this plugin provides, each owning one or
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
    :return: a refined :class:`~dlcore.tuning.space.SearchSpace`, or ``None`` to leave it as is.
    """


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@hookspec
def dlcore_ops() -> list[Op]:
    """Declare operators: their argument schema, torch reference and key policy.

    Called once, when the plugins are loaded. An op name declared twice is an error reported
    against the later plugin.

    :return: :class:`dlcore.op.Op` declarations.
    """


@hookspec
def dlcore_implementations() -> list[Implementation]:
    """Provide implementations of operators (of this plugin's ops or any other plugin's).

    Called once, when the plugins are loaded, after :func:`dlcore_ops`. An implementation of an
    op nobody declared is reported against its plugin and ignored.

    :return: :class:`dlcore.implementation.Implementation` objects.
    """


# --------------------------------------------------------------------------------------------
# compiler passes
# --------------------------------------------------------------------------------------------


@hookspec
def dlcore_passes() -> list[object]:
    """Provide compiler passes.

    Called once, when the plugins are loaded. Each pass names its stage (``ast``, an IR stage such
    as ``ttir``, or ``launch``), the backends it applies to and its order.

    :return: pass objects.
    """


# --------------------------------------------------------------------------------------------
# search strategies
# --------------------------------------------------------------------------------------------


@hookspec
def dlcore_strategies() -> list[Strategy]:
    """Provide search strategies for tuning.

    Called once, when the plugins are loaded. A strategy has a unique ``name`` and a
    ``search(space, objective, budget, seed)`` method (see :mod:`dlcore.tuning.strategy`).

    :return: strategy objects.
    """
