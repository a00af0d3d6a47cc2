"""Put first on PYTHONPATH by tools/mutants.py: with POLYAMP_MUTANT=NAME set, that mutant is applied
to its module when it is imported, in this process and every Python process it starts."""

import os

if os.environ.get("POLYAMP_MUTANT"):
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location(
        "polyamp_tools_mutants", Path(__file__).resolve().parents[1] / "mutants.py")
    _mutants = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mutants)
    _mutants.install(os.environ["POLYAMP_MUTANT"])
