"""``MLP.predict`` writes nothing a training step reads, so it can run beside one (another thread)."""

import numpy as np

from polyamp.demo import MLP, softmax_cross_entropy, spirals


class Watched(MLP):
    """An MLP that counts the writes of its training cache."""

    writes = 0

    def __setattr__(self, name, value):
        if name == "_cache":
            type(self).writes += 1
        super().__setattr__(name, value)


def test_predict_writes_no_training_state():
    x, y = spirals(16, seed=0)
    model = Watched([2, 8, 3], seed=0)
    model.forward(x, "float16")
    before = Watched.writes
    labels = model.predict(x)
    assert Watched.writes == before  # a forward on another thread would otherwise see its cache replaced
    assert labels.shape == (x.shape[0],) and set(np.unique(labels)) <= {0, 1, 2}


def test_predict_between_forward_and_backward_leaves_the_gradients():
    x, y = spirals(16, seed=0)
    grads = []
    for between in (False, True):
        model = MLP([2, 8, 3], seed=0)
        for p in model.parameters():
            p.grad = np.zeros_like(p.data)
        logits = model.forward(x, "float16")
        if between:
            model.predict(x[::-1])
        model.backward(softmax_cross_entropy(logits, y)[1])
        grads.append([np.array(p.grad) for p in model.parameters()])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)
