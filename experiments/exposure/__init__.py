"""Run-time exposure on real rollouts: the exposure benchmark (`python -m experiments.exposure.main`, run.py), issue
36's E1 (e1.py) and issue 47's E1b (e1b.py, e1b_arms.py, e1b_criteria.py), on the shared phases of study.py."""
