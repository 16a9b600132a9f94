"""The retrieval index: embedding the corpus (`embed`), maximum inner product
search (`searchers`), publication (`publish`) and the builder job."""
