"""Watching training: statistics of a fit (``TrainingStats``), their timeline report, the live panel in
Dask's dashboard and the driver's progress. Monitoring observes training and imports none of it."""
