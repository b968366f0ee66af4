"""A draft is as long as its expected gain says: PassCost's measured pass widths against a
branch's measured acceptance (spec/control)."""

from test_one_answer import models  # noqa: F401 (a fixture)
from test_speculation import engine

from localkv.spec.control import MARGIN, ROW_PRIOR, PassCost, Speculator, unavailable
from localkv.spec.ngram import NgramIndex


def test_unmeasured_widths_take_the_prior_and_measured_ones_replace_it():
    cost = PassCost()
    assert cost.ratio(1, 4) == 1 + 3 * ROW_PRIOR
    cost.observe(4, 0.030)  # no 1-row pass seen yet: nothing to compare with
    assert cost.ratio(1, 4) == 1 + 3 * ROW_PRIOR
    cost.observe(1, 0.010)
    for _ in range(40):
        cost.observe(4, 0.030)
    assert abs(cost.ratio(1, 4) - 3.0) < 0.01
    assert cost.ratio(1, 3) == 1 + 2 * ROW_PRIOR


def test_the_best_length_grows_with_acceptance_and_shrinks_with_cost():
    cost = PassCost()
    lengths = [cost.best(8, a) for a in (0.05, 0.3, 0.6, 0.9, 0.99)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] == 8
    for rows in range(1, 10):  # a machine where every row costs a step
        cost.observe(rows, 0.01 * rows)
    assert cost.best(8, 0.9) == 0


def test_a_length_is_chosen_only_when_it_beats_a_plain_step():
    cost = PassCost()
    cost.observe(1, 0.010)
    cost.observe(2, 0.015)  # one drafted row: half a step more
    assert cost.best(1, 0.5) == 0  # 1.5 tokens for 1.5 steps: no gain
    assert cost.best(1, 0.5 + 1.5 * MARGIN + 0.01) == 1


def test_a_busy_pass_drafts_less():
    """Eight sequences decoding: a draft's rows add its accepted tokens to eight, so the same
    acceptance that pays alone does not pay beside them."""
    cost = PassCost()
    assert cost.best(2, 0.5, decoding=1) > 0
    assert cost.best(2, 0.5, decoding=8) == 0
    assert cost.best(2, 0.99, decoding=8) > 0


def test_a_branch_that_stops_drafting_tries_again_later():
    """Rejections bring the acceptance low enough that no draft pays; each refusal fades that
    evidence, so a branch whose text starts copying is drafted for again."""
    sp = Speculator(NgramIndex(2, 2), 8, cost=PassCost())
    tokens = [1, 2, 3, 1, 2]  # "1 2" seen before: a draft of what followed
    for _ in range(6):
        sp.record(4, 0)
    assert sp.acceptance() < 0.2
    assert sp.propose(tokens, 8) == []
    tries = 0
    while not sp.propose(tokens, 8):
        tries += 1
        assert tries < 200, "a refused branch never drafted again"
    assert tries > 2


def test_whether_speculation_runs_is_the_policys_to_say(models):  # noqa: F811
    """spec.control asks the policy what it can do, not its name: a policy that says it cannot
    roll back turns speculation off, whatever it is called."""
    eng = engine(models("llama-Q4_1"), spec="ngram")
    assert unavailable(eng) == ""
    eng.policy.can_roll_back = False
    assert "cannot roll back" in unavailable(eng)
