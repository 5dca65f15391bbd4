"""Dispatch: one ``Dispatcher`` turns ``(op name, inputs)`` into a bound op through its key, its
in-process memo and its disk store, selecting (``dlcore.tuning``) on a miss."""
