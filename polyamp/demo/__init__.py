"""``polyamp demo``: one MLP trained three ways (float32, float16 without loss scaling, float16
with polyamp) on spirals generated in code, where float16 gradients underflow without scaling.

Needs only NumPy; progress bars use tqdm, the plot matplotlib and ``--dtype bfloat16`` on
NumPy ml_dtypes, when they are installed (``pip install 'polyamp[demo]'`` brings all three).
"""

from .data import spirals
from .mlp import MLP, softmax_cross_entropy
from .run import DemoSettings, RunResult, run_demo

__all__ = ["MLP", "DemoSettings", "RunResult", "run_demo", "softmax_cross_entropy", "spirals"]
