from dlcore import hookimpl


@hookimpl
def dlcore_ops():
    raise RuntimeError("declaring ops failed")
