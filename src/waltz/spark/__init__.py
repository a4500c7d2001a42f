"""The PySpark ``waltz`` data source (optional extra: ``pip install waltz-log[spark]``)."""
