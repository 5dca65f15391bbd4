"""What an op, an implementation and a device are: the vocabulary every other layer speaks.

Nothing here discovers plugins, launches kernels or chooses anything: ``op`` (argument schema,
validation, reference, cost), ``signature`` (what a choice depends on), ``implementation``
(implementations and their launch plans), ``layout``, ``device`` (``DeviceProfile``), ``backend``
(the interface a hardware backend implements) and ``space`` (search spaces, declared beside kernels).
"""
