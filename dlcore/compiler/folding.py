"""Inter-core scheduling (grid folding): a grid of G programs run by P persistent programs.

DSA chips (Ascend, Cambricon) have a few large cores and pay for every launched block; a GPU pays
less, but many tiny blocks still cost scheduling. Folding rewrites a kernel written for a grid of
G programs over ``tl.program_id`` into a persistent kernel launched on
``P = min(G, cores x programs_per_core)`` programs, each looping over the logical programs
``pid, pid + P, pid + 2P, ...``::

    def k_folded(<k's parameters>, dlc_programs, dlc_grid_0, dlc_grid_1):
        for dlc_index in range(tl.program_id(0), dlc_grid_0 * dlc_grid_1, dlc_programs):
            dlc_pid_0 = dlc_index % dlc_grid_0
            dlc_pid_1 = dlc_index // dlc_grid_0
            <k's body, tl.program_id(a) replaced by dlc_pid_a>

The rewrite works on the kernel's syntax tree (:mod:`dlcore.compiler.source`), never on its text.
Each logical program runs the same operations as before, so results are identical bit for bit.
Axis 0 varies fastest, as in the hardware's own block order. A parameter the body reassigns is
copied to a fresh local at the top of each iteration, so every logical program starts from the
value it was launched with.

Folding declines, with the reason (:class:`FoldingRefused`), where it cannot prove the rewrite
keeps the kernel's meaning:

- ``tl.num_programs``: the kernel already schedules its own programs;
- atomics: programs may synchronise through memory (locks, tickets, semaphores); run one after
  another they could deadlock or see another order;
- ``return``: it would end the loop, skipping the later logical programs of that program;
- ``tl.program_id`` with an axis that is not a literal 0, 1 or 2, or used other than called;
- a helper ``@triton.jit`` function that reads ``tl.program_id`` or does any of the above;
- inline assembly that reads the hardware block id (``%ctaid`` ...);
- a reassigned ``tl.constexpr`` parameter; a kernel that closes over local variables;
- a kernel that never reads ``tl.program_id`` (every program computes the same thing).

The ``grid_folding`` pass (stage ``launch``; the ``ast`` rewrite it needs is built once per kernel)
applies it: on by default on ``npu`` and ``mlu``, opt-in elsewhere
(``DLCORE_ENABLE_PASSES=grid_folding``). It folds only a grid larger than P; on CUDA, P counts
the blocks an SM holds at once for the launch's ``num_warps`` (:func:`programs_for`).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import logging
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dlcore.compiler import source
from dlcore.compiler.passes import LAUNCH, Pass
from dlcore.errors import FoldingRefused
from dlcore.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from dlcore.declarations.device import DeviceProfile
    from dlcore.declarations.implementation import KernelCall

NAME = "grid_folding"
PROGRAMS = "dlc_programs"
INDEX = "dlc_index"
MAX_AXES = 3
#: the largest logical index a folded loop may reach (program ids are 32-bit)
INDEX_LIMIT = 2**31 - 1
#: how the pass lets Triton pipeline the folded loop (see :func:`rewrite`); None: Triton's default
LOOP_STAGES: int | None = None
#: CUDA: resident blocks per SM are at most 32, resident warps at most 64 (sm_80 to sm_100)
CUDA_BLOCKS_PER_SM = 32
CUDA_WARPS_PER_SM = 64
#: PTX registers naming the physical block: inline assembly reading them sees the folded program
HARDWARE_IDS = ("%ctaid", "%nctaid", "%clusterid", "%nclusterid")
ATOMICS = ("atomic_add", "atomic_and", "atomic_cas", "atomic_max", "atomic_min", "atomic_or", "atomic_xchg",
           "atomic_xor")

log = logging.getLogger(__name__)


def grid_name(axis: int) -> str:
    return f"dlc_grid_{axis}"


def pid_name(axis: int) -> str:
    return f"dlc_pid_{axis}"


# --------------------------------------------------------------------------------------------
# proving the rewrite safe
# --------------------------------------------------------------------------------------------


def _language() -> Any:
    import triton.language as tl

    return tl


def _resolve(node: ast.AST, namespace: dict[str, Any]) -> Any:
    """The object a ``Name`` or ``a.b.c`` expression names in ``namespace``, or None."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, namespace)
        try:
            return getattr(base, node.attr, None) if base is not None else None
        except Exception:  # noqa: BLE001 - a property that raises names nothing we look for
            return None
    return None


@dataclass
class Analysis:
    """What folding needs to know about a kernel (or a helper it calls)."""

    axes: set[int] = dataclasses.field(default_factory=set)
    #: a ``tl.program_id(...)`` call of the kernel, cloned to start the folded loop
    program_id_call: ast.Call | None = None
    assigned: set[str] = dataclasses.field(default_factory=set)
    names: set[str] = dataclasses.field(default_factory=set)


class _Checker(ast.NodeVisitor):
    """Walks a kernel (or helper) body; raises :class:`FoldingRefused` at the first unsafe construct."""

    def __init__(self, where: str, namespace: dict[str, Any], is_helper: bool, seen: set[int]):
        tl = _language()
        self.where = where
        self.namespace = namespace
        self.is_helper = is_helper
        self.seen = seen
        self.program_id = tl.program_id
        self.num_programs = tl.num_programs
        self.atomics = {id(getattr(tl, a)): a for a in ATOMICS if hasattr(tl, a)}
        self.inline_asm = getattr(tl, "inline_asm_elementwise", None)
        self.result = Analysis()

    def refuse(self, node: ast.AST, why: str) -> None:
        line = getattr(node, "lineno", None)
        at = f" (line {line} of its def)" if line is not None else ""
        raise FoldingRefused(f"{self.where}{at}: {why}")

    def visit_Return(self, node: ast.Return) -> None:
        if not self.is_helper:
            self.refuse(node, "has a `return`; in a folded loop it would also skip every later logical program "
                              "of that program. Guard the work with `if` (or a mask) instead of returning early")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self.result.names.add(node.id)
        if isinstance(node.ctx, ast.Store):
            self.result.assigned.add(node.id)
        self._check_reference(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check_reference(node)
        self.generic_visit(node)

    def _check_reference(self, node: ast.AST) -> None:
        target = _resolve(node, self.namespace)
        if target is self.program_id:
            self.refuse(node, "uses tl.program_id other than by calling it with a literal axis")
        if target is self.num_programs:
            self._refuse_num_programs(node)

    def _refuse_num_programs(self, node: ast.AST) -> None:
        self.refuse(node, "uses tl.num_programs: the kernel already schedules its own programs "
                          "(e.g. a persistent loop); folding it again would change what each program computes")

    def visit_Call(self, node: ast.Call) -> None:
        target = _resolve(node.func, self.namespace)
        if target is self.program_id:
            self._program_id(node)
        elif target is self.num_programs:
            self._refuse_num_programs(node)
        elif id(target) in self.atomics:
            self.refuse(node, f"uses tl.{self.atomics[id(target)]}: programs may synchronise through memory "
                              "(locks, counters, semaphores); run one after another in a folded loop they could "
                              "deadlock or observe another order")
        elif target is self.inline_asm and any(
                isinstance(n, ast.Constant) and isinstance(n.value, str) and any(r in n.value for r in HARDWARE_IDS)
                for n in ast.walk(node)):
            self.refuse(node, "reads the hardware block id in inline assembly")
        elif source.is_kernel(target):
            self._helper(node, target)
            self.visit(node.func)
        else:
            self.visit(node.func)
        for child in [*node.args, *node.keywords]:
            self.visit(child)

    def _program_id(self, node: ast.Call) -> None:
        axis_node = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "axis"), None)
        if not (isinstance(axis_node, ast.Constant) and axis_node.value in range(MAX_AXES)
                and type(axis_node.value) is int):
            self.refuse(node, "calls tl.program_id with an axis that is not a literal 0, 1 or 2")
        if self.is_helper:
            self.refuse(node, "reads tl.program_id inside a helper; pass the program id to it as an argument")
        self.result.axes.add(axis_node.value)
        if self.result.program_id_call is None:
            self.result.program_id_call = node

    def _helper(self, node: ast.Call, helper: Any) -> None:
        if id(helper) in self.seen:
            return
        self.seen.add(id(helper))
        name = source.kernel_name(helper)
        try:
            tree = source.syntax_tree(helper)
        except (OSError, TypeError) as exc:
            self.refuse(node, f"calls helper {name}, whose source cannot be read ({exc})")
        fn = source.python_function(helper)
        checker = _Checker(f"helper {name}, called by {self.where}", fn.__globals__, True, self.seen)
        for statement in tree.body:
            checker.visit(statement)


def analyse(kernel: Any) -> tuple[ast.FunctionDef, Analysis]:
    """The kernel's syntax tree and what folding needs from it; :class:`FoldingRefused` if unsafe."""
    name = source.kernel_name(kernel)
    fn = source.python_function(kernel)
    if fn.__closure__:
        raise FoldingRefused(f"{name} closes over local variables; only module-level kernels can be rewritten")
    tree = source.syntax_tree(kernel)
    checker = _Checker(name, fn.__globals__, False, {id(kernel)})
    for statement in tree.body:
        checker.visit(statement)
    found = checker.result
    if not found.axes:
        raise FoldingRefused(f"{name} never reads tl.program_id: every program computes the same thing, "
                             "so there is nothing to fold")
    params = _parameters(tree)
    tl = _language()
    for arg in params:
        if arg.arg in found.assigned and _resolve(arg.annotation, fn.__globals__) is tl.constexpr:
            raise FoldingRefused(f"{name} reassigns its constexpr parameter {arg.arg}")
    ours = {PROGRAMS, INDEX} | {grid_name(a) for a in range(MAX_AXES)} | {pid_name(a) for a in range(MAX_AXES)}
    clash = ours & (found.names | {a.arg for a in params})
    if clash:
        raise FoldingRefused(f"{name} already uses the name(s) {', '.join(sorted(clash))} that folding introduces")
    return tree, found


def _parameters(tree: ast.FunctionDef) -> list[ast.arg]:
    return [*tree.args.posonlyargs, *tree.args.args]


def check(kernel: Any) -> str | None:
    """``None`` if ``kernel`` can be folded, else the reason it cannot."""
    try:
        analyse(kernel)
    except FoldingRefused as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------------------------
# the rewrite
# --------------------------------------------------------------------------------------------


class _ProgramIds(ast.NodeTransformer):
    """``tl.program_id(a)`` -> ``dlc_pid_a``; a reassigned parameter ``p`` -> its per-iteration copy."""

    def __init__(self, namespace: dict[str, Any], renamed: dict[str, str]):
        self.namespace = namespace
        self.renamed = renamed
        self.program_id = _language().program_id

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if _resolve(node.func, self.namespace) is self.program_id:
            axis = node.args[0] if node.args else next(k.value for k in node.keywords if k.arg == "axis")
            return ast.copy_location(ast.Name(id=pid_name(axis.value), ctx=ast.Load()), node)
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.renamed:
            return ast.copy_location(ast.Name(id=self.renamed[node.id], ctx=node.ctx), node)
        return node


def _statement(text: str) -> ast.stmt:
    return ast.parse(text).body[0]


def _logical_ids(axes: int, used: set[int]) -> list[ast.stmt]:
    """Statements computing each used axis's logical program id from the linear index (axis 0 fastest)."""
    if axes == 1:
        return [_statement(f"{pid_name(0)} = {INDEX}")]
    formulas = {0: f"{INDEX} % {grid_name(0)}"}
    if axes == 2:
        formulas[1] = f"{INDEX} // {grid_name(0)}"
    else:
        formulas[1] = f"{INDEX} // {grid_name(0)} % {grid_name(1)}"
        formulas[2] = f"{INDEX} // ({grid_name(0)} * {grid_name(1)})"
    return [_statement(f"{pid_name(a)} = {formulas[a]}") for a in sorted(used)]


def _language_expr(call: ast.Call, namespace: dict[str, Any]) -> ast.expr | None:
    """An expression naming ``triton.language`` in the kernel (``tl`` usually), or None."""
    tl = _language()
    if isinstance(call.func, ast.Attribute) and _resolve(call.func.value, namespace) is tl:
        return copy.deepcopy(call.func.value)
    name = next((n for n, v in namespace.items() if v is tl), None)
    return ast.Name(id=name, ctx=ast.Load()) if name else None


def rewrite(kernel: Any, axes: int, loop_stages: int | None = None) -> tuple[ast.FunctionDef, int]:
    """The folded ``def`` of ``kernel`` for a launch grid of ``axes`` dimensions, and the number of
    logical grid dimensions it takes (more than ``axes`` when the kernel reads a higher axis).

    :param loop_stages: ``None``: the folded loop is a plain ``range``, which Triton may software-
        pipeline (prefetching the next logical program's loads); an int: ``tl.range(...,
        num_stages=loop_stages)``, e.g. 1 to keep Triton from pipelining it.
    """
    tree, found = analyse(kernel)
    axes = max(axes, max(found.axes) + 1)
    fn = source.python_function(kernel)
    params = _parameters(tree)
    renamed = {a.arg: f"dlc_local_{a.arg}" for a in params if a.arg in found.assigned}

    body = list(tree.body)
    docstring = []
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        docstring = [body.pop(0)]
    transformer = _ProgramIds(fn.__globals__, renamed)
    body = [transformer.visit(statement) for statement in body]

    start = copy.deepcopy(found.program_id_call)
    start.args, start.keywords = [ast.Constant(0)], []
    total = " * ".join(grid_name(a) for a in range(axes))
    loop = _statement(f"for {INDEX} in range(0, {total}, {PROGRAMS}): pass")
    loop.iter.args[0] = start
    if loop_stages is not None:
        language = _language_expr(found.program_id_call, fn.__globals__)
        if language is None:
            raise FoldingRefused(f"{tree.name} does not name triton.language, which tl.range needs")
        loop.iter.func = ast.Attribute(value=language, attr="range", ctx=ast.Load())
        loop.iter.keywords = [ast.keyword(arg="num_stages", value=ast.Constant(loop_stages))]
    loop.body = [
        *_logical_ids(axes, found.axes),
        *(_statement(f"{local} = {param}") for param, local in renamed.items()),
        *body,
    ]

    new_params = [PROGRAMS, *(grid_name(a) for a in range(axes))]
    tree.args.args.extend(ast.arg(arg=p) for p in new_params)
    if tree.args.defaults:
        # Parameters after ones with defaults need defaults too; every launch passes them anyway.
        tree.args.defaults.extend(ast.Constant(1) for _ in new_params)
    tree.name = f"{tree.name}_folded"
    tree.body = [*docstring, loop]
    return ast.fix_missing_locations(tree), axes


_folded: dict[tuple[int, int, int | None], tuple[Any, Any, int]] = {}
_lock = threading.Lock()


def folded_kernel(kernel: Any, axes: int, loop_stages: int | None = None) -> tuple[Any, int]:
    """The folded kernel for ``axes`` launch dimensions and the grid dimensions it takes, built
    once per (kernel, axes, loop_stages)."""
    key = (id(kernel), axes, loop_stages)
    hit = _folded.get(key)
    if hit is None or hit[0] is not kernel:
        with _lock:
            tree, taken = rewrite(kernel, axes, loop_stages)
            made = source.rebuild(kernel, tree, f"folded{taken}" + ("" if loop_stages is None else f"s{loop_stages}"))
            hit = _folded[key] = (kernel, made, taken)  # holding the kernel keeps its id from being reused
    return hit[1], hit[2]


def fold_call(call: KernelCall, programs: int, loop_stages: int | None = None) -> KernelCall:
    """``call`` as a folded launch on ``min(G, programs)`` programs, G the programs of its grid.

    :param loop_stages: how Triton may pipeline the folded loop (see :func:`rewrite`).

    :raises FoldingRefused: the kernel cannot be folded safely, or the grid is not a tuple of ints
        or too large for 32-bit program indices.
    """
    grid = call.grid
    if not isinstance(grid, tuple) or not grid or not all(isinstance(g, int) and g >= 0 for g in grid):
        raise FoldingRefused(f"the grid {grid!r} is not a tuple of non-negative ints")
    if len(grid) > MAX_AXES:
        raise FoldingRefused(f"the grid {grid!r} has more than {MAX_AXES} dimensions")
    if programs < 1:
        raise FoldingRefused(f"cannot fold onto {programs} programs")
    total = math.prod(grid)
    physical = max(1, min(total, programs))
    if total + physical > INDEX_LIMIT:
        raise FoldingRefused(f"the grid {grid} has {total} programs; folded indices must stay below 2**31")
    while len(grid) > 1 and grid[-1] == 1:
        grid = grid[:-1]
    kernel, axes = folded_kernel(call.kernel, len(grid), loop_stages)
    dims = (*grid, *(1,) * (axes - len(grid)))
    kwargs = {**call.kwargs, PROGRAMS: physical, **{grid_name(a): dims[a] for a in range(axes)}}
    return dataclasses.replace(call, kernel=kernel, grid=(physical,), kwargs=kwargs)


# --------------------------------------------------------------------------------------------
# the pass
# --------------------------------------------------------------------------------------------


def programs_for(call: KernelCall, profile: DeviceProfile) -> int:
    """P's bound, cores x programs per core; on CUDA the programs per SM follow from num_warps."""
    per_core = profile.programs_per_core
    if profile.backend == "cuda" and per_core <= 1:
        warps = int(call.kwargs.get("num_warps", 4))
        per_core = max(1, min(CUDA_BLOCKS_PER_SM, CUDA_WARPS_PER_SM // max(warps, 1)))
    return max(1, profile.cores * per_core)


#: kernel name -> why folding declined it, for ``dlcore lower`` and debugging
refusals: dict[str, str] = {}


def clear() -> None:
    """Forget the folded kernels and the refusals (``dlcore.reset()``): each is made again when next
    launched."""
    with _lock:
        _folded.clear()
    refusals.clear()


def fold_launch(call: KernelCall, profile: DeviceProfile) -> KernelCall | None:
    """The ``grid_folding`` launch pass: fold a grid larger than the device holds at once."""
    programs = programs_for(call, profile)
    grid = call.grid if isinstance(call.grid, tuple) else ()
    if grid and all(isinstance(g, int) for g in grid) and math.prod(grid) <= programs:
        return None
    try:
        return fold_call(call, programs, LOOP_STAGES)
    except FoldingRefused as exc:
        name = source.kernel_name(call.kernel)
        if refusals.get(name) != str(exc):
            refusals[name] = str(exc)
            log.info("grid_folding declined %s: %s", name, exc)
        return None


#: the CUDA default: fold only launches of this many warps per program or fewer
CUDA_FOLD_MAX_WARPS = 1
SMALL_PROGRAMS_NAME = "grid_folding_small_programs"


def fold_small_programs(call: KernelCall, profile: DeviceProfile) -> KernelCall | None:
    """Fold a large grid of one-warp programs; leave other launches to ``grid_folding`` (opt-in on CUDA).

    Persistent programs win for one-warp programs over large grids, where launching a small block
    costs more than its work, and lose for programs of 4 or 8 warps (docs/performance.md, "Grid
    folding", has the numbers).
    """
    if int(call.kwargs.get("num_warps", 4)) > CUDA_FOLD_MAX_WARPS:
        return None
    return fold_launch(call, profile)


@hookimpl
def dlcore_passes() -> list[Pass]:
    return [Pass(
        name=NAME,
        stage=LAUNCH,
        run=fold_launch,
        default_on=("npu", "mlu"),
        order=100,
        doc="inter-core scheduling: a grid of G programs run by P = min(G, cores x programs per core) "
            "persistent programs",
    ), Pass(
        name=SMALL_PROGRAMS_NAME,
        stage=LAUNCH,
        run=fold_small_programs,
        backends=("cuda",),
        default_on=True,
        order=101,
        doc=f"grid folding for launches of {CUDA_FOLD_MAX_WARPS} warp per program, where it pays on CUDA",
    )]
