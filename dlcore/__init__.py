"""dlcore: a plugin-based framework to write, lower, select and tune Triton kernels.

``dlcore.get_op(name, args)`` returns the best implementation of an op for those inputs on their
device; plugins (backends, kernels, passes, strategies) arrive through entry points. The public
API is :mod:`dlcore.api`, whose names this package exposes too (imported on first use).
"""

from __future__ import annotations

from dlcore.errors import (
    BackendUnavailableError,
    DlcoreError,
    InvalidInputError,
    InvalidOptionError,
    NoKernelError,
    PluginLoadError,
    UnknownOpError,
)

__version__ = "0.1.0"

#: the names of :mod:`dlcore.api`; kept in step by tests/test_api.py
__all__ = [
    "get_op", "BoundOp",
    "Op", "TensorArg", "ScalarArg",
    "define_kernel", "Kernel", "Backward", "Residuals", "KernelCall", "LaunchPlan", "Config",
    "Signature", "DeviceProfile", "as_rows", "cdiv", "next_power_of_2", "prev_power_of_2",
    "ensure_allocator",
    "Implementation", "TritonImplementation", "TorchImplementation", "VendorImplementation",
    "SearchSpace", "Choice", "PowerOfTwo", "IntRange", "Constraint", "num_warps", "num_stages",
    "Backend", "TorchDeviceBackend", "Availability", "Toolchain", "Tool", "Probe", "Found", "LoweringLimit",
    "device_index",
    "find_tool", "locate_tool", "Fetched", "FetchRequest", "PinnedWheel", "take_tool",
    "Lowering", "Pass", "Pipeline", "EVERY_IR_STAGE", "default_pipeline", "lower_with_triton", "parse_target",
    "cuda_capability", "ptxas_resources", "Compile", "StageContext", "StageOutput", "ir_text", "dump_after_pass",
    "versions", "table", "first_line",
    "hookimpl",
    "DlcoreError", "UnknownOpError", "InvalidInputError", "InvalidCallError", "InvalidOptionError",
    "NoKernelError", "BackendUnavailableError", "PluginLoadError", "PluginConflictError", "DeclarationError",
    "SearchSpaceError", "UnknownImplementationError", "CacheFileError", "LoweringError", "ToolchainMissingError",
    "ToolchainBrokenError", "ToolFetchError", "NoDoubleBackwardError",
    "PluginWarning", "FallbackWarning", "ForwardOnlyWarning", "NoGradientWarning", "CacheWarning",
]

def __getattr__(name: str):
    # The rest of the API imports torch, pluggy and the dispatcher: only a user of it pays for that.
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from dlcore import api

    found = getattr(api, name)
    globals()[name] = found
    return found


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
