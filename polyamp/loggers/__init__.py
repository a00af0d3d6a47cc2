"""The scaler's ``metrics()`` in the loggers people use, one small module per framework.

:mod:`polyamp.loggers.lightning` (a Lightning ``Callback``), :mod:`polyamp.loggers.transformers`
(a ``transformers.TrainerCallback``) and :mod:`polyamp.loggers.tensorboard` (event files for plain
loops). Each imports its framework only when imported itself; ``import polyamp`` imports none.
"""
