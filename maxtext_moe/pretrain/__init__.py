"""Pretraining data: your own text corpus, checked and staged before training (`text`)."""
