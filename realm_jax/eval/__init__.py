"""Open-QA evaluation (`qa_eval`): exact match, recall@k, the eval job."""
