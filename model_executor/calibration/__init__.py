"""Calibration of sparse prefill to a quality budget (``python -m router calibrate``).

- ``text``: the offline calibration text (CPython's ``pydoc_data.topics``) and token windows.
- ``metrics``: KL, top-1 agreement and perplexity of sparse against dense logits.
- ``needle``: needle-in-a-haystack prompts, greedy answers on a ModelRunner, scoring.
- ``lastword``: the shipped last-word task's items and their greedy score.
- ``grid``: the settings measured (alpha, per-layer schedule, dense last tiles, energy rule,
  dense first layers).
- ``settings``: the run's options and the quality budget (messages name the flag).
- ``forwards``: one prefill's tail logits and block density, token-budget batches, the time guard.
- ``calibrate``: the run: the measurements of every setting at every length.
- ``selection``: each setting's verdict, the chosen one and its profile
  (``model_executor.sparse_profile.SparseProfile``).
- ``table``: the profile's Pareto table as Markdown; ``cli``: the command's options.

The evaluations (``evals/real_fidelity.py``, ``evals/niah.py``, ``evals/tasks/lastword``) use
these same pieces. No Ray, no pydantic: this runs on a bare GPU host.
"""
