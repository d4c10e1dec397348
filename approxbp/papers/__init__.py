"""The papers reproduced (``approxbp reproduce``): their printed solutions against our fits (:mod:`.reproduce`),
their memory tables as planner requests (:mod:`.paper_memory`), Approx-BP App. B and Fig. 2 measured
(:mod:`.appendix_b`), BDIA's analysis and toy BDIA-GPT (:mod:`.bdia_experiments`) and every docs figure
(:mod:`.figures`). Imports the planner and the three layers below, never the command line."""

__all__ = []

