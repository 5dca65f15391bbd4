"""The callable that ``get_op`` returns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dlcore.runtime.runner import runner

if TYPE_CHECKING:
    from dlcore.declarations.device import DeviceProfile
    from dlcore.declarations.implementation import Implementation, PlanTransform
    from dlcore.declarations.op import Op
    from dlcore.declarations.signature import Signature
    from dlcore.tuning.selection import Selection


class BoundOp:
    """One op bound to one implementation and config, for inputs of one signature.

    Calling it runs the chosen implementation directly: no lookup, no selection. It does not
    re-validate its inputs (``get_op`` did, for the signature it was asked about); call ``get_op``
    again for inputs of another shape, dtype, layout or device.
    """

    __slots__ = ("op", "impl", "config", "selection", "signature", "profile", "cache_key", "kinds", "_run", "_nargs")

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
        self._run = runner(impl, self.config, transform)
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
