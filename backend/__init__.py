"""LightSpec's Triton side: the Python-based backend (``model.py``), its Triton-free helpers, the
server launcher and the ``lightspec`` command line.

Only ``model.py``, ``orchestrator.py``'s callers and ``bls.py``'s callers touch
``triton_python_backend_utils``; it is passed in as a module, never imported here, so every other
module imports and unit-tests without a Triton server.
"""
