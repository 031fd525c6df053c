"""Who may ask the models what: the run's internal key and the admin key, sealed chunks and issued stream ids, and what the publicly reachable vocoder accepts."""
