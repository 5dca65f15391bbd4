"""Implementations of operators: how an op is computed on some backend.

Three kinds (:attr:`Implementation.kind`; each backend lists the kinds it runs):

- ``triton``: Triton kernels (:class:`TritonImplementation`);
- ``torch``: written in torch (:class:`TorchImplementation`), the op's float64-checked reference
  among them (:class:`ReferenceImplementation`);
- ``vendor``: the vendor's library reached through torch (:class:`VendorImplementation`: cuBLAS
  and cuBLASLt on CUDA, CANN through torch_npu on Ascend), a candidate timed against the kernels.

A Triton implementation does not launch kernels itself: its ``plan(args, config, profile)`` returns a
:class:`LaunchPlan` (the kernels, grids, arguments and the result tensors). Running the plan
launches it; lowering (``dlcore lower``) compiles the same plan for a target without a device;
launch-stage passes rewrite it. One description serves all three.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dlcore.declarations.device import UNKNOWN_DEVICE
from dlcore.errors import DeclarationError

if TYPE_CHECKING:
    from dlcore.declarations.device import DeviceProfile
    from dlcore.declarations.op import Op
    from dlcore.declarations.signature import Signature
    from dlcore.declarations.space import SearchSpace

Config = dict[str, Any]
#: rewrites a launch plan before it runs (the ``ast`` and ``launch`` compiler passes)
PlanTransform = Callable[["LaunchPlan"], "LaunchPlan"]


@dataclass
class KernelCall:
    """One launch: ``kernel[grid](*args, **kwargs)``; ``kwargs`` holds constexprs, num_warps, ..."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)

    def launch(self) -> None:
        """Through Triton's own launcher (:func:`dlcore.runtime.launch.launch` is the warm path)."""
        self.kernel[self.grid](*self.args, **self.kwargs)


@dataclass
class LaunchPlan:
    """The launches of one call and what it returns. ``scratch``: tensors the plan allocated
    (``torch.empty``) for its launches alone, each written by a launch before any reads it; a
    replay (:class:`dlcore.runtime.replay.Replay`) allocates them afresh, as it does the results."""

    calls: list[KernelCall]
    result: Any
    scratch: tuple = ()

    def run(self) -> Any:
        """Launch every call through Triton (:func:`dlcore.runtime.launch.run_plan` is the warm path)."""
        for call in self.calls:
            call.launch()
        return self.result


@dataclass(frozen=True)
class LoweringLimit:
    """Kernels of an implementation that a backend's compiler cannot lower past a stage, and why:
    declared beside the kernel, shown by ``dlcore ops`` and by ``dlcore lower`` when it stops there.

    :param backend: the backend whose pipeline stops (``npu``).
    :param kernels: the ``@triton.jit`` function names concerned.
    :param stage: the first stage they do not reach (``hivm``).
    :param reason: what stops them, with the tool and version where it is the tool's limit.
    :param archs: the target architectures concerned (``("80",)`` for ``cuda:80``: fp8 ``tl.dot``
        needs sm_89); empty: every target of the backend.
    """

    backend: str
    kernels: tuple[str, ...]
    stage: str
    reason: str
    archs: tuple[str, ...] = ()

    def describe(self) -> str:
        where = self.backend + (":" + ",".join(self.archs) if self.archs else "")
        verb = "stops" if len(self.kernels) == 1 else "stop"
        return f"{where}: {', '.join(self.kernels)} {verb} before {self.stage}: {self.reason}"

    def concerns(self, backend: str, kernel: str, arch: str | None = None) -> bool:
        """Whether this limit holds for ``kernel`` on ``backend`` (and target ``arch``, if given)."""
        return (self.backend == backend and kernel in self.kernels
                and (not self.archs or arch is None or arch in self.archs))


class Implementation:
    """Base of every implementation. ``kind`` says which backends can run it (``triton``, ``torch``,
    ``vendor``: see :attr:`dlcore.declarations.backend.Backend.kinds`)."""

    kind: str = ""

    def __init__(self, op: str, name: str, *, dtypes: tuple | None = None, doc: str = "",
                 limits: tuple[LoweringLimit, ...] = ()):
        self.op = op
        self.name = name
        self.dtypes = dtypes
        self.doc = doc
        #: the kernels some backend cannot lower, and why (``dlcore ops``)
        self.limits = tuple(limits)
        #: set by the registry: the plugin that provided it
        self.plugin: str = ""

    @property
    def qualname(self) -> str:
        return f"{self.op}.{self.name}"

    def limit(self, backend: str, kernel: str, arch: str | None = None) -> LoweringLimit | None:
        """The declared limit of ``backend`` (target ``arch``, if given) on ``kernel`` (a function
        name), if any."""
        return next((x for x in self.limits if x.concerns(backend, kernel, arch)), None)

    def supports(self, signature: Signature, profile: DeviceProfile) -> str | None:
        """``None`` if this implementation handles ``signature``, else the reason it declines."""
        if self.dtypes is not None and signature.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"dtype {str(signature.dtype).removeprefix('torch.')} not supported (supports {names})"
        return None

    def default_config(self, signature: Signature, profile: DeviceProfile | None) -> Config:
        """The heuristic config, used when nothing is tuned. ``profile`` is None on direct use."""
        return {}

    def space(self, profile: DeviceProfile | None = None) -> SearchSpace | None:
        """The declared search space for a device of ``profile`` (None: no device in view), or None
        if there is nothing to tune."""
        return None

    def source_hash(self) -> str:
        """Changes whenever the code that computes the result changes: part of cache keys."""
        raise NotImplementedError

    def describe(self) -> str:
        """The kind in words, for listings and ``explain()``."""
        return self.kind

    def run(self, args: tuple, config: Config) -> Any:
        """Compute the op on bound ``args`` with ``config``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.qualname}>"


def source_modules(*objects: Any) -> list[Any]:
    """The modules the code of ``objects`` comes from: each object's own module, and every module
    of its package (the same top-level name) that those modules take a function, class or module
    from, followed transitively; dlcore's own modules are versioned with dlcore, not hashed."""
    found: dict[str, Any] = {}
    pending = [getattr(o, "__module__", None) for o in objects]
    while pending:
        name = pending.pop()
        module = sys.modules.get(name or "")
        if module is None or name in found:
            continue
        found[name] = module
        package = name.partition(".")[0]
        for value in vars(module).values():
            try:
                origin = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
            except Exception:  # noqa: BLE001 - objects whose attribute lookup raises (torch.classes) name no module
                continue
            if isinstance(origin, str) and origin.partition(".")[0] == package and origin not in found:
                pending.append(origin)
    return [found[n] for n in sorted(found)]


def _module_source_hash(*objects: Any) -> str:
    """A hash of the source of every module in :func:`source_modules` of ``objects``."""
    digest = hashlib.sha256()
    for module in source_modules(*objects) or objects:
        try:
            digest.update(inspect.getsource(module).encode())
        except (OSError, TypeError):
            digest.update(getattr(module, "__qualname__", repr(module)).encode())
    return digest.hexdigest()[:16]


class ReferenceImplementation(Implementation):
    """The op's own torch reference, registered for every op by the registry."""

    kind = "torch"

    def __init__(self, op: Op):
        super().__init__(op.name, "reference", doc="torch reference")
        self._fn = op.reference
        self.fallback_only = True
        self._hash = _module_source_hash(op.reference)

    def source_hash(self) -> str:
        return self._hash

    def run(self, args: tuple, config: Config) -> Any:
        return self._fn(*args)


class TorchImplementation(Implementation):
    """An implementation written in torch (e.g. a composite of library calls)."""

    kind = "torch"

    def __init__(self, op: str, name: str, fn: Callable[..., Any], **kwargs: Any):
        super().__init__(op, name, **kwargs)
        self._fn = fn
        self._hash = _module_source_hash(fn)

    def source_hash(self) -> str:
        return self._hash

    def run(self, args: tuple, config: Config) -> Any:
        return self._fn(*args)


class VendorImplementation(TorchImplementation):
    """An op computed by the vendor's library through torch: ``fn(*args)`` with the op's bound
    arguments, e.g. ``torch.matmul`` (cuBLAS or cuBLASLt on CUDA, CANN through torch_npu on Ascend).

    It takes part in selection like a kernel, so ``get_op`` never returns something slower than the
    library it measured; backends whose kernels cannot fairly be timed against it (the ``cpu``
    backend, running Triton in the interpreter) decline its kind. Its source hash covers the torch
    version too: the library ships with torch, and a new one may change which candidate wins.

    :param library: what it calls, in words (``dlcore ops``, ``explain()``).
    :param supports: optional extra ``(signature, profile) -> reason | None``.
    """

    kind = "vendor"

    def __init__(self, op: str, name: str, fn: Callable[..., Any], *, library: str,
                 supports: Callable[[Signature, DeviceProfile], str | None] | None = None, **kwargs: Any):
        super().__init__(op, name, fn, **kwargs)
        self.library = library
        self._supports = supports
        self._hash = hashlib.sha256(f"{self._hash}|torch {torch.__version__}".encode()).hexdigest()[:16]

    def supports(self, signature: Signature, profile: DeviceProfile) -> str | None:
        reason = super().supports(signature, profile)
        if reason is None and self._supports is not None:
            reason = self._supports(signature, profile)
        return reason

    def describe(self) -> str:
        return f"{self.kind}: {self.library}"


def _check_callable(where: str, param: str, fn: Callable[..., Any] | None, takes: tuple[str, ...]) -> None:
    """Raise :class:`DeclarationError` when ``fn`` cannot be called as ``param(*takes)`` (positional
    arguments): a plugin's slip caught as it declares, not inside a later selection."""
    if fn is None:
        return
    form = f"{param}({', '.join(takes)})"
    try:
        signature = inspect.signature(fn, follow_wrapped=False)  # a functools.wraps wrapper is what is called
    except (TypeError, ValueError):  # no signature to read (a builtin): trusted
        return
    try:
        signature.bind(*takes)
    except TypeError:
        raise DeclarationError(
            f"{where}: {param} is called as {form}, which {getattr(fn, '__qualname__', fn)}{signature} cannot take "
            "(a plan takes the device profile as its third argument, plan(args, config, profile), and a space "
            "takes it alone, space(profile))") from None


class TritonImplementation(Implementation):
    """An implementation made of Triton kernels.

    Its callables take the device profile, as :func:`~dlcore.runtime.template.define_kernel`'s do:
    ``plan(args, config, profile)`` and ``space(profile)``, ``profile`` being the
    :class:`~dlcore.declarations.device.DeviceProfile` of the device the inputs live on (the
    call's, ``Call.profile``; :data:`~dlcore.declarations.device.UNKNOWN_DEVICE` where none is in
    view). Given a callable that cannot take it, this class raises ``DeclarationError``.

    :param plan: ``plan(args, config, profile) -> LaunchPlan``; allocates the outputs (on the
        inputs' device, which may be ``meta`` when lowering) and describes every launch.
    :param kernels: the ``@triton.jit`` functions the plan launches.
    :param default_config: ``(signature, profile | None) -> config``.
    :param supports: optional extra ``(signature, profile) -> reason | None``.
    :param space: optional ``(profile) -> SearchSpace``.
    :param replayable: the plan's launches depend only on the inputs' shapes, strides, dtypes,
        device and alignment (not on their values), and it allocates its results uninitialised
        (``torch.empty``) for its kernels to write in full. A bound op then records its launches
        once per exact input and replays them (:class:`dlcore.runtime.replay.Replay`).
    :param backward_plan: optional ``backward_plan(args, config, profile) -> LaunchPlan``: the
        launches of the backward for the forward's ``args`` and ``config``, the output gradients made up as new
        tensors (meta tensors must work); ``dlcore lower`` lowers them besides ``plan``'s.
    """

    kind = "triton"

    def __init__(
        self,
        op: str,
        name: str,
        *,
        plan: Callable[[tuple, Config, DeviceProfile], LaunchPlan],
        kernels: tuple,
        default_config: Callable[[Signature, DeviceProfile | None], Config],
        supports: Callable[[Signature, DeviceProfile], str | None] | None = None,
        space: Callable[[DeviceProfile], SearchSpace] | None = None,
        replayable: bool = False,
        backward_plan: Callable[[tuple, Config, DeviceProfile], LaunchPlan] | None = None,
        **kwargs: Any,
    ):
        super().__init__(op, name, **kwargs)
        for param, fn, takes in (("plan", plan, ("args", "config", "profile")),
                                 ("default_config", default_config, ("signature", "profile")),
                                 ("supports", supports, ("signature", "profile")), ("space", space, ("profile",)),
                                 ("backward_plan", backward_plan, ("args", "config", "profile"))):
            _check_callable(f"{op}.{name}", param, fn, takes)
        self.plan = plan
        self.backward_plan = backward_plan
        self.replayable = replayable
        self.kernels = tuple(kernels)
        self._default_config = default_config
        self._supports = supports
        self._space = space
        self._hash = _module_source_hash(plan, *(getattr(k, "fn", k) for k in self.kernels))

    @property
    def interpreted(self) -> bool:
        """True when the kernels were created under ``TRITON_INTERPRET=1`` (they run on the CPU)."""
        return all(type(k).__name__ == "InterpretedFunction" for k in self.kernels)

    def supports(self, signature: Signature, profile: DeviceProfile) -> str | None:
        reason = super().supports(signature, profile)
        if reason is None and self._supports is not None:
            reason = self._supports(signature, profile)
        return reason

    def default_config(self, signature: Signature, profile: DeviceProfile | None) -> Config:
        return dict(self._default_config(signature, profile))

    def space(self, profile: DeviceProfile | None = None) -> SearchSpace | None:
        return None if self._space is None else self._space(UNKNOWN_DEVICE if profile is None else profile)

    def source_hash(self) -> str:
        return self._hash

    def run(self, args: tuple, config: Config, profile: DeviceProfile | None = None) -> Any:
        """The plan's launches for ``args``; ``profile`` is the device's (None: none in view)."""
        return self.plan(args, config, UNKNOWN_DEVICE if profile is None else profile).run()
