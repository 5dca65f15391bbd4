from dlcore import hookimpl
from dlcore.declarations.backend import Backend


class Impostor(Backend):
    name = "impostor"
    device_types = ("cpu",)


@hookimpl
def dlcore_backends():
    return [Impostor()]
