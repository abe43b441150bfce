"""The trainer's framework-free update rules: the built-in optimizers are them, and nothing of Keras is needed."""

from __future__ import annotations

import numpy as np
import pytest

from daskdist.training import update_rules


@pytest.mark.parametrize("name, kwargs", [
    ("sgd", {"learning_rate": 0.1}),
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    ("adam", {"learning_rate": 0.01}),
    ("rmsprop", {"learning_rate": 0.01, "momentum": 0.5}),
])
def test_the_built_in_optimizers_apply_the_trainers_rules_bit_for_bit(name, kwargs):
    from daskdist.keras import optimizers

    rng = np.random.default_rng(0)
    params = [rng.standard_normal((3, 4)).astype("float32"), rng.standard_normal(4).astype("float32")]
    rule = update_rules.RULES[name](**kwargs)
    optimizer = optimizers.get(name)
    optimizer = type(optimizer)(**kwargs)
    assert isinstance(optimizer, update_rules.RULES[name])
    by_rule, by_optimizer = [p.copy() for p in params], [p.copy() for p in params]
    for _ in range(4):
        grads = [rng.standard_normal(p.shape).astype("float32") for p in params]
        rule.apply(by_rule, grads)
        optimizer.apply(by_optimizer, grads)
    for a, b in zip(by_rule, by_optimizer):
        np.testing.assert_array_equal(a, b)
    assert by_rule[0].tolist() != params[0].tolist()
    assert rule.get_config() == {k: v for k, v in optimizer.get_config().items()}
    state = rule.get_state()
    fresh = update_rules.RULES[name](**kwargs)
    fresh.set_state(state)
    assert fresh.iterations == 4


def test_rules_refuse_mismatched_lists():
    rule = update_rules.SGD(0.1)
    with pytest.raises(ValueError, match="1 params but 2 grads"):
        rule.apply([np.zeros(2)], [np.zeros(2), np.zeros(2)])

