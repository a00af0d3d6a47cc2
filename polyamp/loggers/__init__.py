"""The scaler's ``metrics()`` in Lightning, transformers and TensorBoard, one small module per framework,
each importing its framework only when imported itself (``import polyamp`` imports none).
"""
