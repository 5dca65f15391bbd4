"""The kernel modules, one per op and each its own ``dlcore.kernels`` entry point.

A module holds a kernel's whole story: the ``@triton.jit`` kernels, the launch plans, the torch
reference, the search space and heuristic default, the op declaration, and one
:func:`~dlcore.runtime.template.define_kernel` call that generates the rest (custom op, fake,
autograd, implementation, public function, plugin hooks). Nothing here imports them: a process
that calls one kernel builds no other.
"""
