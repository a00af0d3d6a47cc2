"""Facades with the APIs people know: ``polyamp.compat.torch`` and ``polyamp.compat.paddle``.

Both are thin mappings onto :class:`polyamp.LossScaler`; importing them imports no framework.
"""
