"""The package namespace: lazy attributes that keep `import polyamp` light."""

from __future__ import annotations

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
