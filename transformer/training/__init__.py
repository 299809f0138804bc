"""Training: the steps train.py's procedure calls. Where a run starts and the objects it holds (run.py),
one update (update.py), what the ranks agree on (agreement.py), the wall-clock budget (budget.py), the
learning-rate schedule and optimizer (schedule.py), fine-tuning (finetune.py), validation and the end of a
run (validation.py), and the records a run leaves (run_record.py). It is the top of the library: it may
import data/, quickstart/, the core, decoding/ and evaluation/; nothing imports it but the entry
scripts.
"""
