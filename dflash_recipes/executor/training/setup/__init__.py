"""The builders the run's ``setup()`` calls, one per part of a run: resume, data, models,
optimiser; each returns what the loop needs."""
