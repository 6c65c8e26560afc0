"""The gradient-norm SDC rule leaves out members that computed nothing this step.

At the end of an ``ElasticSampler`` data epoch the last global batch may hold fewer samples
than members: the members with an empty share run no backward and report a norm of 0. They
must neither be named nor pull the others' median to 0.
"""

from __future__ import annotations

from stalwart.elastic.commit import DEFAULT_GRAD_NORM_K, grad_signals


def test_members_with_empty_shares_make_no_suspect_of_the_one_with_the_last_sample() -> None:
    # a batch of 1 sample among 3 members: only worker 2 computed a gradient
    assert grad_signals([0, 0, 0], [0.0, 0.0, 4.0], DEFAULT_GRAD_NORM_K) == ([], [])
    assert grad_signals([0, 0, 0], [0.0, 4.0, 1e-6], DEFAULT_GRAD_NORM_K) == ([], [])


def test_the_rule_counts_only_members_that_computed_gradients() -> None:
    # one empty share, three computed: the rule still applies among the three
    assert grad_signals([0, 0, 0, 0], [0.0, 1.0, 1.21, 2500.0], 10.0) == ([], [3])
    # two empty shares leave two computed: too few for a median of the others
    assert grad_signals([0, 0, 0, 0], [0.0, 0.0, 1.0, 2500.0], 10.0) == ([], [])


def test_a_non_finite_member_still_counts_as_computed_for_nothing() -> None:
    assert grad_signals([1, 0, 0, 0], [0.0, 1.0, 1.0, 1.0], 10.0) == ([0], [])
