"""The package namespace: lazy attributes that keep `import polyamp` light."""

from __future__ import annotations

import os
import subprocess
import sys


def test_polyamp_optim_works_after_a_bare_import_and_is_loaded_lazily():
    code = (
        "import sys, numpy as np, polyamp\n"
        "assert 'polyamp.optim' not in sys.modules, 'imported eagerly'\n"
        "p = polyamp.Parameter(np.ones(2, np.float32), np.ones(2, np.float32))\n"
        "opt = polyamp.optim.SGD([p], lr=0.5)\n"
        "opt.step()\n"
        "assert polyamp.optim is sys.modules['polyamp.optim']\n"
        "print(p.data.tolist(), [m for m in ('torch', 'cupy', 'paddle', 'mpi4py') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0.5, 0.5] []"


def test_a_bare_import_loads_no_plugin_machinery_until_a_scaler_meets_an_array():
    code = (
        "import sys, numpy as np, polyamp\n"
        "lazy = ('pluggy', 'importlib.metadata', 'polyamp.grads', 'polyamp.trainer', 'polyamp.parameter')\n"
        "print(sorted(m for m in lazy if m in sys.modules))\n"
        "scaler = polyamp.LossScaler(init_scale=4)\n"
        "print(sorted(m for m in ('pluggy', 'importlib.metadata') if m in sys.modules))\n"
        "scaler.scale(np.ones(2, np.float32))\n"
        "print(sorted(m for m in ('pluggy', 'importlib.metadata') if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "POLYAMP_BACKEND"}  # a named backend loads plugins
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split("\n")[:3] == ["[]", "[]", "['importlib.metadata', 'pluggy']"]


def test_the_lazy_names_are_the_modules_objects():
    import polyamp
    from polyamp import grads, parameter, trainer

    assert polyamp.MixedPrecisionTrainer is trainer.MixedPrecisionTrainer
    assert polyamp.clip_grad_norm_ is grads.clip_grad_norm_
    assert polyamp.Parameter is parameter.Parameter
    assert set(polyamp.__all__) <= set(dir(polyamp)) | set(polyamp._LAZY) | {"GradScaler", "optim"}
    namespace: dict = {}
    exec("from polyamp import *", namespace)
    assert namespace["StepMetrics"] is trainer.StepMetrics
