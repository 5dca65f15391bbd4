"""Plugins: the hook contract (``hookspecs``), their discovery through entry points
(``discovery``), the index of what each kernel plugin provides (``index``), and the ``registry`` of
ops, implementations, backends, passes and strategies built from them."""
