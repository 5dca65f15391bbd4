"""The public API: one module, dlcore.api, whose names dlcore itself exposes."""

import dlcore
import dlcore.api


def test_dlcore_exposes_exactly_the_api():
    assert dlcore.__all__ == dlcore.api.__all__
    for name in dlcore.api.__all__:
        assert getattr(dlcore, name) is getattr(dlcore.api, name), name


def test_what_the_plugin_guide_imports_is_there():
    from dlcore import (  # noqa: F401
        Backward,
        BoundOp,
        DeviceProfile,
        KernelCall,
        LaunchPlan,
        Op,
        PowerOfTwo,
        ScalarArg,
        SearchSpace,
        Signature,
        TensorArg,
        TorchImplementation,
        TritonImplementation,
        VendorImplementation,
        define_kernel,
        hookimpl,
    )

    assert hookimpl.project_name == "dlcore"
    assert issubclass(dlcore.ForwardOnlyWarning, UserWarning) and issubclass(dlcore.UnknownOpError, dlcore.DlcoreError)
