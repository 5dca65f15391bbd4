"""A kernel plugin whose module forgot its hook functions: it loads, and provides nothing."""

SOFTCAP = "declared, but never handed to dlcore: there is no dlcore_ops hook"
