"""Autotuning: search spaces declared beside kernels, and the strategies that search them.

:mod:`dlcore.declarations.space` says what may be tried; :mod:`dlcore.tuning.strategy` is the one interface
every strategy (built-in or plugin) implements; :mod:`dlcore.tuning.strategies` holds the built-ins.
"""
