"""What a plugin (and a caller) may import and rely on: everything here keeps its name and meaning
within a minor version (``dlc-core>=0.1,<0.2``); every other module of dlcore is internal.

``import dlcore`` exposes the same names (``dlcore.Op``, ``dlcore.hookimpl``); they are imported on
first use, so ``import dlcore`` stays cheap. docs/plugins.md is the guide.
"""

from __future__ import annotations

from dlcore.compiler.toolchain import Found, Probe, Tool, Toolchain
from dlcore.declarations.backend import Availability, Backend
from dlcore.declarations.device import DeviceProfile
from dlcore.declarations.implementation import (
    Config,
    Implementation,
    KernelCall,
    LaunchPlan,
    LoweringLimit,
    TorchImplementation,
    TritonImplementation,
    VendorImplementation,
)
from dlcore.declarations.layout import as_rows
from dlcore.declarations.op import Op, ScalarArg, TensorArg
from dlcore.declarations.signature import Signature, cdiv, next_power_of_2
from dlcore.declarations.space import Choice, Constraint, IntRange, PowerOfTwo, SearchSpace, num_stages, num_warps
from dlcore.dispatch.bound import BoundOp
from dlcore.dispatch.dispatcher import FallbackWarning, get_op
from dlcore.dispatch.store import CacheWarning
from dlcore.errors import (
    BackendUnavailableError,
    CacheFileError,
    DeclarationError,
    DlcoreError,
    InvalidCallError,
    InvalidInputError,
    InvalidOptionError,
    LoweringError,
    NoDoubleBackwardError,
    NoKernelError,
    PluginConflictError,
    PluginLoadError,
    SearchSpaceError,
    ToolchainBrokenError,
    ToolchainMissingError,
    ToolFetchError,
    UnknownImplementationError,
    UnknownOpError,
)
from dlcore.plugins.discovery import PluginWarning
from dlcore.plugins.hookspecs import hookimpl
from dlcore.plugins.vendor import TorchDeviceBackend
from dlcore.runtime.template import Backward, Kernel, Residuals, define_kernel
from dlcore.runtime.torch_ops import ForwardOnlyWarning, NoGradientWarning

__all__ = [
    # calling ops
    "get_op", "BoundOp",
    # declaring an op
    "Op", "TensorArg", "ScalarArg",
    # writing a kernel: the template, its backward, the launches a plan returns
    "define_kernel", "Kernel", "Backward", "Residuals", "KernelCall", "LaunchPlan", "Config",
    "Signature", "DeviceProfile", "as_rows", "cdiv", "next_power_of_2",
    # implementations of any kind
    "Implementation", "TritonImplementation", "TorchImplementation", "VendorImplementation",
    # search spaces
    "SearchSpace", "Choice", "PowerOfTwo", "IntRange", "Constraint", "num_warps", "num_stages",
    # backends, their external compilers, and what a kernel declares it cannot lower
    "Backend", "TorchDeviceBackend", "Availability", "Toolchain", "Tool", "Probe", "Found", "LoweringLimit",
    # the plugin hooks
    "hookimpl",
    # errors and warnings
    "DlcoreError", "UnknownOpError", "InvalidInputError", "InvalidCallError", "InvalidOptionError",
    "NoKernelError", "BackendUnavailableError", "PluginLoadError", "PluginConflictError", "DeclarationError",
    "SearchSpaceError", "UnknownImplementationError", "CacheFileError", "LoweringError", "ToolchainMissingError",
    "ToolchainBrokenError", "ToolFetchError", "NoDoubleBackwardError",
    "PluginWarning", "FallbackWarning", "ForwardOnlyWarning", "NoGradientWarning", "CacheWarning",
]
