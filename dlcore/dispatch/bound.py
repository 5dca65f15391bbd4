"""The callable that ``get_op`` returns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dlcore.declarations.op import ScalarArg
from dlcore.declarations.signature import make_signature
from dlcore.errors import InvalidInputError
from dlcore.runtime.runner import runner

if TYPE_CHECKING:
    from dlcore.declarations.device import DeviceProfile
    from dlcore.declarations.implementation import Implementation, PlanTransform
    from dlcore.declarations.op import Op
    from dlcore.declarations.signature import Signature, TensorSpec
    from dlcore.tuning.selection import Selection

AGAIN = "Call dlcore.get_op again for these inputs: a bound op runs on the inputs it was made for"


def _leading(policy: str | None, bucketed: tuple[int, ...]) -> int:
    """How many leading dimensions of a shape bucketed by ``policy`` its key policy rounds (the
    rest are exact): none unbucketed, two of attention's ``[B, S, H, D]``, else the rows."""
    if policy is None or not bucketed:
        return 0
    return 2 if policy == "sequence" and len(bucketed) == 4 else 1


class InputCheck:
    """What a bound op checks of inputs whose exact metadata (each tensor's dtype, shape, strides,
    device and alignment; each scalar) it has not run on: the op's validation, which ``get_op``
    runs, then that the inputs fall in the signature the op was bound for.

    Another size of the dimensions a key policy rounds (rows, tokens, batch and sequence length)
    passes where the implementation accepts the new signature: one config serves every size of a
    bucket's rounded dimensions, so its plans take any. Another dtype, layout, alignment, exact
    dimension, keyed scalar, device type, or an optional tensor given where it was left out (or
    the reverse), raises :class:`InvalidInputError` saying to call ``get_op`` again. Whether a
    training call is no part of it: the runner takes the custom op when autograd needs it.
    """

    __slots__ = ("op", "impl", "signature", "profile")

    def __init__(self, op: Op, impl: Implementation, signature: Signature, profile: DeviceProfile):
        self.op = op
        self.impl = impl
        self.signature = signature
        self.profile = profile

    def __call__(self, args: tuple) -> None:
        signature = make_signature(self.op, args, self.op.validate(args))
        bound = self.signature
        if (signature.tensors, signature.scalars, signature.absent) == (bound.tensors, bound.scalars, bound.absent) \
                and signature.device_type == bound.device_type:
            return
        problem = self._difference(signature, args)
        if problem is not None:
            raise problem

    def _refused(self, arg: str, got: str, expected: str, hint: str = AGAIN) -> InvalidInputError:
        return InvalidInputError(self.op.name, arg, got, f"{expected} through this bound op, made for "
                                 f"{self.signature.describe()}", hint)

    def _difference(self, signature: Signature, args: tuple) -> InvalidInputError | None:
        """Why ``signature`` (of ``args``) is not one this bound op runs, or None."""
        bound = self.signature
        if signature.device_type != bound.device_type:
            name, value = next((a.name, v) for a, v in zip(self.op.args, args) if v is not None and not
                               isinstance(a, ScalarArg))
            return self._refused(name, f"is on {value.device}", f"tensors on {bound.device_type}")
        resized = None
        for spec, value in zip(self.op.args, args):
            name = spec.name
            if isinstance(spec, ScalarArg):
                if spec.keyed and signature.scalar(name) != bound.scalar(name):
                    return self._refused(name, f"is {value!r}", f"{name}={bound.scalar(name)!r}")
                continue
            was, now = bound.optional(name), signature.optional(name)
            if was is None or now is None:
                if was is not now:
                    return self._refused(name, "is None" if now is None else "is given",
                                         f"{name}=None" if was is None else f"a tensor for {name}")
                continue
            problem = self._tensor_difference(name, spec.bucket, was, now, value)
            if problem is not None:
                return problem
            if now.shape != was.shape and resized is None:
                resized = name, value
        if resized is not None:
            reason = self.impl.supports(signature, self.profile)
            if reason:
                return self._refused(resized[0], f"has shape {tuple(resized[1].shape)}",
                                     f"the shapes {self.impl.name} accepts",
                                     f"{self.impl.name} declines these inputs ({reason}). {AGAIN}")
        return None

    def _tensor_difference(self, name: str, policy: str | None, was: TensorSpec, now: TensorSpec,
                           value: Any) -> InvalidInputError | None:
        if now.dtype != was.dtype:
            return self._refused(name, f"has dtype {now.dtype}", f"{name} of dtype {was.dtype}")
        if now.layout != was.layout:
            return self._refused(name, f"has strides {tuple(value.stride())} for shape {tuple(value.shape)} "
                                 f"({now.layout})", f"a {was.layout} {name}")
        if now.aligned != was.aligned:
            got = "starts at an address that is not 16-byte aligned" if was.aligned else "is 16-byte aligned"
            return self._refused(name, got, f"a {name} that is {'' if was.aligned else 'not '}16-byte aligned")
        lead = _leading(policy, was.shape)
        if len(now.shape) != len(was.shape) or now.shape[lead:] != was.shape[lead:]:
            pattern = ", ".join(["*"] * lead + [str(d) for d in was.shape[lead:]])
            rounded = " (* any size)" if lead else ""
            return self._refused(name, f"has shape {tuple(value.shape)}", f"{name} of shape [{pattern}]{rounded}")
        return None


class BoundOp:
    """One op bound to one implementation and config, for inputs of one signature.

    Calling it runs the chosen implementation directly: no lookup, no selection. Inputs of exact
    metadata it has not run on are checked first (:class:`InputCheck`: the op's validation, and
    that they fall in the signature it was bound for), once; calls with metadata seen before run
    unchecked, so a condition on the data (fused_moe's expert ids) is checked by ``get_op`` and by
    the first call of each metadata only. Call ``get_op`` again for inputs of another dtype,
    layout, device or exact shape.
    """

    __slots__ = ("op", "impl", "config", "selection", "signature", "profile", "cache_key", "kinds", "runner", "_run",
                 "_nargs")

    def __init__(self, op: Op, impl: Implementation, selection: Selection, signature: Signature,
                 profile: DeviceProfile, cache_key: str, transform: PlanTransform | None = None,
                 kinds: dict[str, str] | None = None):
        self.op = op
        self.impl = impl
        self.config = selection.config
        self.selection = selection
        self.signature = signature
        self.profile = profile
        self.cache_key = cache_key
        #: each candidate's kind in words (``Implementation.describe``), for ``explain``
        self.kinds = kinds or {impl.name: impl.describe()}
        self.runner = runner(impl, self.config, transform, InputCheck(op, impl, signature, profile), profile)
        self._run = self.runner.call
        self._nargs = len(op.args)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == self._nargs:
            return self._run(args)
        return self._run(self.op.bind(args, kwargs or None))

    def explain(self) -> str:
        s = self.selection
        lines = [
            f"op:        {self.op.name}",
            f"inputs:    {self.signature.describe()}",
            f"device:    {self.profile.describe()} via backend {self.profile.backend!r}",
            f"chosen:    {self.impl.name} ({self.impl.describe()}, from plugin {self.impl.plugin}) "
            f"with config {self.config}",
            f"because:   {s.describe()}" + (f", {s.time_ms:.4f} ms" if s.time_ms is not None else "")
            + (" (forward and backward: a training call)" if self.signature.training and s.measured else ""),
        ]
        for name, t in sorted(s.measured.items(), key=lambda kv: kv[1]):
            kind = f" ({self.kinds[name]})" if name in self.kinds else ""
            lines.append(f"  measured  {name}: {t:.4f} ms{kind}")
        for name, why in s.failed.items():
            lines.append(f"  failed    {name}: {why}")
        for name, why in s.declined.items():
            lines.append(f"  declined  {name}: {why}")
        if s.strategy:
            lines.append(f"tuned:     {s.strategy}, {s.evaluations} evaluations")
        lines.append(f"decided:   {s.when}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<BoundOp {self.op.name} -> {self.impl.name} {self.config}>"
