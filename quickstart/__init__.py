"""The quickstart's generated corpus (corpus.py): English-like sentences and their German-like translations,
with reordering, case and agreement, written as plain parallel text that data/ then reads like any other
corpus. It stands beside data/ and imports only data/'s file helpers; train.py writes it for
`data.generate=synthetic` (experiment=quickstart), tests use it as their corpus.
"""
