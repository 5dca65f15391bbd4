"""Where users meet the kernels: adapters from dlblas_kernels' ops to a framework's own extension
points (:mod:`dlblas_kernels.integrations.transformers`). Nothing outside this package imports a
framework; each adapter needs its extra (``dlblas-kernels[transformers]``)."""
