"""Evaluation: how good a model's translations are, and the paper's tables. Metrics (scoring.py: sacreBLEU,
chrF, the paper's tokBLEU), test sets (testsets.py), the measures validation shares with evaluate.py
(measures.py: corpus NLL, split BLEU, results files), the steps evaluate.py puts together (steps.py), paired
significance (significance.py), every checkpoint of a run scored (sweep.py), Tables 2 and 3 (tables.py,
table3.py), the report and its figures (report.py) and attention word alignments (alignment.py). It may
import data/, the core and decoding/; nothing of training/ or interop/.
"""
