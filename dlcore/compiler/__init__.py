"""The compiler side: lowering kernels per target, passes, IR dumps."""
