"""What dlscale adds to Dask's worker and scheduler processes: the device a worker computes on, helpers
its tasks share, replica counts kept by the Active Memory Manager, tensor sizes for ``dask.sizeof`` and
the one installer of dlscale's Dask extensions.

Importing this package imports nothing else: :mod:`dlscale.runtime.sizeof` is loaded by Dask's
``dask.sizeof`` entry point while Dask itself is being imported.
"""
