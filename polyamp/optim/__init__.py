"""Array-API optimizers with torch.optim's interface: SGD, Adam, AdamW."""

from .adam import Adam, AdamW
from .optimizer import Optimizer, ParamsT
from .sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "ParamsT"]
