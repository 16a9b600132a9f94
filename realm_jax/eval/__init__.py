"""Evaluation: the answering model (`qa_model`), open-QA metrics and the
eval job (`qa_eval`), and what pre-training buys (`pretrain_eval`)."""
