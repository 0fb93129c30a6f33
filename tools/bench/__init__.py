"""``maskd bench``: measured figures, maskd next to the in-process baselines in one run.

Modes (one module each; ``maskd bench MODE --help``):

- ``engines`` (:mod:`maskd_tools.bench.engines`): MaskBench-style time to first mask (TTFM) and time
  between masks (TBM) for in-process llguidance and in-process xgrammar on the same files and
  tokenizer.
- ``serve`` (:mod:`maskd_tools.bench.serve`): a simulated GPU worker replays MaskBench token streams as a
  decode loop through maskd (``step_async``, a slept forward pass); step service time next to the
  in-process fill of the same batch, mask wait after the forward pass, server memory per 1,000
  live sequences.
- ``wire`` (:mod:`maskd_tools.bench.wire`): bytes per mask row per encoding and as actually sent.
- ``profile`` (:mod:`maskd_tools.bench.profile`): py-spy over a server answering batch-256 steps; the
  top entries by own time.

Every mode writes ``<mode>.json``, ``<mode>.md`` and PNG plots into ``--out`` (default
``out/bench-<mode>``). Nothing here asserts timings: tests only check that the figures exist.
"""
