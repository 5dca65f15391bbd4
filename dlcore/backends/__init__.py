"""Backends built into dlcore (registered through the same entry points as any plugin)."""
