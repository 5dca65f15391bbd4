"""What a plugin (and a caller) may import and rely on: everything here keeps its name and meaning
within a minor version (``dlc-core>=0.1,<0.2``). Two packages are public beside it: :mod:`dlcore.language`,
the helpers ``@triton.jit`` code calls, and :mod:`dlcore.testing`, the tolerances a plugin's tests use
(its tests, not its package). Every other module of dlcore is internal; a contract in pyproject.toml
keeps dlcore's own plugins to these.

``import dlcore`` exposes the same names (``dlcore.Op``, ``dlcore.hookimpl``); they are imported on
first use, so ``import dlcore`` stays cheap. docs/plugins.md is the guide.
"""

from __future__ import annotations

from dlcore.bench.harness import versions
from dlcore.bench.table import table
from dlcore.bench.timing import first_line
from dlcore.compiler.dump import dump_after_pass
from dlcore.compiler.lowering import Lowering, cuda_capability, lower_with_triton, parse_target
from dlcore.compiler.passes import EVERY_IR_STAGE, Pass, Pipeline, default_pipeline
from dlcore.compiler.report import ptxas_resources
from dlcore.compiler.stages import Compile, StageContext, StageOutput, ir_text
from dlcore.compiler.toolchain import Fetched, FetchRequest, Found, Probe, Tool, Toolchain
from dlcore.compiler.toolchain import find as find_tool
from dlcore.compiler.toolchain import locate as locate_tool
from dlcore.compiler.wheels import PinnedWheel, take_tool
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
from dlcore.declarations.signature import Signature, cdiv, next_power_of_2, prev_power_of_2
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
from dlcore.plugins.vendor import TorchDeviceBackend, device_index
from dlcore.runtime.allocator import ensure_allocator
from dlcore.runtime.template import Backward, Kernel, Residuals, define_kernel
from dlcore.runtime.torch_ops import ForwardOnlyWarning, NoGradientWarning

__all__ = [
    # calling ops
    "get_op", "BoundOp",
    # declaring an op
    "Op", "TensorArg", "ScalarArg",
    # writing a kernel: the template, its backward, the launches a plan returns
    "define_kernel", "Kernel", "Backward", "Residuals", "KernelCall", "LaunchPlan", "Config",
    "Signature", "DeviceProfile", "as_rows", "cdiv", "next_power_of_2", "prev_power_of_2",
    # set Triton's allocator before launching a kernel that asks global scratch (device-side tensor descriptors)
    "ensure_allocator",
    # implementations of any kind
    "Implementation", "TritonImplementation", "TorchImplementation", "VendorImplementation",
    # search spaces
    "SearchSpace", "Choice", "PowerOfTwo", "IntRange", "Constraint", "num_warps", "num_stages",
    # backends, their external compilers, and what a kernel declares it cannot lower
    "Backend", "TorchDeviceBackend", "Availability", "Toolchain", "Tool", "Probe", "Found", "LoweringLimit",
    # a backend over a vendor's torch extension: the device's index
    "device_index",
    # a backend's external compilers: finding a tool, fetching one out of a pinned wheel
    "find_tool", "locate_tool", "Fetched", "FetchRequest", "PinnedWheel", "take_tool",
    # a backend's lowering: its pass pipeline, Triton's own stages, each stage's record, IR dumps
    "Lowering", "Pass", "Pipeline", "EVERY_IR_STAGE", "default_pipeline", "lower_with_triton", "parse_target",
    "cuda_capability", "ptxas_resources", "Compile", "StageContext", "StageOutput", "ir_text", "dump_after_pass",
    # a plugin's own benchmarks: the versions a report records, its text tables, an error's first line
    "versions", "table", "first_line",
    # the plugin hooks
    "hookimpl",
    # errors and warnings
    "DlcoreError", "UnknownOpError", "InvalidInputError", "InvalidCallError", "InvalidOptionError",
    "NoKernelError", "BackendUnavailableError", "PluginLoadError", "PluginConflictError", "DeclarationError",
    "SearchSpaceError", "UnknownImplementationError", "CacheFileError", "LoweringError", "ToolchainMissingError",
    "ToolchainBrokenError", "ToolFetchError", "NoDoubleBackwardError",
    "PluginWarning", "FallbackWarning", "ForwardOnlyWarning", "NoGradientWarning", "CacheWarning",
]
