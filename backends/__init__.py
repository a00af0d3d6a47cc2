"""polyamp's built-in backend plugins: kernels only, no policy; one module per array library.

Each is registered through the ``polyamp`` entry-point group exactly as a third-party
plugin is; importing this package imports no array library.
"""
